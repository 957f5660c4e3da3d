# session 9, call G (nvidia-h200-x2): final main, tp=2 distillation rows with the floor; a JSD step's traces
export PYTHONPATH=$PWD
L=$OUT/l; mkdir -p $L /tmp/tr; cat .scratch/COMMIT
timeout 90 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill --methods floor,vpce-fkl,vpce-jsd --out $L --quiet > $L/bench-distill-tp2.log 2>&1
grep "^| \|floor" $L/bench-distill-tp2.log | head -6
timeout 60 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py --distill jsd --reps 10 --profile-steps 2 --out /tmp/tr > $L/prof-jsd-tp2.log 2>&1
grep "median" $L/prof-jsd-tp2.log
gzip -c /tmp/tr/trace-jsd-tp2-rank0.json > $L/trace-jsd-tp2-rank0.json.gz; ls -la $L
cd $OUT && tar czf logs.tgz l && rm -rf l
