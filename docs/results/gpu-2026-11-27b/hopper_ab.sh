#!/bin/bash
# Calls 3 and 4: branch hopper-dw (tree hdw: git archive hopper-dw vpce tests) against the p-2gib code (tree pend:
# git archive 4f1b099 vpce tests), quack installed into /tmp/quack (quack_install.sh; call 3 installed the wheels
# after unpacking the cutlass libs, so pip skipped nvidia_cutlass_dsl/ and quack did not import: an A/A run).
export PYTHONUNBUFFERED=1
Q=/tmp/quack/site-packages
QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
R=$PWD/.scratch/qb
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/hopper.txt
PYTHONPATH=$QP python3 -c "import quack.gemm_interface, quack.linear_cross_entropy; print('quack ok')" 2>&1 | tail -3 | tee -a $OUT/hopper.txt
(cd $R/hdw && PYTHONPATH=$PWD:$QP timeout 220 python3 -m pytest -q -p no:cacheprovider -rfE -x \
   tests/test_triton_backend.py > $OUT/hdw-tests.log 2>&1)
tail -4 $OUT/hdw-tests.log | tee -a $OUT/hopper.txt
for shape in llama3-8b gemma2-2b; do
  for tree in pend hdw hdw pend; do
    pp=$R/$tree
    rm -rf /tmp/h; (cd $pp && PYTHONPATH=$pp:$QP timeout 100 python3 -m vpce.bench --shapes $shape \
       --methods floor,vpce-triton --skip-no-grad --out /tmp/h > /tmp/h.txt 2>&1)
    python3 - $tree $shape <<'PY' 2>&1 | tee -a $OUT/hopper.txt
import json, sys
d = json.load(open("/tmp/h/bench.json"))
print(sys.argv[2], sys.argv[1], " ".join(f"{r['method']}={r['ms'] or 0:.2f}({r.get('x_floor') or 0:.4f},"
      f"{r.get('extra_gib') or 0:.2f}GiB,{r.get('dw_err') or 0:.1e})" for r in d["rows"]))
PY
  done
done
