#!/bin/bash
# call C (x2, quack installed): GPU 0: the GEMM schedules (sched.py) at main; GPU 1 at the same time: A/B main /
# fw / fw / main of the frozen head (frozen-whole-2: one chunk, quack's dX in backward); then launch/profile_tp.py at tp=2 at
# main (both GPUs) and where each step's first GEMM starts (first_gemm.py: the epilogue under a group starts after
# the set-up).
export PYTHONUNBUFFERED=1
H=.scratch/qc13
R=$PWD/$H/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
(cd $R/main && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$R/main:$QP timeout 300 python3 $R/../sched.py > $OUT/sched.txt 2>&1) &
(CUDA_VISIBLE_DEVICES=1 END=$(( $(date +%s) + 300 )) ORDER="main BR BR main" T=90 bash $H/ab.sh $OUT/ab-fw.txt \
   fw:floor,vpce-triton-frozen) &
wait
(cd $R/main && PYTHONPATH=$R/main:$QP timeout 150 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py \
   --reps 10 --profile-steps 4 --out /tmp/prof-main > $OUT/tp2prof.txt 2>&1)
for r in 0 1; do echo "== rank $r"; python3 $H/first_gemm.py /tmp/prof-main/trace-tp2-rank$r.json; done > $OUT/first-gemm.txt 2>&1
# one process (Llama, the hopper extra): where the GPU idles within a step (gaps.py) and the first GEMM's start
(cd $R/main && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$R/main:$QP timeout 100 torchrun --standalone --nproc-per-node 1 \
   launch/profile_tp.py --reps 10 --profile-steps 4 --out /tmp/prof-1 > $OUT/tp1prof.txt 2>&1)
(python3 $H/first_gemm.py /tmp/prof-1/trace-tp1-rank0.json; python3 $H/gaps.py /tmp/prof-1/trace-tp1-rank0.json) \
   > $OUT/tp1-gaps.txt 2>&1
cut -c1-300 $OUT/sched.txt; cut -c1-300 $OUT/ab-fw.txt; tail -40 $OUT/tp2prof.txt; cat $OUT/first-gemm.txt; tail -30 $OUT/tp1prof.txt; head -40 $OUT/tp1-gaps.txt
