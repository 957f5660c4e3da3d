#!/bin/bash
# twelfth session: ov.py (the gradient pass beside a quack GEMM on K SMs), after a.sh
export PYTHONUNBUFFERED=1
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
bash .dev/s/install.sh > $OUT/install.txt 2>&1 || { cat $OUT/install.txt; exit 1; }
PYTHONPATH=$PWD:$QP timeout ${KT:-400} python .dev/s/${PROBE:-ov.py} "$@" 2>&1 | tee $OUT/ov.txt
