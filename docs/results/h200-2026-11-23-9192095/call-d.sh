# session 9, call D (nvidia-h200-x2): distillation after half-chunks / JSD terms / early GEMMs; gluon bisect
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
L=$OUT/l; mkdir -p $L; cat .scratch/COMMIT
timeout 120 python -m pytest -q tests/test_multi_gpu.py tests/test_distillation_tp.py tests/test_distillation_triton.py tests/test_distillation.py > $L/gpu-tests.log 2>&1; tail -3 $L/gpu-tests.log
timeout 150 python -m vpce.bench --distill --out $L --quiet > $L/bench-distill-1gpu.log 2>&1; grep "^|\|floor" $L/bench-distill-1gpu.log | grep -v "^| -\|^|--"
for a in "" "--sp"; do
  timeout 110 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill $a --out $L --quiet > $L/bench-distill-tp2$a.log 2>&1
  grep "^| \|floor" $L/bench-distill-tp2$a.log | head -9
done
cd .scratch/gluon && timeout 130 python gluon_bisect.py > $L/gluon-bisect.log 2>&1; tail -20 $L/gluon-bisect.log; cd ../..
cd $OUT && tar czf logs.tgz l && rm -rf l
