#!/bin/bash
# call 6 (right after 5; quack installed, /tmp/pick.txt from call 4): the se tree at the picked LOGITS_TILE, every
# peer this image has (no Liger / TRL wheels in this call), one head at a time
cd .scratch/qc9/trees/se && Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
sed -i "s/^LOGITS_TILE = .*/$(cat /tmp/pick.txt)/" vpce/gemm.py; grep -n "^LOGITS_TILE" vpce/gemm.py
export PYTHONUNBUFFERED=1
PYTHONPATH=$PWD:$QP timeout 330 python3 -m vpce.bench --shapes llama3-8b --methods floor,compile,quack,quack-base,vpce-triton,vpce-triton-lean,vpce-metrics,quack-base-frozen,vpce-triton-frozen,compile-frozen --out $OUT/b-llama > $OUT/bench-llama.log 2>&1
PYTHONPATH=$PWD:$QP timeout 150 python3 -m vpce.bench --shapes gemma2-2b --methods floor,compile,quack,vpce-triton,vpce-softcap,vpce-metrics,vpce-triton-lean --out $OUT/b-gemma > $OUT/bench-gemma.log 2>&1
