#!/bin/bash
# thirteenth session, call Q: quack installed; the scaled-exp route's GPU tests (one GPU and NCCL tp=2), the
# two-GPU suite; bench_tp --settle 1 new / base alternated (new = the working tree, base = main's vpce); a profile
export PYTHONUNBUFFERED=1
L=$OUT/q.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + ${KT:-570} ))
nvidia-smi --query-gpu=name --format=csv,noheader > $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
(cd $F && PYTHONPATH=$F:$QP timeout ${TT:-260} python -m pytest -q -p no:cacheprovider tests/test_scaled_exp.py \
   ${TESTS} > $OUT/tests.log 2>&1); echo "tests rc $?" >> $L
grep -E "passed|failed|Error|assert" $OUT/tests.log | tail -15 >> $L
bench() {  # tag dir
  [ $(date +%s) -gt $((END - 60)) ] && { echo "bench $1 skipped" >> $L; return; }
  rm -rf /tmp/tp; (cd $2 && PYTHONPATH=$2:$QP timeout 80 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --settle ${SETTLE:-1} --out /tmp/tp >> $OUT/bench-$1.log 2>&1)
  python3 $S/tp2.py "tp2 $1 $(date +%T)" /tmp/tp/bench-tp2.json >> $L 2>&1
}
for tag in ${ORDER:-new base new2 base2}; do d=$F; case $tag in base*) d=$R/base;; esac; bench $tag $d; done
cat $L
