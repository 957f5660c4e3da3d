#!/bin/bash
# call M (x2, quack installed): the working tree's two-GPU tests with the extra (tests/test_multi_gpu.py, and
# tests/test_memory_route.py's gpu and nccl tests), then bench_tp new / base again while time is left
export PYTHONUNBUFFERED=1
L=$OUT/m.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + ${KT:-560} ))
nvidia-smi --query-gpu=name --format=csv,noheader > $L
(cd $F && PYTHONPATH=$F:$QP:/tmp/site timeout 330 python3 -m pytest -q -rfE tests/test_multi_gpu.py tests/test_memory_route.py \
   -k "gpu or nccl" > $OUT/m-tests.log 2>&1; tail -6 $OUT/m-tests.log >> $L)
bench() {  # tag dir
  [ $(date +%s) -gt $((END - 70)) ] && { echo "bench $1 skipped" >> $L; return; }
  rm -rf /tmp/tp; (cd $2 && PYTHONPATH=$2:$QP timeout 75 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --out /tmp/tp >> $OUT/bench.log 2>&1)
  python3 $S/tp2.py "tp2 $1 $(date +%T)" /tmp/tp/bench-tp2.json >> $L 2>&1
}
bench base4 $R/base; bench new4 $F; bench base5 $R/base; bench new5 $F
cat $L
