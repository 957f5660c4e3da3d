#!/bin/bash
# call D: quack installed; in-process interleaved A/B at tp=2 (ab.py: floor, main, dyn, dynh, nohalf), twice; tp=1 A/B
# (floor, main, dyn) on GPU 0 beside the dyn tree's multi-GPU tests... no: tests after, on both GPUs
export PYTHONUNBUFFERED=1
L=$OUT/d.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
nvidia-smi --query-gpu=name --format=csv,noheader > $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
(cd $R/ab && PYTHONPATH=$R/ab:$QP timeout 150 torchrun --standalone --nproc-per-node 2 $S/ab.py --rounds 24 >> $L 2> $OUT/ab.err)
(cd $R/ab && PYTHONPATH=$R/ab:$QP timeout 100 python3 $S/ab.py --rounds 12 --variants main,dyn >> $L 2>> $OUT/ab.err)
(cd $R/dyn && PYTHONPATH=$R/dyn:$QP timeout 200 python3 -m pytest -q -x tests/test_multi_gpu.py tests/test_memory_route.py 2>&1 | tail -5 >> $L)
(cd $R/ab && PYTHONPATH=$R/ab:$QP timeout 100 torchrun --standalone --nproc-per-node 2 $S/ab.py --rounds 16 --variants main,dyn >> $L 2>> $OUT/ab.err)
tail -5 $OUT/ab.err; cat $L
