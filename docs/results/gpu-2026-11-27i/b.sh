#!/bin/bash
# call B (x2, right after a.sh): quack installed; tp-one-dw's GPU tests on 2 GPUs (test_multi_gpu, test_memory_route,
# with the extra); then launch/bench_tp.py (floor, plain; Llama-3-8B head) at new / main / new / main; then a tp=2
# profile at new if time is left.
export PYTHONUNBUFFERED=1
L=$OUT/b.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat $R/commit.txt >> $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
END=$(( $(date +%s) + 520 ))
(cd $R/new && PYTHONPATH=$R/new:$QP timeout 200 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_multi_gpu.py \
   tests/test_memory_route.py > $OUT/tests-new.txt 2>&1); echo "tests new: $(tail -1 $OUT/tests-new.txt)" >> $L
grep "^FAILED\|^ERROR" $OUT/tests-new.txt >> $L
for tree in new main new main; do
  [ $(date +%s) -gt $((END - 100)) ] && { echo "$tree skipped: past the end" >> $L; continue; }
  rm -rf /tmp/tp; (cd $R/$tree && PYTHONPATH=$R/$tree:$QP timeout 110 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --out /tmp/tp >> $OUT/tp2.log 2>&1)
  python3 $S/tp2.py "tp2 $tree" /tmp/tp/bench-tp2.json >> $L 2>&1
done
if [ $(date +%s) -lt $((END - 60)) ]; then
  (cd $R/new && PYTHONPATH=$R/new:$QP timeout 80 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py \
     --reps 10 --profile-steps 4 --out /tmp/prof-2 > $OUT/tp2prof.txt 2>&1); grep median $OUT/tp2prof.txt >> $L
fi
cat $L
