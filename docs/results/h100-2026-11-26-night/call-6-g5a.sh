#!/bin/bash
# GPU call G5a: the GPU tests of the merge (one-loop + stored target + the #35 changes), three pytest processes at
# once; then the HF Trainer step, stock / vpce / Liger.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/g5.txt
git log --oneline -1 | tee -a $OUT/g5.txt
echo "tests $(date +%T)" >> $OUT/g5.txt
T="timeout ${TEST_T:-230} python3 -m pytest -q -p no:cacheprovider -rfE"
$T tests/test_triton_backend.py > $OUT/t1.log 2>&1 &
$T tests/test_metrics.py tests/test_log_probs.py > $OUT/t2.log 2>&1 &
$T tests/test_autocast.py tests/test_caller_reduced.py tests/test_memory_route.py tests/test_integration_transformers.py tests/test_distillation_triton.py > $OUT/t3.log 2>&1 &
wait
for f in t1 t2 t3; do echo "$f: $(tail -1 $OUT/$f.log)"; grep "^FAILED\|^ERROR" $OUT/$f.log | head -5; done | tee -a $OUT/g5.txt
echo "hf $(date +%T)" >> $OUT/g5.txt
if [ "$1" != nohf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
  PYTHONPATH=$PWD:/tmp/site timeout 200 python3 launch/train_step.py hf --steps 100 --out $OUT/hf 2>&1 | grep "tokens/s\|Error\|error" | tail -8 | tee -a $OUT/g5.txt
  rm -rf $OUT/hf/path-* $OUT/hf/loss.pdf
fi
echo "end $(date +%T)" >> $OUT/g5.txt
