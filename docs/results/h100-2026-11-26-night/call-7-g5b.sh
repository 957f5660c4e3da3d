#!/bin/bash
# GPU call G5b: Llama-3-8B rows at the new P (half of dW) against P = dW (PSHARE=1.0), alternating; the
# distillation's fkl-lean row, merge against d342e2b.
export PYTHONUNBUFFERED=1
ROWS=floor,vpce-triton,vpce-triton-lean,vpce-metrics,vpce-logprobs-top1,vpce-none-mean
for sh in half 1.0 1.0 half; do
  if [ $sh = half ]; then env=""; else env="PSHARE=$sh"; fi
  env $env PYTHONPATH=$PWD:$PWD/.scratch timeout 60 python3 -c "import psize, runpy, sys; sys.argv=['vpce.bench','--shapes','llama3-8b','--methods','$ROWS','--skip-no-grad','--out','/tmp/p']; runpy.run_module('vpce.bench', run_name='__main__')" > /tmp/p.txt 2>&1
  python3 - $sh <<'PY' 2>&1 | tee -a $OUT/g5b.txt
import json, os, sys
d = json.load(open("/tmp/p/bench.json"))
print("ce P", sys.argv[1], " ".join(f"{r['method']}={r['ms']:.2f}({r.get('x_floor') or 1:.3f},{r.get('extra_gib') or 0:.2f})" for r in d["rows"]))
with open(f"{os.environ['OUT']}/g5b-rows.jsonl", "a") as f:
    f.write(json.dumps({"p": sys.argv[1], "bench": d}) + "\n")
PY
done
for tree in new base base new; do
  if [ $tree = new ]; then pp=$PWD; else pp=$PWD/.scratch/$tree; fi
  (cd $pp && timeout 60 python3 -m vpce.bench --distill --methods floor,vpce-fkl-lean --skip-no-grad --out /tmp/d > /tmp/d.txt 2>&1)
  python3 - $tree <<'PY' 2>&1 | tee -a $OUT/g5b.txt
import json, os, sys
d = json.load(open("/tmp/d/bench-distill.json"))
print("distill", sys.argv[1], " ".join(f"{r['method']}={r['ms']:.2f}({r.get('x_floor') or 1:.3f})" for r in d["rows"]))
with open(f"{os.environ['OUT']}/g5b-rows.jsonl", "a") as f:
    f.write(json.dumps({"distill": sys.argv[1], "bench": d}) + "\n")
PY
done
