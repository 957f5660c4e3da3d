#!/bin/bash
# thirteenth session, call O3: Llama-3-8B on one GPU at a settled clock (--settle 1), floor / vpce / torch.compile,
# on each GPU at once (two readings), with no quack base row (its first call tunes for more than 200 s)
export PYTHONUNBUFFERED=1
L=$OUT/o3.txt; S=$PWD/.dev/s; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
nvidia-smi --query-gpu=name --format=csv,noheader > $L; git -C $F log --oneline -1 >> $L 2>&1
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
one() {  # gpu
  (cd $F && CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$F:$QP timeout 150 python3 -m vpce.bench --shapes llama3-8b \
     --methods floor,vpce-triton,compile --skip-no-grad --settle 1 --row-timeout 90 --out /tmp/one-$1 > $OUT/one-$1.log 2>&1)
  python3 $S/rows.py "tp1 llama3-8b gpu$1" /tmp/one-$1/bench.json
}
one 0 > /tmp/o1 2>&1 & one 1 > /tmp/o2 2>&1 & wait; cat /tmp/o1 /tmp/o2 >> $L
cat $L
