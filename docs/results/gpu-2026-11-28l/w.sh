#!/bin/bash
# twelfth session, call W: each GPU's SM clock, power and throttle reasons sampled every 100 ms during two bench_tp
# runs of main (floor then vpce-triton), to see whether the floor and vpce run at the same clocks
export PYTHONUNBUFFERED=1
L=$OUT/w.txt; S=$PWD/.dev/s; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
nvidia-smi --query-gpu=name,power.limit,clocks.max.sm --format=csv,noheader > $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
nvidia-smi --query-gpu=index,timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
  --format=csv,noheader,nounits -lms 100 > $OUT/smi.csv 2>&1 &
SMI=$!
for tag in main main2; do
  echo "start $tag $(date +%s.%N)" >> $L
  rm -rf /tmp/tp; (cd $F && PYTHONPATH=$F:$QP timeout 75 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --out /tmp/tp >> $OUT/bench.log 2>&1)
  echo "end $tag $(date +%s.%N)" >> $L
  python3 $S/tp2.py "tp2 $tag $(date +%T)" /tmp/tp/bench-tp2.json >> $L 2>&1
done
kill $SMI
nvidia-smi -q -d PERFORMANCE | head -40 >> $L
grep "s\] " $OUT/bench.log >> $L
cat $L
