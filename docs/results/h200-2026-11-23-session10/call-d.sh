# session 10, call D (nvidia-h200-x2): main at 676457c: the rest of the GPU tests (group B), a second tp=1
# distillation bench (GPU 1, beside the tests on GPU 0), the tp=2 cross-entropy bench
L=$OUT/l; mkdir -p $L; cat .scratch/COMMIT
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
export PYTHONPATH=$PWD
(CUDA_VISIBLE_DEVICES=0 timeout 260 python -m pytest -q -rfE tests/test_caller_reduced.py tests/test_class_weight.py tests/test_logit_scale.py tests/test_metrics.py -p no:cacheprovider > $L/gpu-tests-b2.log 2>&1; tail -3 $L/gpu-tests-b2.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 200 python -m vpce.bench --distill --methods floor,vpce-fkl,vpce-jsd,vpce-rkl --quiet --out $L/d1 > $L/distill-tp1.log 2>&1) &
wait
grep "^| \|floor" $L/distill-tp1.log | head -7
timeout 100 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --methods floor,vpce-triton,megatron-fused --out $L/tp2ce --quiet > $L/bench-tp2-ce.log 2>&1
grep "^| \|floor" $L/bench-tp2-ce.log | head -6
