#!/bin/bash
# call B (H100): quack installed, qdw2.py (dW of one whole chunk: cuBLAS+cast vs quack configs), the new tests on the
# GPU, then the A/B: main (bdfe01a) against this tree (one chunk where it fits + quack's dW finish at the fastest
# config per head), floor + vpce-triton, alternating.
export PYTHONUNBUFFERED=1
R=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/callB.txt
bash .scratch/qc3/install.sh >> $OUT/callB.txt 2>&1 || { echo install failed; tail -20 $OUT/callB.txt; exit 1; }
Q=/tmp/quack/site-packages
QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
PYTHONPATH=$R:$QP timeout ${QT:-200} python3 .scratch/qc3/qdw2.py > $OUT/qdw2.log 2>&1
echo "qdw2 rc $?" >> $OUT/callB.txt
LL=$(python3 .scratch/qc3/pick.py llama 2>>$OUT/callB.txt); GG=$(python3 .scratch/qc3/pick.py gemma 2>>$OUT/callB.txt)
echo "picked llama=$LL gemma=$GG" >> $OUT/callB.txt
DWT=$LL PYTHONPATH=$R:$QP timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_memory_route.py \
  "tests/test_triton_backend.py::test_gpu_hopper_dw_finishes_in_one_gemm" > $OUT/tests.log 2>&1
tail -3 $OUT/tests.log >> $OUT/callB.txt
for shape in llama3-8b gemma2-2b; do
  [ $shape = llama3-8b ] && DWT=$LL || DWT=$GG
  for tree in main new new main; do
    rm -rf /tmp/h
    if [ $tree = main ]; then (cd $R/.scratch/qc3/base && PYTHONPATH=$PWD timeout 110 python3 -m vpce.bench --shapes $shape \
       --methods floor,vpce-triton --skip-no-grad --out /tmp/h > /tmp/h.txt 2>&1)
    else DWT=$DWT PYTHONPATH=$R:$QP timeout 110 python3 .scratch/qc3/runbench.py --shapes $shape \
       --methods floor,vpce-triton --skip-no-grad --out /tmp/h > /tmp/h.txt 2>&1; fi
    python3 - $tree $shape <<'PY' >> $OUT/callB.txt 2>&1
import json, sys
try:
    d = json.load(open("/tmp/h/bench.json"))
    print(sys.argv[2], sys.argv[1], " ".join(f"{r['method']}={r['ms'] or 0:.2f}({r.get('x_floor') or 0:.4f},"
          f"{r.get('extra_gib') or 0:.2f}GiB,dx{r.get('dx_err') or 0:.1e},dw{r.get('dw_err') or 0:.1e})" for r in d["rows"]))
except Exception as e:
    print(sys.argv[2], sys.argv[1], "failed", e, open("/tmp/h.txt").read()[-800:])
PY
  done
done
cat $OUT/callB.txt
