#!/bin/bash
# The whole test suite on one GPU: test_memory_route alone first (it weighs free memory), then G pytest processes
# at once (files dealt by size), each test logged as it ends (.scratch/instalog.py). QUACK=1: with the hopper extra
# (quack installed into /tmp/quack). Few files come back: suite.txt, tall.txt, logs.txt.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP:-2} VPCE_OFFLINE=1
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
Q=/tmp/quack/site-packages
export PYTHONPATH=$PWD:/tmp/site:$PWD/.scratch
[ "$QUACK" = 1 ] && export PYTHONPATH=$PYTHONPATH:$Q:$Q/nvidia_cutlass_dsl/dsl_packages
G=${G:-8}
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/suite.txt
python3 -c "from vpce import gemm; print('hopper extra:', gemm._quack() is not None)" >> $OUT/suite.txt 2>&1
ALONE="tests/test_memory_route.py"
INSTALOG=$OUT/tall.txt timeout 90 python3 -m pytest -q -p no:cacheprovider -p instalog -rfE $ALONE > /tmp/salone.log 2>&1
echo "alone: $(tail -1 /tmp/salone.log)" >> $OUT/suite.txt
grep "^FAILED\|^ERROR" /tmp/salone.log >> $OUT/suite.txt
files=${FILES:-$(ls -S tests/test_*.py | grep -v -x -F "$ALONE")}
i=0; declare -a g
for f in $files; do g[$((i % G))]+=" $f"; i=$((i+1)); done
echo "start $(date +%T)" >> $OUT/suite.txt
for ((k=0; k<G; k++)); do
  INSTALOG=$OUT/tall.txt timeout ${SUITE_T:-470} python3 -m pytest -q -p no:cacheprovider -p instalog -rfE ${g[$k]} > /tmp/s$k.log 2>&1 &
done
wait
for ((k=0; k<G; k++)); do echo "group $k (${g[$k]}): $(tail -1 /tmp/s$k.log)"; grep "^FAILED\|^ERROR" /tmp/s$k.log | head -8; done >> $OUT/suite.txt
echo "end $(date +%T)" >> $OUT/suite.txt
for f in /tmp/salone.log /tmp/s*.log; do echo "=== $f"; tail -60 $f; done > $OUT/logs.txt
cat $OUT/suite.txt
