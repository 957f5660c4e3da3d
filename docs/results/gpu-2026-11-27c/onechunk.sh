#!/bin/bash
# #36 item 3: the fast route with one chunk (no fp32 dW accumulator traffic) against today's 2 GiB P, floor +
# vpce-triton, alternating, Llama then Gemma. ONE=1 patches routing._fast_chunk to take every token in one chunk.
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $OUT/onechunk.txt
for shape in ${SHAPES:-llama3-8b gemma2-2b}; do
for one in ${ONES:-0 1 0 1}; do
  rm -rf /tmp/ps; ONE=$one timeout ${T:-120} python3 - $shape <<'PY' > /tmp/p.txt 2>&1
import os, runpy, sys
from vpce import routing
if os.environ["ONE"] == "1":
    routing._fast_chunk = lambda opts, cols, dtype, d, weight_cast=False: 1 << 20
sys.argv = ["vpce.bench", "--shapes", sys.argv[1], "--methods", "floor,vpce-triton", "--skip-no-grad", "--out", "/tmp/ps"]
try:
    runpy.run_module("vpce.bench", run_name="__main__")
except SystemExit:
    pass
PY
  python3 - $shape $one <<'PY' 2>&1 | tee -a $OUT/onechunk.txt
import json, sys
try:
    d = json.load(open("/tmp/ps/bench.json"))
    print(sys.argv[1], "one", sys.argv[2], " ".join(f"{r['method']}={r.get('ms')}({r.get('x_floor')}) peak={r.get('peak_gib')}" for r in d["rows"]))
except Exception as e:
    print(sys.argv[1], "one", sys.argv[2], "failed", e, open("/tmp/p.txt").read()[-1500:])
PY
done
done
