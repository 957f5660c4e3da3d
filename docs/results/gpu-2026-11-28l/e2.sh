#!/bin/bash
# twelfth session, call 14: energy.py (after a.sh)
export PYTHONUNBUFFERED=1
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
bash .dev/s/install.sh > $OUT/install.txt 2>&1 || { cat $OUT/install.txt; exit 1; }
PYTHONPATH=$PWD:$QP timeout 120 torchrun --standalone --nproc-per-node 2 .dev/s/energy.py > $OUT/energy.txt 2>$OUT/energy.err
echo rc $?; cat $OUT/energy.txt; tail -5 $OUT/energy.err
