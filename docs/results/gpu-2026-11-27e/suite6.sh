#!/bin/bash
# One GPU's whole test suite (CUDA_VISIBLE_DEVICES=$GPU) from the repository root: test_memory_route alone first
# (it weighs free memory), then the 8 groups of groups.txt at once (balanced by the fourth session's per-file
# times; the two slowest files split with -k), each test logged as it ends (instalog.py). QUACK=1: with the hopper
# extra (quack in /tmp/quack). Writes $OUT/suite-$TAG.txt, tall-$TAG.txt, logs-$TAG.txt.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=2 VPCE_OFFLINE=1 CUDA_VISIBLE_DEVICES=$GPU
Q=/tmp/quack/site-packages
H=$(dirname $(readlink -f $0))
export PYTHONPATH=$PWD:/tmp/site:$H
[ "$QUACK" = 1 ] && export PYTHONPATH=$PYTHONPATH:$Q:$Q/nvidia_cutlass_dsl/dsl_packages
S=$OUT/suite-$TAG.txt
export INSTALOG=$OUT/tall-$TAG.txt
nvidia-smi --query-gpu=name --format=csv,noheader -i $GPU > $S
python3 -c "from vpce import gemm; print('hopper extra:', gemm._quack() is not None)" >> $S 2>&1
PT="python3 -m pytest -q -p no:cacheprovider -p instalog -rfE"
timeout 90 $PT tests/test_memory_route.py > /tmp/salone-$TAG.log 2>&1
echo "alone: $(tail -1 /tmp/salone-$TAG.log)" >> $S
grep "^FAILED\|^ERROR" /tmp/salone-$TAG.log >> $S
echo "start $(date +%T)" >> $S
k=0
while IFS= read -r line; do
  (
    end=$((SECONDS + ${SUITE_T:-330}))
    plain=""; IFS=';' read -ra parts <<< "$line"
    for p in "${parts[@]}"; do
      p=$(echo $p)
      if [[ "$p" == *" -k "* ]]; then
        eval "timeout $((end - SECONDS)) $PT $p" >> /tmp/s$k-$TAG.log 2>&1; echo "[$p] $(tail -1 /tmp/s$k-$TAG.log)" >> /tmp/r$k-$TAG.txt
      else plain+=" $p"; fi
    done
    timeout $((end - SECONDS)) $PT $plain >> /tmp/s$k-$TAG.log 2>&1; echo "[$plain] $(tail -1 /tmp/s$k-$TAG.log)" >> /tmp/r$k-$TAG.txt
  ) &
  k=$((k + 1))
done < ${GFILE:-$H/groups.txt}
wait
for ((i=0; i<k; i++)); do echo "group $i:"; cat /tmp/r$i-$TAG.txt; grep "^FAILED\|^ERROR" /tmp/s$i-$TAG.log | head -8; done >> $S
echo "end $(date +%T)" >> $S
for f in /tmp/salone-$TAG.log /tmp/s*-$TAG.log; do echo "=== $f"; tail -30 $f; done > $OUT/logs-$TAG.txt
