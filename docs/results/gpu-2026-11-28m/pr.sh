#!/bin/bash
# thirteenth session: a tp=2 profile of the working tree (the scaled-exp try), per-kernel sums and the timeline
export PYTHONUNBUFFERED=1
L=$OUT/pr.txt; S=$PWD/.dev/s; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
bash $S/install.sh > $L 2>&1
(cd $F && PYTHONPATH=$F:$QP timeout 100 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py \
   --reps 12 --profile-steps 4 --out /tmp/prof > $OUT/prof.txt 2>&1); echo "prof rc $?" >> $L
grep median $OUT/prof.txt >> $L
python3 $S/ksum.py /tmp/prof/trace-tp2-rank0.json >> $L 2>&1
python3 $S/timeline.py /tmp/prof/trace-tp2-rank0.json --full > $OUT/tl.txt 2>&1
grep "^-- step\|lead\|gap" $OUT/tl.txt | head -20 >> $L
cat $L
