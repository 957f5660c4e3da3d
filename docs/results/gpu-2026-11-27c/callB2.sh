#!/bin/bash
# quack + every peer installed; qadd.py (the several-chunk dW finish); the #36 table for the Llama-3-8B head.
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/callB2.txt
bash .scratch/qc3/install.sh >> $OUT/callB2.txt 2>&1 || { echo install failed; tail -20 $OUT/callB2.txt; exit 1; }
Q=/tmp/quack/site-packages
PYTHONPATH=$PWD:$Q:$Q/nvidia_cutlass_dsl/dsl_packages timeout 120 python3 .scratch/qc3/qadd.py >> $OUT/callB2.txt 2>&1
echo "qadd rc $?" >> $OUT/callB2.txt
SHAPE=llama3-8b METHODS=floor,compile,liger,quack,quack-base,trl,vpce-triton,vpce-triton-lean,vpce-softcap,vpce-all,vpce-dft,vpce-metrics,compile-frozen,quack-base-frozen,vpce-triton-frozen T=${T:-420} bash .scratch/qc3/bench_all.sh >> $OUT/callB2.txt 2>&1
tail -40 $OUT/callB2.txt
