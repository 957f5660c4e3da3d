#!/bin/bash
# GPU call G1 (2026-11-26 night): GPU tests of main (autocast fp32 dW, interpreter refusal, touched kernels), then
# the Llama-3-8B cross-entropy rows for branch stored-target (#32), branch one-loop (#33) and d342e2b (base),
# alternating; every tree runs from its own directory. Usage: CE_TREES="..." bash .scratch/gpu_g1.sh [notests]
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee $OUT/g.txt
git log --oneline -1 | tee -a $OUT/g.txt
if [ "$1" != notests ]; then
  echo "tests start $(date +%T)" | tee -a $OUT/g.txt
  timeout ${TEST_T:-170} python3 -m pytest -q -p no:cacheprovider tests/test_autocast.py tests/test_metrics.py tests/test_log_probs.py \
    tests/test_triton_backend.py tests/test_caller_reduced.py tests/test_memory_route.py > $OUT/g-tests.log 2>&1
  tail -3 $OUT/g-tests.log | tee -a $OUT/g.txt
fi
ROWS=${ROWS:-floor,vpce-triton,vpce-triton-lean,vpce-metrics,vpce-logprobs-top1,vpce-none-mean}
i=0
for tree in ${CE_TREES:-stored oneloop base oneloop stored base}; do
  i=$((i+1))
  if [ $tree = new ]; then pp=$PWD; else pp=$PWD/.scratch/$tree; fi
  echo "run $i $tree $(date +%T)" >> $OUT/g.txt
  (cd $pp && timeout 150 python3 -m vpce.bench --shapes llama3-8b --methods $ROWS --skip-no-grad --out /tmp/g-$i > /tmp/g-$i.txt 2>&1)
  python3 - $tree $i <<'PY'
import json, sys
t, i = sys.argv[1:]
d = json.load(open(f"/tmp/g-{i}/bench.json"))
print("ce", t, " ".join(f"{r['method']}={r['ms']:.2f}({r.get('x_floor') or 1:.3f})" for r in d["rows"]))
with open(f"{__import__('os').environ['OUT']}/g-rows.jsonl", "a") as f:
    f.write(json.dumps({"tree": t, "round": int(i), "bench": d}) + "\n")
PY
done 2>&1 | tee -a $OUT/g.txt
cp /tmp/g-1.txt $OUT/g-bench-first.log 2>/dev/null
echo "end $(date +%T)" >> $OUT/g.txt
