#!/bin/bash
# call B (right after qc11/a.sh): quack installed; the dX/dW config probe (Llama GPU 0, Gemma GPU 1); the pick
# written into trees/tuned (= trees/main with DX_TILE / DW_TILE replaced); A/B main / tuned / tuned / main.
export PYTHONUNBUFFERED=1
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
T0=$(date +%s)
L=$OUT/b.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat .scratch/qc11/commit.txt >> $L
bash .scratch/qc3/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
echo "installed at $(( $(date +%s) - T0 )) s" >> $L
(cd .scratch/qc11/trees/main && CUDA_VISIBLE_DEVICES=0 ONLY=llama PYTHONPATH=$PWD:$QP timeout 200 python3 $OLDPWD/.scratch/qc12/probe.py >> $L 2>&1) &
(cd .scratch/qc11/trees/main && CUDA_VISIBLE_DEVICES=1 ONLY=gemma PYTHONPATH=$PWD:$QP timeout 200 python3 $OLDPWD/.scratch/qc12/probe.py >> $L 2>&1) &
wait
echo "probed at $(( $(date +%s) - T0 )) s" >> $L
python3 .scratch/qc12/pick.py > $OUT/pick.txt 2>> $L || { cat $L; exit 1; }
cat $OUT/pick.txt >> $L
rm -rf .scratch/qc11/trees/tuned && cp -r .scratch/qc11/trees/main .scratch/qc11/trees/tuned
G=.scratch/qc11/trees/tuned/vpce/gemm.py
sed -i "s/^DW_TILE = dict(.*/$(grep ^DW_TILE $OUT/pick.txt)/; s/^DX_TILE = .*/$(grep ^DX_TILE $OUT/pick.txt)/" $G
grep -n "^DW_TILE\|^DX_TILE" $G >> $L
export END=$(( T0 + ${BUDGET:-500} ))
(CUDA_VISIBLE_DEVICES=0 SHAPES=llama3-8b ORDER="main BR BR main" T=90 bash .scratch/qc11/ab.sh $OUT/ab-l.txt tuned:floor,vpce-triton,vpce-triton-frozen) &
(CUDA_VISIBLE_DEVICES=1 SHAPES=gemma2-2b ORDER="main BR BR main" T=90 bash .scratch/qc11/ab.sh $OUT/ab-g.txt tuned:floor,vpce-triton,vpce-triton-frozen) &
wait
cat $L; cut -c1-400 $OUT/ab-*.txt
