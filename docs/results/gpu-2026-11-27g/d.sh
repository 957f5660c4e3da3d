#!/bin/bash
# call D (x2, right after C; quack installed): where the one-GPU step's time goes on the Llama head, main with the
# extra: vpce-triton and vpce-softcap on GPU 0, then main / cap-mufu-rcp (plain, soft cap); quack-base on GPU 1 (its
# compile takes about 190 s).
export PYTHONUNBUFFERED=1
ROOT=$PWD
R=$PWD/.scratch/qc11/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
(cd $R/main && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$R/main:$QP timeout 200 python3 -m vpce.bench --shapes llama3-8b --profile \
   --methods vpce-triton,vpce-softcap --out $OUT/prof-vpce > $OUT/prof-vpce.log 2>&1
 # then the soft cap's reciprocal in the gradient pass: main / cr (cap-mufu-rcp), both heads, one run each
 cd $ROOT && END=$(( $(date +%s) + 300 )) CUDA_VISIBLE_DEVICES=0 ORDER="main BR" T=90 bash .scratch/qc11/ab.sh $OUT/ab-cr.txt cr:floor,vpce-triton,vpce-softcap) &
(cd $R/main && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$R/main:$QP timeout 400 python3 -m vpce.bench --shapes llama3-8b \
   --profile --methods quack-base --out $OUT/prof-quack > $OUT/prof-quack.log 2>&1) &
wait
tail -40 $OUT/prof-vpce.log; tail -30 $OUT/prof-quack.log; cut -c1-500 $OUT/ab-cr.txt
