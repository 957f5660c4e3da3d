#!/bin/bash
# call G: tp=2 bench, new2 (DW_TILE clusters 2x1) / new / new2 / new
export PYTHONUNBUFFERED=1
L=$OUT/g.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + 400 ))
for tree in new2 new new2 new; do
  [ $(date +%s) -gt $((END - 90)) ] && { echo "$tree skipped: past the end" >> $L; continue; }
  rm -rf /tmp/tp; (cd $R/$tree && PYTHONPATH=$R/$tree:$QP timeout 100 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --out /tmp/tp >> $OUT/g-tp2.log 2>&1)
  python3 $S/tp2.py "tp2 $tree" /tmp/tp/bench-tp2.json >> $L 2>&1
done
cat $L
