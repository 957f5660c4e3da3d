#!/bin/bash
# call B: quack installed; tp=2 profiles at main / noar (no dX all-reduce) / nohalf / main with NCCL_MAX_CTAS=4,
# each rank's timeline (timeline.py); bench_tp main and nohalf
export PYTHONUNBUFFERED=1
L=$OUT/b.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + ${KT:-540} ))
nvidia-smi --query-gpu=name --format=csv,noheader > $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
prof() {  # tag tree [env...]
  local tag=$1 tree=$2; shift 2
  [ $(date +%s) -gt $((END - 75)) ] && { echo "prof $tag skipped" >> $L; return; }
  (cd $R/$tree && env "$@" PYTHONPATH=$R/$tree:$QP timeout 80 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py \
     --reps 12 --profile-steps 4 --out /tmp/prof-$tag > $OUT/prof-$tag.txt 2>&1)
  echo "== $tag $(grep median $OUT/prof-$tag.txt) $(grep 'NCCL kernels' $OUT/prof-$tag.txt)" >> $L
  for r in 0 1; do echo "# rank $r" >> $OUT/tl-$tag.txt; python3 $S/timeline.py /tmp/prof-$tag/trace-tp2-rank$r.json >> $OUT/tl-$tag.txt 2>&1; done
  grep -A12 "per step by kind" $OUT/tl-$tag.txt >> $L
}
bench() {  # tag tree [env...]
  local tag=$1 tree=$2; shift 2
  [ $(date +%s) -gt $((END - 60)) ] && { echo "bench $tag skipped" >> $L; return; }
  rm -rf /tmp/tp; (cd $R/$tree && env "$@" PYTHONPATH=$R/$tree:$QP timeout 75 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --out /tmp/tp >> $OUT/bench.log 2>&1)
  python3 $S/tp2.py "tp2 $tag" /tmp/tp/bench-tp2.json >> $L 2>&1
}
prof main main X=1
prof noar noar X=1
bench main main X=1
prof nohalf nohalf X=1
prof ctas4 main NCCL_MAX_CTAS=4
bench nohalf nohalf X=1
bench main2 main X=1
cat $L
