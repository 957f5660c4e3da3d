# session 9, call A (nvidia-h200-x2): NCCL tests, distillation GPU tests, tp=2 benches
set -x
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpus.txt; nvidia-smi topo -m >> $OUT/gpus.txt 2>&1
cat .scratch/COMMIT
timeout 200 python -m pytest -q tests/test_multi_gpu.py tests/test_distillation_tp.py tests/test_distillation_triton.py > $OUT/gpu-tests.log 2>&1
tail -5 $OUT/gpu-tests.log
for a in "" "--sp" "--distill" "--distill --sp"; do
  n=$(echo "tp2 $a" | tr -d '-' | tr ' ' '_')
  timeout 130 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py $a --out $OUT --quiet > $OUT/bench-$n.log 2>&1
  echo "rc=$?" >> $OUT/bench-$n.log
  grep -v "^W1\|\*\*\*\|OMP_NUM\|Backend impl\|warn" $OUT/bench-$n.log | head -40
done
