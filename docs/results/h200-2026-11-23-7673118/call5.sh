export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 250 python -m pytest -q -p no:cacheprovider tests/test_caller_reduced.py -k "gpu or entropy or gathered or misprediction or not_eligible" > $OUT/gpu-tests.log 2>&1; echo "rc=$?" >> $OUT/gpu-tests.log
grep -E '^(FAILED|ERROR)|passed|failed|rc=' $OUT/gpu-tests.log | tail -8
