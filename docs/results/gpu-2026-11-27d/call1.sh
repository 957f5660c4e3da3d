#!/bin/bash
# x2 call 1: quack's first part + wheels copied to /tmp/quack (call 2 installs); tp=2 A/B main vs early-gemm
# (floor, vpce-triton; alternating), then launch/profile_tp.py of both trees with the first-GEMM trace analysis.
export PYTHONUNBUFFERED=1
mkdir -p /tmp/quack/wheels && cp .scratch/qc1/cu13.tar.xz.part-aa /tmp/quack/ && cp .scratch/qc2/wheels/*.whl /tmp/quack/wheels/
R=$PWD/.scratch/qc3/trees
L=$OUT/call1.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L
i=0
for tree in early-gemm main early-gemm; do
  i=$((i+1)); rm -rf /tmp/tp$i
  (cd $R/$tree && timeout 140 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --methods floor,vpce-triton \
     --out /tmp/tp$i > /tmp/tp$i.log 2>&1)
  python3 - $tree /tmp/tp$i <<'PY' >> $L 2>&1
import json, sys, glob
try:
    d = json.load(open(sys.argv[2] + "/bench-tp2.json"))
    print("tp2", sys.argv[1], " ".join(f"{r['method']}={r['ms'] or 0:.2f}({r.get('x_floor') or 0:.4f},"
          f"{r.get('extra_gib') or 0:.2f}GiB,dx{r.get('dx_err') or 0:.1e},dw{r.get('dw_err') or 0:.1e})" for r in d["rows"] if r.get("rank") in ("max", None)))
except Exception as e:
    print("tp2", sys.argv[1], "failed", e)
PY
  tail -1 $L
  [ -n "$(grep failed <(tail -1 $L))" ] && tail -30 /tmp/tp$i.log >> $L
done
for tree in main early-gemm; do
  rm -rf /tmp/prof-$tree
  (cd $R/$tree && timeout 100 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py --reps 10 --profile-steps 4 \
     --out /tmp/prof-$tree > $OUT/prof-$tree.txt 2>&1)
  for r in 0 1; do echo "== $tree rank $r" >> $L; python3 .scratch/qc4/first_gemm.py /tmp/prof-$tree/trace-tp2-rank$r.json >> $L 2>&1; done
done
xz -T4 -c /tmp/prof-early-gemm/trace-tp2-rank0.json > $OUT/trace-eg-rank0.json.xz
(cd $R/cand && timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_multi_gpu.py tests/test_distillation_tp.py \
   > $OUT/tests2gpu.log 2>&1); echo "2-GPU tests (cand): $(tail -1 $OUT/tests2gpu.log)" >> $L
cat $L
