# session 10, call F (nvidia-h200-x2): main at 35c93d8: distillation tp=2, replicated and sequence parallel
L=$OUT/l; mkdir -p $L; cat .scratch/COMMIT
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
export PYTHONPATH=$PWD
timeout 80 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill --methods floor,vpce-fkl,vpce-jsd --out $L/tp2 --quiet > $L/bench-tp2.log 2>&1
grep "^| " $L/bench-tp2.log | head -4
timeout 70 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill --sp --methods floor,vpce-jsd --out $L/tp2sp --quiet > $L/bench-tp2-sp.log 2>&1
grep "^| " $L/bench-tp2-sp.log | head -3
