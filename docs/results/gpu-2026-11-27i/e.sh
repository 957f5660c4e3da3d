#!/bin/bash
# call E: the tp=2 profile's kernels at new (traces left by call B), and quack's base path on the Llama head with a
# row timeout long enough for its first step's compilation (GPU 0)
export PYTHONUNBUFFERED=1
S=$PWD/.dev/s; R=$PWD/.dev/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
ls /tmp/prof-2 > $OUT/e-ksum.txt; python3 $S/ksum.py /tmp/prof-2/*.json >> $OUT/e-ksum.txt 2>&1
(cd $R/new && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$R/new:$QP timeout 540 python3 -m vpce.bench --shapes llama3-8b \
   --methods floor,quack-base,vpce-triton --skip-no-grad --row-timeout 450 --out /tmp/e-q > $OUT/e-quack.log 2>&1)
python3 $S/rows.py llama /tmp/e-q/bench.json
cat $OUT/e-ksum.txt
