#!/bin/bash
# call H: the variants again, one process per head (GPU 0 Llama-3-8B, GPU 1 Gemma-2-2B), at new
export PYTHONUNBUFFERED=1
S=$PWD/.dev/s; R=$PWD/.dev/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
run() {
  (cd $R/new && CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$R/new:$QP timeout 230 python3 -m vpce.bench --shapes $2 \
     --methods floor,vpce-triton,vpce-softcap,vpce-all,vpce-dft,vpce-metrics --skip-no-grad --row-timeout 100 --out /tmp/h-$2 > $OUT/h-$2.log 2>&1)
  python3 $S/rows.py $2 /tmp/h-$2/bench.json
}
run 0 llama3-8b > $OUT/h-l.txt 2>&1 &
run 1 gemma2-2b > $OUT/h-g.txt 2>&1 &
wait; cat $OUT/h-l.txt $OUT/h-g.txt
