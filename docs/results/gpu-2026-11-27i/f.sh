#!/bin/bash
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
(CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$QP timeout 280 python3 .dev/s/probe.py 64128 > $OUT/probe-tp2.txt 2>&1) &
(CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$QP timeout 280 python3 .dev/s/probe.py 128256 > $OUT/probe-tp1.txt 2>&1) &
wait; cat $OUT/probe-tp2.txt; echo; cat $OUT/probe-tp1.txt
