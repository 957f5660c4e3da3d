export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
timeout 470 python -m pytest -q -p no:cacheprovider --durations=15 tests/test_caller_reduced.py tests/test_integration_trl.py > $OUT/gpu-caller-reduced.log 2>&1; echo "rc=$?" >> $OUT/gpu-caller-reduced.log
grep -E '^(FAILED|ERROR)|passed|failed|rc=|^[0-9.]+s ' $OUT/gpu-caller-reduced.log | tail -30
