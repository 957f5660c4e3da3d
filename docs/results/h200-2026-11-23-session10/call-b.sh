# session 10, call B (nvidia-h200-x2): new kernels (.scratch/dc) vs main: CE tp=1 A/B on both GPUs, distill tp=2,
# distill tp=1 with torch eager, multi-seed distillation errors, GPU tests of the new tree
L=$OUT/l; mkdir -p $L; cat .scratch/COMMIT
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
M=$PWD; N=$PWD/.scratch/dc
CE="-m vpce.bench --shapes llama3-8b,gemma2-2b --methods floor,vpce-triton,vpce-softcap --skip-no-grad --quiet"
(cd $N && PYTHONPATH=$N timeout 100 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill --methods floor,vpce-fkl,vpce-jsd --out $L/tp2new --quiet > $L/bench-tp2-new.log 2>&1)
echo "== tp2 new"; grep "^| " $L/bench-tp2-new.log | head -4
(cd $N && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$N timeout 110 python $CE --out $L/ce-new-g0 > $L/ce-new-g0.log 2>&1) &
(cd $M && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$M timeout 110 python $CE --out $L/ce-main-g1 > $L/ce-main-g1.log 2>&1) &
wait
(cd $N && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$N timeout 110 python $CE --out $L/ce-new-g1 > $L/ce-new-g1.log 2>&1) &
(cd $M && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$M timeout 110 python $CE --out $L/ce-main-g0 > $L/ce-main-g0.log 2>&1) &
wait
for f in ce-new-g0 ce-main-g1 ce-new-g1 ce-main-g0; do echo "== $f"; grep "^| \|floor" $L/$f.log | grep -v "^| method" | head -8; done
(cd $N && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$N timeout 150 python -m vpce.bench --distill --methods floor,vpce-fkl,vpce-jsd,torch-jsd --quiet --out $L/d1new > $L/distill-tp1-new.log 2>&1) &
(cd $N && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$N timeout 150 python $M/.scratch/jsd_err.py > $L/jsd-err-new.log 2>&1) &
wait
echo "== distill tp1 new"; grep "^| \|floor" $L/distill-tp1-new.log | head -8; tail -3 $L/jsd-err-new.log
(cd $N && PYTHONPATH=$N timeout 110 python -m pytest -q -x tests/test_distillation_triton.py tests/test_triton_backend.py tests/test_variants.py tests/test_multi_gpu.py -p no:cacheprovider > $L/gpu-tests-new.log 2>&1); tail -2 $L/gpu-tests-new.log
