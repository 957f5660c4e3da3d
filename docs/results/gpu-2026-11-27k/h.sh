#!/bin/bash
# call H: quack installed; the working tree's two-GPU tests with the extra (tests/test_multi_gpu.py, and
# tests/test_memory_route.py's gpu and nccl tests); bench_tp new / base alternated three times (new = the working
# tree, now with one statistics exchange per chunk where late_sums); a tp=2 profile of new and its timeline
export PYTHONUNBUFFERED=1
L=$OUT/h.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + ${KT:-570} ))
nvidia-smi --query-gpu=name --format=csv,noheader > $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
bench() {  # tag dir
  [ $(date +%s) -gt $((END - 70)) ] && { echo "bench $1 skipped" >> $L; return; }
  rm -rf /tmp/tp; (cd $2 && PYTHONPATH=$2:$QP timeout 75 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --out /tmp/tp >> $OUT/bench.log 2>&1)
  python3 $S/tp2.py "tp2 $1 $(date +%T)" /tmp/tp/bench-tp2.json >> $L 2>&1
}
prof() {  # tag dir
  [ $(date +%s) -gt $((END - 80)) ] && { echo "prof $1 skipped" >> $L; return; }
  (cd $2 && PYTHONPATH=$2:$QP timeout 80 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py \
     --reps 12 --profile-steps 4 --out /tmp/prof-$1 > $OUT/prof-$1.txt 2>&1)
  echo "== $1 $(grep median $OUT/prof-$1.txt) $(grep 'NCCL kernels' $OUT/prof-$1.txt)" >> $L
  for r in 0 1; do echo "# rank $r" >> $OUT/tl-$1.txt; python3 $S/timeline.py /tmp/prof-$1/trace-tp2-rank$r.json >> $OUT/tl-$1.txt 2>&1; done
  grep -A8 "per step by kind" $OUT/tl-$1.txt >> $L
}
bench new $F; bench base $R/base; bench new2 $F; bench base2 $R/base; bench new3 $F; bench base3 $R/base
prof new $F
(cd $F && PYTHONPATH=$F:$QP timeout $((END - $(date +%s) - 10)) python3 -m pytest -q -rfE tests/test_multi_gpu.py \
   tests/test_memory_route.py -k "gpu or nccl" > $OUT/h-tests.log 2>&1; tail -6 $OUT/h-tests.log >> $L)
cat $L
