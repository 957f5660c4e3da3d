#!/bin/bash
# next session's first tp=2 call (after a.sh), written at the end of the eleventh session, not yet run: where the
# ~1.7 ms a step outside kernels goes (launch/profile_tp.py of the working tree, each rank's whole steps laid out by
# timeline.py --full: backward and the idle time before each step's first kernel); then bench_tp with NCCL's CTAs
# per collective capped (fewer SMs held beside the GEMMs by a rank that waits) against the default, alternated;
# between them ce_probe.py (NCCL's all-reduce against copy-engine copies beside a GEMM while the other rank is late)
export PYTHONUNBUFFERED=1
L=$OUT/p.txt; S=$PWD/.dev/s; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + ${KT:-560} ))
nvidia-smi --query-gpu=name --format=csv,noheader > $L; (git -C $F log --oneline -1 2>/dev/null || echo "no git") >> $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
prof() {  # tag [env...]
  local tag=$1; shift
  [ $(date +%s) -gt $((END - 80)) ] && { echo "prof $tag skipped" >> $L; return; }
  (cd $F && env "$@" PYTHONPATH=$F:$QP timeout 80 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py \
     --reps 12 --profile-steps 4 --out /tmp/prof-$tag > $OUT/prof-$tag.txt 2>&1)
  echo "== $tag $(grep median $OUT/prof-$tag.txt)" >> $L
  for r in 0 1; do echo "# rank $r" >> $OUT/tl-$tag.txt
    python3 $S/timeline.py /tmp/prof-$tag/trace-tp2-rank$r.json --full >> $OUT/tl-$tag.txt 2>&1; done
  grep "^-- step\|^# rank" $OUT/tl-$tag.txt >> $L; grep -A9 "per step by kind" $OUT/tl-$tag.txt >> $L
}
bench() {  # tag [env...]
  local tag=$1; shift
  [ $(date +%s) -gt $((END - 70)) ] && { echo "bench $tag skipped" >> $L; return; }
  rm -rf /tmp/tp; (cd $F && env "$@" PYTHONPATH=$F:$QP timeout 75 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --out /tmp/tp >> $OUT/bench.log 2>&1)
  python3 $S/tp2.py "tp2 $tag $(date +%T)" /tmp/tp/bench-tp2.json >> $L 2>&1
}
probe() {  # gemm
  [ $(date +%s) -gt $((END - 60)) ] && { echo "probe $1 skipped" >> $L; return; }
  (cd $F && PYTHONPATH=$F:$QP timeout 60 torchrun --standalone --nproc-per-node 2 \
     docs/results/gpu-2026-11-27k/ce_probe.py --gemm $1 >> $L 2>> $OUT/probe.err)
}
prof main X=1
probe quack; probe cublas
bench main X=1; bench ctas8 NCCL_MAX_CTAS=8; bench main2 X=1; bench ctas8b NCCL_MAX_CTAS=8
prof ctas8 NCCL_MAX_CTAS=8
cat $L
