#!/bin/bash
# call C (x2, quack installed): every peer on one GPU per head, in one bench process each, at new (= main on one
# GPU: the change is under a group only). GPU 0 Llama-3-8B, GPU 1 Gemma-2-2B at the same time.
export PYTHONUNBUFFERED=1
S=$PWD/.dev/s; R=$PWD/.dev/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
bash $S/install.sh > $OUT/c-install.txt 2>&1 || { cat $OUT/c-install.txt; exit 1; }
run() {  # GPU shape methods tag
  (cd $R/new && CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$R/new:$QP timeout ${T:-540} python3 -m vpce.bench --shapes $2 \
     --methods $3 --skip-no-grad --row-timeout 150 --out /tmp/c-$4 > $OUT/c-$4.log 2>&1)
  python3 $S/rows.py $4 /tmp/c-$4/bench.json
}
run 0 llama3-8b floor,quack-base,vpce-triton,quack-base-frozen,vpce-triton-frozen,vpce-softcap,vpce-metrics,vpce-triton-lean llama > $OUT/c-llama.txt 2>&1 &
run 1 gemma2-2b floor,compile,quack,vpce-triton,vpce-softcap,vpce-all,vpce-dft,vpce-metrics,vpce-triton-lean gemma > $OUT/c-gemma.txt 2>&1 &
wait
cat $OUT/c-llama.txt $OUT/c-gemma.txt; nvidia-smi --query-gpu=name --format=csv,noheader
