#!/bin/bash
# call 1 (x2): .whl -> /tmp/site, quack's first part -> /tmp/quack. GPU 0: the whole suite without the extra at
# the checkout (branch next). GPU 1 meanwhile: A/B main / next without the extra (plain, variants,
# frozen), then kernels.one_pass alone against the two passes (opbench.py).
export PYTHONUNBUFFERED=1
H=.scratch/qc6
L=$OUT/c1.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat $H/commit.txt >> $L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >> $L 2>&1
mkdir -p /tmp/quack && cp .scratch/qc1/cu13.tar.xz.part-aa /tmp/quack/
(GPU=0 TAG=plain QUACK=0 SUITE_T=330 bash $H/suite6.sh) &
(export CUDA_VISIBLE_DEVICES=1
 ORDER="main next" T=100 bash $H/ab6.sh $OUT/ab-noextra.txt next:floor,vpce-triton,vpce-softcap,vpce-all,vpce-dft,vpce-metrics,vpce-triton-frozen
 PYTHONPATH=$PWD/$H/trees/next timeout 130 python3 $H/opbench.py > $OUT/opbench.log 2>&1) &
wait
cat $L $OUT/suite-plain.txt; cut -c1-700 $OUT/ab-noextra.txt; cat $OUT/opbench.txt
