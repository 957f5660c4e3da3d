#!/bin/bash
# twelfth session, call N: quack installed; the two-GPU tests of the gradient pass beside the next GEMM, the
# persistent pass's bits on one GPU; bench_tp new / base alternated three times (new = the working tree, base =
# 28d61aa = main's vpce); a tp=2 profile of new laid out by timeline.py --full
export PYTHONUNBUFFERED=1
L=$OUT/n.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + ${KT:-560} ))
nvidia-smi --query-gpu=name --format=csv,noheader > $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
(cd $F && PYTHONPATH=$F:$QP timeout 200 python -m pytest -q -x -p no:cacheprovider tests/test_multi_gpu.py \
   tests/test_triton_backend.py -k "one_dw or gradient_pass_over_tiles" > $OUT/tests.log 2>&1); echo "tests rc $?" >> $L
tail -3 $OUT/tests.log >> $L
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
  echo "== $1 $(grep median $OUT/prof-$1.txt)" >> $L
  for r in 0 1; do echo "# rank $r" >> $OUT/tl-$1.txt
    python3 $S/timeline.py /tmp/prof-$1/trace-tp2-rank$r.json --full >> $OUT/tl-$1.txt 2>&1; done
  grep "^-- step\|^# rank" $OUT/tl-$1.txt >> $L; grep -A9 "per step by kind" $OUT/tl-$1.txt >> $L
}
bench new $F; bench base $R/base; bench new2 $F; bench base2 $R/base; bench new3 $F; bench base3 $R/base
prof new $F
cat $L
