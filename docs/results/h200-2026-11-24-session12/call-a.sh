# session 12, call A (nvidia-h200-x2, carry [".scratch", ".whl-liger"]): issue #17's remaining same-run rows at the
# current main: one GPU, every --distill row (plain torch, Liger's fused linear JSD, vpce fast and lean) on GPU 0;
# then tp=2 with and without sequence parallelism.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-liger/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
L=$OUT/l; mkdir -p $L; git log --oneline -1 2>/dev/null
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
CUDA_VISIBLE_DEVICES=0 timeout 300 python -m vpce.bench --distill --out $L/d1 --quiet > $L/bench-distill-1gpu.log 2>&1
grep "^|\|floor" $L/bench-distill-1gpu.log | grep -v "^| -\|^|--\|| method"
timeout 100 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill --methods floor,vpce-fkl,vpce-jsd --out $L/tp2 --quiet > $L/bench-distill-tp2.log 2>&1
grep "^| " $L/bench-distill-tp2.log | grep -v "| method\|---" | head -3
timeout 100 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill --sp --methods floor,vpce-fkl,vpce-jsd --out $L/tp2sp --quiet > $L/bench-distill-tp2-sp.log 2>&1
grep "^| " $L/bench-distill-tp2-sp.log | grep -v "| method\|---" | head -3
