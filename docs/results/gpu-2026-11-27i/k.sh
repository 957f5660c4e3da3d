#!/bin/bash
# call K (x2, after a.sh): quack installed; tp=2 profiles (launch/profile_tp.py, 4 profiled steps) at new and at
# nohalf (new with each chunk's statistics in one launch, not two halves), each trace's kernels summed (ksum.py);
# then bench_tp nohalf / new once each if time is left
export PYTHONUNBUFFERED=1
L=$OUT/k.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + ${KT:-170} ))
nvidia-smi --query-gpu=name --format=csv,noheader > $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
for tree in nohalf new; do
  (cd $R/$tree && PYTHONPATH=$R/$tree:$QP timeout 70 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py \
     --reps 10 --profile-steps 4 --out /tmp/prof-$tree > $OUT/prof-$tree.txt 2>&1)
  echo "== $tree $(grep median $OUT/prof-$tree.txt)" >> $L
  python3 $S/ksum.py /tmp/prof-$tree/trace-tp2-rank0.json /tmp/prof-$tree/trace-tp2-rank1.json 2>&1 | grep -v "elementwise\|reduce_kernel\|Fill" | head -20 >> $L
done
for tree in nohalf new; do
  [ $(date +%s) -gt $((END - 45)) ] && { echo "bench $tree skipped" >> $L; continue; }
  rm -rf /tmp/tp; (cd $R/$tree && PYTHONPATH=$R/$tree:$QP timeout 60 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --out /tmp/tp >> $OUT/k-tp2.log 2>&1)
  python3 $S/tp2.py "tp2 $tree" /tmp/tp/bench-tp2.json >> $L 2>&1
done
cat $L
