#!/bin/bash
# call B (x2, right after a.sh): quack installed. GPU 0: the GPU tests of both branches with the extra.
# GPU 1 at the same time: A/B main / mg / mg / main (floor, plain, metrics, soft cap), both heads.
export PYTHONUNBUFFERED=1
H=.scratch/qc11
R=$PWD/$H/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
L=$OUT/b.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat $H/commit.txt >> $L
bash .scratch/qc3/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
export END=$(( $(date +%s) + 430 ))
(for br in mg etp; do
   (cd $R/$br && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$R/$br:$QP timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE \
      tests/test_triton_backend.py tests/test_metrics.py -k "epilogue or hopper or gradient_pass or oracle or ties" \
      > $OUT/tests-$br.txt 2>&1); echo "$br: $(tail -1 $OUT/tests-$br.txt)" >> $L
 done) &
(export CUDA_VISIBLE_DEVICES=1;
 ORDER="main BR BR main" T=100 bash $H/ab.sh $OUT/ab-mg.txt mg:floor,vpce-triton,vpce-metrics,vpce-softcap) &
wait
cat $L; cut -c1-600 $OUT/ab-mg.txt
