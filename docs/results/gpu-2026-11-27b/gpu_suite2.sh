#!/bin/bash
# The whole test suite on one GPU, G pytest processes at once (files dealt by size), each test logged as it ends
# (.scratch/instalog.py), test_memory_route alone afterwards. FILES= restricts to some files.
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP:-2} VPCE_OFFLINE=1
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=$PWD:/tmp/site:$PWD/.scratch
G=${G:-6}
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/suite.txt
ALONE="tests/test_memory_route.py"
files=${FILES:-$(ls -S tests/test_*.py | grep -v -x -F "$ALONE")}
i=0; declare -a g
for f in $files; do g[$((i % G))]+=" $f"; i=$((i+1)); done
echo "start $(date +%T)" >> $OUT/suite.txt
for ((k=0; k<G; k++)); do
  INSTALOG=$OUT/tall.txt timeout ${SUITE_T:-480} python3 -m pytest -q -p no:cacheprovider -p instalog -rfE ${g[$k]} > $OUT/s$k.log 2>&1 &
done
wait
if [ -z "$FILES" ]; then
  INSTALOG=$OUT/tall.txt timeout 90 python3 -m pytest -q -p no:cacheprovider -p instalog -rfE $ALONE > $OUT/salone.log 2>&1
  echo "alone: $(tail -1 $OUT/salone.log)" | tee -a $OUT/suite.txt
fi
for ((k=0; k<G; k++)); do echo "group $k: $(tail -1 $OUT/s$k.log)"; grep "^FAILED\|^ERROR" $OUT/s$k.log | head -8; done | tee -a $OUT/suite.txt
echo "end $(date +%T)" >> $OUT/suite.txt
cat $OUT/tall.txt | grep -v "^start\|^passed\|^skipped" | grep -v "^ " | head -40
