#!/bin/bash
# call B (x2, right after a.sh): quack installed.
# GPU 0: the gradient pass alone at n8 and b8 (gradpass.py, 16 and 8 rows per program); the one-process profile of
#   the Llama step at n8 (launch/profile_tp.py at tp=1) with every GPU idle gap over the 4 profiled steps
#   (gaps_all.py); then bench runs n8, b8 (floor, plain, soft cap, all four, metrics), both heads.
# GPU 1 at the same time: bench runs b8, n8 (the same rows), then the lean rows at n8.
# Then both GPUs: launch/bench_tp.py at n8 (floor, plain) and the tp=2 profile with gaps_all on each rank.
export PYTHONUNBUFFERED=1
H=.scratch/qc14
R=$PWD/$H/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
L=$OUT/b.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat $H/commit.txt >> $L
bash .scratch/qc3/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
ROWS=floor,vpce-triton,vpce-softcap,vpce-all,vpce-metrics
export END=$(( $(date +%s) + 330 ))
(export CUDA_VISIBLE_DEVICES=0
 for tr in n8 b8; do (cd $R/$tr && TAG=$tr PYTHONPATH=$R/$tr:$QP timeout 90 python3 $R/../gradpass.py > $OUT/gradpass-$tr.txt 2>&1); done
 (cd $R/n8 && PYTHONPATH=$R/n8:$QP timeout 100 torchrun --standalone --nproc-per-node 1 launch/profile_tp.py \
    --reps 10 --profile-steps 4 --out /tmp/prof-1 > $OUT/tp1prof.txt 2>&1)
 python3 $H/gaps_all.py /tmp/prof-1/trace-tp1-rank0.json 4 > $OUT/tp1-gaps.txt 2>&1
 ORDER="BR b8" T=90 bash $H/ab.sh $OUT/ab0.txt n8:$ROWS) &
(export CUDA_VISIBLE_DEVICES=1
 ORDER="b8 BR" T=90 bash $H/ab.sh $OUT/ab1.txt n8:$ROWS
 ORDER="BR" T=80 bash $H/ab.sh $OUT/lean.txt n8:floor,vpce-triton-lean) &
wait
rm -rf /tmp/tp; (cd $R/n8 && PYTHONPATH=$R/n8:$QP timeout 100 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py \
   --methods floor,vpce-triton --out /tmp/tp > $OUT/tp2bench.log 2>&1); cp /tmp/tp/bench-tp2.json $OUT/ 2>/dev/null
python3 -c "
import json; d=json.load(open('/tmp/tp/bench-tp2.json'))
print('tp2 n8', ' '.join(f\"{r['method']}={r['ms'] or 0:.2f}({r.get('x_floor') or 0:.4f},{r.get('extra_gib') or 0:.2f}GiB)\" for r in d['rows'] if r.get('rank')=='max'))" >> $L 2>&1
(cd $R/n8 && PYTHONPATH=$R/n8:$QP timeout 90 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py \
   --reps 10 --profile-steps 4 --out /tmp/prof-2 > $OUT/tp2prof.txt 2>&1)
for r in 0 1; do echo "== rank $r"; python3 $H/gaps_all.py /tmp/prof-2/trace-tp2-rank$r.json 4; \
  python3 $H/first_gemm.py /tmp/prof-2/trace-tp2-rank$r.json | grep -v "^      "; done > $OUT/tp2-gaps.txt 2>&1
cat $L; grep -h "w4 " $OUT/gradpass-*.txt; cut -c1-420 $OUT/ab0.txt $OUT/ab1.txt $OUT/lean.txt; grep "median" $OUT/tp1prof.txt $OUT/tp2prof.txt
head -30 $OUT/tp1-gaps.txt; head -50 $OUT/tp2-gaps.txt
