#!/bin/bash
# call C (x2, right after B; quack installed): tp=2 with the extra, main / etp / etp / main (floor, plain, soft cap).
export PYTHONUNBUFFERED=1
H=.scratch/qc11
R=$PWD/$H/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
L=$OUT/c.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat $H/commit.txt >> $L
i=0
for tree in main etp etp main; do
  i=$((i+1)); rm -rf /tmp/tp; (cd $R/$tree && PYTHONPATH=$R/$tree:$QP timeout 110 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton,vpce-softcap --out /tmp/tp > /tmp/tp.log 2>&1)
  cp /tmp/tp/bench-tp2.json $OUT/tp2-$i-$tree.json 2>/dev/null || tail -20 /tmp/tp.log >> $L
  python3 -c "
import json; d=json.load(open('/tmp/tp/bench-tp2.json'))
print('tp2 hopper $tree', ' '.join(f\"{r['method']}={r['ms'] or 0:.2f}({r.get('x_floor') or 0:.4f},{r.get('extra_gib') or 0:.2f}GiB)\" for r in d['rows'] if r.get('rank')=='max'))" >> $L 2>&1
done
cat $L
