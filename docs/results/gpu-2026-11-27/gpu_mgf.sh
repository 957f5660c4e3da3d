#!/bin/bash
# GPU A/B for branch main-grad-fused (one pass for a main_grad gradient: addcmul_ instead of mul_ then add_):
# main (working tree) against .scratch/mgf (git archive main-grad-fused vpce), Llama-3-8B head, alternating.
export PYTHONUNBUFFERED=1
ROWS=floor,vpce-triton,vpce-triton-main-grad,vpce-triton-lean-main-grad
for tree in new mgf mgf new; do
  if [ $tree = new ]; then pp=$PWD; else pp=$PWD/.scratch/$tree; fi
  (cd $pp && timeout 100 python3 -m vpce.bench --shapes llama3-8b --methods $ROWS --skip-no-grad --out /tmp/m > /tmp/m.txt 2>&1)
  python3 - $tree <<'PY' 2>&1 | tee -a $OUT/mgf.txt
import json, os, sys
d = json.load(open("/tmp/m/bench.json"))
print("ce", sys.argv[1], " ".join(f"{r['method']}={r['ms']:.2f}({r.get('x_floor') or 1:.3f},{r.get('dw_err') or 0:.1e})" for r in d["rows"]))
with open(f"{os.environ['OUT']}/mgf-rows.jsonl", "a") as f:
    f.write(json.dumps({"tree": sys.argv[1], "bench": d}) + "\n")
PY
done
