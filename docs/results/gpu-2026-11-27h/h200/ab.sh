#!/bin/bash
# ab.sh LOG PAIRS: per "branch:methods" pair and shape, bench runs alternating trees (ORDER), one line each to LOG.
export PYTHONUNBUFFERED=1
Q=/tmp/quack/site-packages
QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
R=$PWD/.scratch/qc13/trees
L=$1; shift
for pair in "$@"; do
  br=${pair%%:*}; rows=${pair#*:}
  for shape in ${SHAPES:-llama3-8b gemma2-2b}; do
    for tree in ${ORDER:-main BR BR main}; do
      [ $tree = BR ] && tree=$br
      [ -n "$END" ] && [ $(date +%s) -gt $END ] && { echo "$shape $tree skipped: past the end" >> $L; continue; }
      h=/tmp/h-$$; rm -rf $h
      (cd $R/$tree && PYTHONPATH=$R/$tree:$QP timeout ${T:-120} python3 -m vpce.bench --shapes $shape \
         --methods $rows --skip-no-grad --out $h > $h.txt 2>&1)
      python3 - $tree $shape $h <<'PY' >> $L 2>&1
import json, sys
try:
    d = json.load(open(sys.argv[3] + "/bench.json"))
    print(sys.argv[2], sys.argv[1], " ".join(f"{r['method']}={r['ms'] or 0:.2f}({r.get('x_floor') or 0:.4f},"
          f"{r.get('extra_gib') or 0:.2f}GiB,dx{r.get('dx_err') or 0:.1e},dw{r.get('dw_err') or 0:.1e})" for r in d["rows"]))
except Exception as e:
    print(sys.argv[2], sys.argv[1], "failed", e, open(sys.argv[3] + ".txt").read()[-600:])
PY
    done
  done
done
