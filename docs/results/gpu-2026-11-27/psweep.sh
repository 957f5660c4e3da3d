#!/bin/bash
# #36: the fast route's chunk length on the Llama-3-8B head: Sizing.fast_p_gib 1.5 (6272 tokens, the default),
# 0.97871 (4096), 1.96 (capped at the fp32 dW size: 8192); floor + vpce-triton, twice each, alternating.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/psweep.txt
for p in ${PS:-1.5 0.97871 1.96 1.5 0.97871 1.96}; do
  rm -rf /tmp/ps; timeout ${T:-100} python3 - $p <<'PY' > /tmp/p.txt 2>&1
import dataclasses, os, runpy, sys
from vpce import routing
p = float(sys.argv[1])
routing.SIZING = dataclasses.replace(routing.SIZING, fast_p_gib=p)
sys.argv = ["vpce.bench", "--shapes", os.environ.get("SHAPE", "llama3-8b"), "--methods", "floor,vpce-triton", "--skip-no-grad", "--out", "/tmp/ps"]
try:
    runpy.run_module("vpce.bench", run_name="__main__")
except SystemExit:
    pass
PY
  python3 - $p <<'PY' 2>&1 | tee -a $OUT/psweep.txt
import json, sys
d = json.load(open("/tmp/ps/bench.json"))
print("P", sys.argv[1], " ".join(f"{r['method']}={r['ms']:.2f}({r.get('x_floor') or 1:.4f})" for r in d["rows"]))
PY
done
