export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 200 python -m pytest -q -p no:cacheprovider -x tests/test_caller_reduced.py > $OUT/gpu-caller-reduced.log 2>&1; echo "rc=$?" >> $OUT/gpu-caller-reduced.log
grep -E '^(FAILED|ERROR)|passed|failed|rc=' $OUT/gpu-caller-reduced.log | tail -15
M=floor,vpce-triton,vpce-triton-lean,vpce-logprobs,vpce-logprobs-primed,vpce-none-mean,vpce-logprobs-grpo,vpce-logprobs-entropy,vpce-triton-frozen,vpce-logprobs-frozen
timeout 330 python -m vpce.bench --shapes llama3-8b,gemma2-2b --out $OUT/bench-spec20 --methods $M > $OUT/bench-spec20.log 2>&1; echo "rc=$?" >> $OUT/bench-spec20.log
tail -40 $OUT/bench-spec20.log
