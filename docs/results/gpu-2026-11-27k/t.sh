#!/bin/bash
# call T: quack installed; base's (28d61aa = main after the revert) two-GPU tests with the extra
# (tests/test_multi_gpu.py, and tests/test_memory_route.py's gpu and nccl tests)
export PYTHONUNBUFFERED=1
L=$OUT/t.txt; S=$PWD/.dev/s; B=$PWD/.dev/trees/base
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
nvidia-smi --query-gpu=name --format=csv,noheader > $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
(cd $B && PYTHONPATH=$B:$QP timeout ${KT:-240} python3 -m pytest -q -rfE tests/test_multi_gpu.py tests/test_memory_route.py \
   -k "gpu or nccl" > $OUT/t-tests.log 2>&1; tail -6 $OUT/t-tests.log >> $L)
cat $L
