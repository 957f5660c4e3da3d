#!/bin/bash
# call G: quack installed; bench_tp new / base alternated three times (new = the working tree: each chunk's dX sum
# after the next chunk's exchanges, the next chunk's statistics before this chunk's gradient where P holds every
# token; base = 28d61aa); a tp=2 profile of new and each rank's timeline (timeline.py)
export PYTHONUNBUFFERED=1
L=$OUT/g.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + ${KT:-560} ))
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
cat $L
