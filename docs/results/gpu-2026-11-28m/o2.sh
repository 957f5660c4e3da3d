#!/bin/bash
# thirteenth session, call O2: the one-GPU bars at a settled clock (--settle 1) with the bench's time-limit fix
# (rows after an abandoned one compile quack's kernels in process): Llama-3-8B on GPU 0 (vpce against quack's base
# path, last, and torch.compile), Gemma-2-2B on GPU 1 (vpce against torch.compile and quack auto, the soft cap)
export PYTHONUNBUFFERED=1
L=$OUT/o2.txt; S=$PWD/.dev/s; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
nvidia-smi --query-gpu=name --format=csv,noheader > $L; git -C $F log --oneline -1 >> $L 2>&1
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
one() {  # gpu shape methods limit row-limit
  (cd $F && CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$F:$QP timeout $4 python3 -m vpce.bench --shapes $2 --methods $3 \
     --skip-no-grad --settle 1 --row-timeout $5 --out /tmp/one-$2 > $OUT/one-$2.log 2>&1)
  python3 $S/rows.py "tp1 $2" /tmp/one-$2/bench.json
}
one 0 llama3-8b floor,vpce-triton,compile,quack-base 300 200 > /tmp/o1 2>&1 &
one 1 gemma2-2b floor,vpce-triton,compile,quack,vpce-softcap 200 90 > /tmp/o2 2>&1 &
wait; cat /tmp/o1 /tmp/o2 >> $L
cat $L
