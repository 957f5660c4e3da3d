# session 10, call E (nvidia-h200-x2): lg2.approx.ftz in the JSD kernels: GPU distillation tests, tp=2 JSD bench;
# beside the tests, the lean route on GPU 1 (exp2 epilogue)
L=$OUT/l; mkdir -p $L; cat .scratch/COMMIT
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
export PYTHONPATH=$PWD
(CUDA_VISIBLE_DEVICES=0 timeout 90 python -m pytest -q -rfE tests/test_distillation_triton.py -p no:cacheprovider > $L/gpu-tests-distill.log 2>&1; tail -2 $L/gpu-tests-distill.log) &
(CUDA_VISIBLE_DEVICES=1 timeout 90 python -m vpce.bench --shapes llama3-8b,gemma2-2b --methods floor,vpce-triton-lean --skip-no-grad --quiet --out $L/lean > $L/bench-lean.log 2>&1; grep "^| \|floor" $L/bench-lean.log | grep -v "| method") &
wait
timeout 80 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill --methods floor,vpce-jsd --out $L/tp2 --quiet > $L/bench-tp2-jsd.log 2>&1
grep "^| " $L/bench-tp2-jsd.log | head -3
