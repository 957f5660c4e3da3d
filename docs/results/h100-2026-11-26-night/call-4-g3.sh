#!/bin/bash
# GPU call G3: one-loop (with the stored target) against d342e2b: two more cross-entropy rounds, two distillation rounds.
export PYTHONUNBUFFERED=1
ROWS=floor,vpce-triton,vpce-triton-lean,vpce-metrics,vpce-logprobs-top1,vpce-none-mean
DR=floor,vpce-fkl,vpce-fkl-lean,vpce-jsd,vpce-jsd-lean,vpce-rkl
i=0
for spec in ce:base ce:oneloop ce:oneloop ce:base distill:oneloop distill:base distill:base distill:oneloop; do
  kind=${spec%:*}; tree=${spec#*:}; i=$((i+1))
  pp=$PWD/.scratch/$tree
  if [ $kind = ce ]; then args="--shapes llama3-8b --methods $ROWS"; else args="--distill --methods $DR"; fi
  echo "run $i $spec $(date +%T)" >> $OUT/g3.txt
  (cd $pp && timeout 120 python3 -m vpce.bench $args --skip-no-grad --out /tmp/g3-$i > /tmp/g3-$i.txt 2>&1)
  python3 - $kind $tree $i <<'PY'
import json, os, sys
k, t, i = sys.argv[1:]
d = json.load(open(f"/tmp/g3-{i}/bench.json"))
print(k, t, " ".join(f"{r['method']}={r['ms']:.2f}({r.get('x_floor') or 1:.3f})" for r in d["rows"]))
with open(f"{os.environ['OUT']}/g3-rows.jsonl", "a") as f:
    f.write(json.dumps({"kind": k, "tree": t, "round": int(i), "bench": d}) + "\n")
PY
done 2>&1 | tee -a $OUT/g3.txt
cp /tmp/g3-5.txt $OUT/g3-distill-first.log 2>/dev/null
