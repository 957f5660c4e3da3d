#!/bin/bash
# Next session, call 1: the whole test suite on one GPU (#33 "the whole suite on CPU and on a GPU"; #32's
# deterministic-mode GPU test at the current kernels), four pytest processes at once, files dealt by size.
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/suite.txt
# weighed against free device memory: run alone after the parallel groups
ALONE="tests/test_memory_route.py"
files=$(ls -S tests/test_*.py | grep -v -x -F "$ALONE")
i=0; declare -a g
for f in $files; do g[$((i % 4))]+=" $f"; i=$((i+1)); done
echo "start $(date +%T)" >> $OUT/suite.txt
for k in 0 1 2 3; do
  timeout ${SUITE_T:-420} python3 -m pytest -q -p no:cacheprovider -rfE ${g[$k]} > $OUT/suite-$k.log 2>&1 &
done
wait
timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE $ALONE > $OUT/suite-alone.log 2>&1
echo "alone: $(tail -1 $OUT/suite-alone.log)" | tee -a $OUT/suite.txt
for k in 0 1 2 3; do echo "group $k: $(tail -1 $OUT/suite-$k.log)"; grep "^FAILED\|^ERROR" $OUT/suite-$k.log | head -8; done | tee -a $OUT/suite.txt
echo "end $(date +%T)" >> $OUT/suite.txt
