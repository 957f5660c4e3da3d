#!/bin/bash
# call B (right after A): quack installed; (1) the epilogue probe (qlse.py: the statistics epilogue's GEMM alone
# against cuBLAS + the statistics pass); (2) the stats-epilogue branch's GPU tests with the extra. Then call C.
export PYTHONUNBUFFERED=1
H=.scratch/qc9
L=$OUT/b.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat $H/commit.txt >> $L
bash .scratch/qc3/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
R=$PWD/$H/trees
S=$PWD/.scratch/qc8/qlse.py
(cd $R/se && PYTHONPATH=$R/se:$QP timeout 240 python3 $S > $OUT/qlse.log 2>&1)
grep -v "^$" $OUT/qlse.log | cut -c1-200 >> $L
(cd $R/se && PYTHONPATH=$R/se:$QP timeout 150 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_triton_backend.py \
   -k "epilogue or matches_oracle or hopper" > $OUT/tests.txt 2>&1); tail -5 $OUT/tests.txt >> $L
cat $L
