#!/bin/bash
# twelfth session, call 16: settle.py (after a.sh)
export PYTHONUNBUFFERED=1
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
bash .dev/s/install.sh > $OUT/install.txt 2>&1 || { cat $OUT/install.txt; exit 1; }
PYTHONPATH=$PWD:$QP timeout 120 torchrun --standalone --nproc-per-node 2 .dev/s/settle.py > $OUT/settle.txt 2>$OUT/settle.err
echo rc $?; cat $OUT/settle.txt; tail -5 $OUT/settle.err
