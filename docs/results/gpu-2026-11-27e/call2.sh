#!/bin/bash
# call 2 (x2, right after 1): quack installed (second part + wheels). GPU 1: the whole suite with the extra at the
# checkout (branch next). GPU 0 meanwhile: A/B main / next / next / main with the extra (plain, frozen, variants),
# then the logits GEMM, cuBLAS against quack configs (qgemm.py ONLY=logits).
export PYTHONUNBUFFERED=1
H=.scratch/qc6
L=$OUT/c2.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat $H/commit.txt >> $L
mkdir -p /tmp/quack/wheels && cp .scratch/qc2/wheels/*.whl /tmp/quack/wheels/
bash .scratch/qc3/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
Q=/tmp/quack/site-packages
(GPU=1 TAG=hopper QUACK=1 SUITE_T=330 bash $H/suite6.sh) &
(export CUDA_VISIBLE_DEVICES=0
 ORDER="main next next main" T=110 bash $H/ab6.sh $OUT/ab-extra.txt qg:floor,vpce-triton,vpce-triton-frozen
 ONLY=logits PYTHONPATH=$PWD/$H/trees/main:$Q:$Q/nvidia_cutlass_dsl/dsl_packages timeout 100 python3 $H/qgemm.py > $OUT/qgemm.log 2>&1) &
wait
cat $L $OUT/suite-hopper.txt; cut -c1-900 $OUT/ab-extra.txt; grep -v "^$" $OUT/qgemm.log | cut -c1-160
