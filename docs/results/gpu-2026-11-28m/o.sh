#!/bin/bash
# thirteenth session, call O: the one-GPU bars at a settled clock (--settle 1): Llama-3-8B on GPU 0 and Gemma-2-2B on
# GPU 1 at once (each H100 has its own power limit), main's vpce against quack's base path, quack auto and
# torch.compile, the frozen head, the variants and the lean route; then tp=2 (--settle 1) on both GPUs
export PYTHONUNBUFFERED=1
L=$OUT/o.txt; S=$PWD/.dev/s; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + ${KT:-560} ))
nvidia-smi --query-gpu=name --format=csv,noheader > $L; git -C $F log --oneline -1 >> $L 2>&1
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
M=floor,vpce-triton,quack-base,quack,compile,vpce-softcap,vpce-metrics,vpce-triton-lean,vpce-triton-frozen,quack-base-frozen,compile-frozen
one() {  # gpu shape
  (cd $F && CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$F:$QP timeout 330 python3 -m vpce.bench --shapes $2 --methods $M \
     --skip-no-grad --settle 1 --row-timeout 80 --out /tmp/one-$2 > $OUT/one-$2.log 2>&1)
  python3 $S/rows.py "tp1 $2" /tmp/one-$2/bench.json
}
one 0 llama3-8b > /tmp/o1 2>&1 & one 1 gemma2-2b > /tmp/o2 2>&1 & wait; cat /tmp/o1 /tmp/o2 >> $L
for i in 1 2 3; do
  [ $(date +%s) -gt $((END - 60)) ] && { echo "tp2 $i skipped" >> $L; break; }
  rm -rf /tmp/tp; (cd $F && PYTHONPATH=$F:$QP timeout 80 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --settle 1 --out /tmp/tp >> $OUT/bench.log 2>&1)
  python3 $S/tp2.py "tp2 main settle=1 $(date +%T)" /tmp/tp/bench-tp2.json >> $L 2>&1
done
cat $L
