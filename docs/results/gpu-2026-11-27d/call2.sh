#!/bin/bash
# x2 call 2: quack installed; GPU 0: hopper-dx A/B against main (floor, vpce-triton; both heads, alternating);
# GPU 1: qdx.py (dX of one chunk at a few quack configs, Llama), then cap-rcp against main (plain, soft cap, all four).
export PYTHONUNBUFFERED=1
L=$OUT/call2.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L
bash .scratch/qc3/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
Q=/tmp/quack/site-packages
QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
(CUDA_VISIBLE_DEVICES=0 bash .scratch/qc4/ab.sh $OUT/ab-hdx.txt hopper-dx:floor,vpce-triton) &
(CUDA_VISIBLE_DEVICES=1 ONLY=llama PYTHONPATH=$PWD:$QP timeout 150 python3 .scratch/qc4/qdx.py > $OUT/qdx.log 2>&1;
 CUDA_VISIBLE_DEVICES=1 ORDER="main BR" bash .scratch/qc4/ab.sh $OUT/ab-cap.txt cap-rcp:floor,vpce-triton,vpce-softcap,vpce-all) &
wait
cat $L $OUT/ab-hdx.txt $OUT/ab-cap.txt; grep -v "^$" $OUT/qdx.log | tail -12
