#!/bin/bash
# prepared in the twelfth session for the next one's first two-GPU call, after a.sh (carry .dev/q2 and .dev/s):
# settle.py (is the bench's tp=2 floor 4-5 % slower than in alternation because of the power state or because of how
# it times the GEMMs?), bench_tp with --settle 1 against without, then tr.py on GPU 0 (quack's A-operand transforms
# on the backward GEMMs against the plain ones and vpce's gradient pass)
export PYTHONUNBUFFERED=1
L=$OUT/next.txt; S=$PWD/.dev/s; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
nvidia-smi --query-gpu=name --format=csv,noheader > $L; git -C $F log --oneline -1 >> $L 2>&1
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
(cd $F && PYTHONPATH=$F:$QP timeout 150 torchrun --standalone --nproc-per-node 2 $S/settle.py >> $L 2> $OUT/settle.err)
for settle in 0 1 0 1; do
  rm -rf /tmp/tp; (cd $F && PYTHONPATH=$F:$QP timeout 90 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --settle $settle --out /tmp/tp >> $OUT/bench.log 2>&1)
  python3 $S/tp2.py "tp2 settle=$settle $(date +%T)" /tmp/tp/bench-tp2.json >> $L 2>&1
done
(cd $F && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$F:$QP timeout 200 python $S/tr.py > $OUT/tr.txt 2>&1); echo "tr rc $?" >> $L
cat $L; grep -v "^ *File\|^Traceback\|^    " $OUT/tr.txt | head -40
