# session 10, call C (nvidia-h200-x2): GPU tests of branch distill-combine at 676457c (.scratch/dc)
L=$OUT/l; mkdir -p $L; cat .scratch/COMMIT
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
cd .scratch/dc
PYTHONPATH=$PWD timeout 300 python -m pytest -q -rfE tests/test_triton_backend.py tests/test_distillation_triton.py tests/test_variants.py tests/test_confident_tokens.py tests/test_multi_gpu.py tests/test_distillation_tp.py -p no:cacheprovider > $L/gpu-tests-a.log 2>&1; tail -4 $L/gpu-tests-a.log
PYTHONPATH=$PWD timeout 200 python -m pytest -q -rfE tests/test_log_probs.py tests/test_metrics.py tests/test_caller_reduced.py tests/test_class_weight.py tests/test_logit_scale.py -p no:cacheprovider > $L/gpu-tests-b.log 2>&1; tail -4 $L/gpu-tests-b.log
