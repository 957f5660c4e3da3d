export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl > $OUT/pip.log 2>&1; echo "pip rc=$?"
export PYTHONPATH=$PWD:/tmp/site
timeout 200 python -m pytest -q -p no:cacheprovider tests/test_caller_reduced.py -k "gpu or entropy or not_eligible or frozen" > $OUT/gpu-tests.log 2>&1; echo "rc=$?" >> $OUT/gpu-tests.log
grep -E '^(FAILED|ERROR)|passed|failed|rc=' $OUT/gpu-tests.log | tail -8
M=floor,vpce-triton,vpce-triton-lean,vpce-logprobs-primed,vpce-logprobs-top1,vpce-logprobs-grpo,vpce-logprobs-entropy,trl,trl-sft,vpce-logprobs-top1-frozen,trl-sft-frozen
timeout 340 python -m vpce.bench --shapes llama3-8b,gemma2-2b --skip-no-grad --out $OUT/bench-trl --methods $M > $OUT/bench-trl.log 2>&1; echo "rc=$?" >> $OUT/bench-trl.log
grep -E "^\||^floor|rc=|note" $OUT/bench-trl.log | tail -40
