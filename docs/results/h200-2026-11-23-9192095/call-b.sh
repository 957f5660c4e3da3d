# session 9, call B (nvidia-h200-x2)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
L=$OUT/l; mkdir -p $L; cat .scratch/COMMIT
timeout 150 python -m pytest -q tests/test_multi_gpu.py tests/test_distillation_tp.py tests/test_distillation_triton.py tests/test_distillation.py > $L/gpu-tests.log 2>&1; tail -3 $L/gpu-tests.log
timeout 150 python -m vpce.bench --distill --out $L --quiet > $L/bench-distill-1gpu.log 2>&1; grep "^|\|floor" $L/bench-distill-1gpu.log | grep -v "^| -\|^|--"
for a in "" "--sp"; do
  timeout 120 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill $a --out $L --quiet > $L/bench-distill-tp2$a.log 2>&1
  grep "^| \|floor" $L/bench-distill-tp2$a.log | head -9
done
for a in "" "--sp"; do
  timeout 60 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py --distill jsd $a --reps 10 --profile-steps 3 > $L/prof-distill-jsd-tp2$a.log 2>&1
  grep -v "^W1\|\*\*\*\|OMP_NUM" $L/prof-distill-jsd-tp2$a.log | tail -32
done
timeout 60 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py --distill forward_kl --reps 10 --profile-steps 3 > $L/prof-distill-fkl-tp2.log 2>&1
grep -v "^W1\|\*\*\*\|OMP_NUM" $L/prof-distill-fkl-tp2.log | tail -32
cd $OUT && tar czf logs.tgz l && rm -rf l
