export PYTHONPATH=$PWD
L=$OUT/l; mkdir -p $L
for a in "" "--sp"; do
  timeout 100 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill $a --methods vpce-fkl,vpce-jsd --out $L --quiet > $L/bench-distill-tp2$a-nohalves.log 2>&1
  grep "^| \|floor" $L/bench-distill-tp2$a-nohalves.log | head -5
done
cd $OUT && tar czf logs2.tgz l && rm -rf l
