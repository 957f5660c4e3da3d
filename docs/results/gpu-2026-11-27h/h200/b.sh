#!/bin/bash
# call B (x2, right after a.sh): quack installed. GPU 0: the gradient pass alone at main and at cl (gradpass.py),
# then cl's GPU tests of the soft cap (variants, distillation, triton backend). GPU 1 at the same time: A/B main /
# cl / cl / main (floor, plain, soft cap, all four options, metrics), both heads.
export PYTHONUNBUFFERED=1
H=.scratch/qc13
R=$PWD/$H/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
L=$OUT/b.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat $H/commit.txt >> $L
bash .scratch/qc3/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
export END=$(( $(date +%s) + 440 ))
(export CUDA_VISIBLE_DEVICES=0
 for tr in main cl; do (cd $R/$tr && TAG=$tr PYTHONPATH=$R/$tr:$QP timeout 150 python3 $R/../gradpass.py > $OUT/gradpass-$tr.txt 2>&1); done
 (cd $R/cl && PYTHONPATH=$R/cl:$QP timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE -k "cap or softcap" \
    tests/test_triton_backend.py tests/test_variants.py tests/test_distillation_triton.py tests/test_metrics.py \
    > $OUT/tests-cl.txt 2>&1); echo "cl tests: $(tail -1 $OUT/tests-cl.txt)" >> $L) &
(export CUDA_VISIBLE_DEVICES=1
 ORDER="main BR BR main" T=100 bash $H/ab.sh $OUT/ab-cl.txt cl:floor,vpce-triton,vpce-softcap,vpce-all,vpce-metrics) &
wait
cat $L; grep "bm16 w4" $OUT/gradpass-*.txt; cut -c1-520 $OUT/ab-cl.txt
