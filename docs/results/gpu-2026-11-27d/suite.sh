#!/bin/bash
# One GPU's whole test suite (CUDA_VISIBLE_DEVICES=$GPU): test_memory_route alone first (it weighs free memory),
# then G pytest processes at once (files dealt by size), each test logged as it ends (.scratch/instalog.py).
# QUACK=1: with the hopper extra (quack installed into /tmp/quack). Writes $OUT/suite-$TAG.txt, tall-$TAG.txt.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP:-2} VPCE_OFFLINE=1 CUDA_VISIBLE_DEVICES=$GPU
Q=/tmp/quack/site-packages
export PYTHONPATH=$PWD:/tmp/site:$PWD/.scratch
[ "$QUACK" = 1 ] && export PYTHONPATH=$PYTHONPATH:$Q:$Q/nvidia_cutlass_dsl/dsl_packages
S=$OUT/suite-$TAG.txt
G=${G:-6}
nvidia-smi --query-gpu=name --format=csv,noheader -i $GPU > $S
python3 -c "from vpce import gemm; print('hopper extra:', gemm._quack() is not None)" >> $S 2>&1
ALONE="tests/test_memory_route.py"
INSTALOG=$OUT/tall-$TAG.txt timeout 90 python3 -m pytest -q -p no:cacheprovider -p instalog -rfE $ALONE > /tmp/salone-$TAG.log 2>&1
echo "alone: $(tail -1 /tmp/salone-$TAG.log)" >> $S
grep "^FAILED\|^ERROR" /tmp/salone-$TAG.log >> $S
files=${FILES:-$(ls -S tests/test_*.py | grep -v -x -F "$ALONE")}
i=0; declare -a g
for f in $files; do g[$((i % G))]+=" $f"; i=$((i+1)); done
echo "start $(date +%T)" >> $S
for ((k=0; k<G; k++)); do
  INSTALOG=$OUT/tall-$TAG.txt timeout ${SUITE_T:-420} python3 -m pytest -q -p no:cacheprovider -p instalog -rfE ${g[$k]} > /tmp/s$k-$TAG.log 2>&1 &
done
wait
for ((k=0; k<G; k++)); do echo "group $k (${g[$k]}): $(tail -1 /tmp/s$k-$TAG.log)"; grep "^FAILED\|^ERROR" /tmp/s$k-$TAG.log | head -8; done >> $S
echo "end $(date +%T)" >> $S
for f in /tmp/salone-$TAG.log /tmp/s*-$TAG.log; do echo "=== $f"; tail -40 $f; done > $OUT/logs-$TAG.txt
