export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $OUT/pip.log 2>&1; echo "pip rc=$?"
M=floor,trl-sft,vpce-trl-sft,vpce-trl-sft-frozen,trl-sft-frozen
timeout 150 python -m vpce.bench --shapes llama3-8b,gemma2-2b --skip-no-grad --out $OUT/bench-trl2 --methods $M > $OUT/bench-trl2.log 2>&1; echo "rc=$?" >> $OUT/bench-trl2.log
grep -E "^\||^floor|rc=" $OUT/bench-trl2.log | grep -v -- "---" | tail -16
timeout 300 python -m pytest -q -p no:cacheprovider tests/test_log_probs.py tests/test_memory_route.py tests/test_compile.py > $OUT/gpu-tests2.log 2>&1; echo "rc=$?" >> $OUT/gpu-tests2.log
grep -E '^(FAILED|ERROR)|passed|failed|rc=' $OUT/gpu-tests2.log | tail -8
