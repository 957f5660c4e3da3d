#!/bin/bash
# call B: quack installed; the frozen-whole tests with the extra at the checkout (branch frozen-whole); A/B main / fz
# (floor, frozen head), both heads; then one Llama run at fz with quack's frozen base path beside vpce's.
export PYTHONUNBUFFERED=1
H=.scratch/qc7
L=$OUT/b.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat $H/commit.txt >> $L
bash .scratch/qc3/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
PYTHONPATH=$PWD:$QP timeout 120 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_memory_route.py \
  tests/test_triton_backend.py -k "frozen or one_chunk or auto" > $OUT/tests.txt 2>&1; tail -3 $OUT/tests.txt >> $L
ORDER="main BR" T=90 bash $H/ab7.sh $OUT/ab-fz.txt fz:floor,vpce-triton-frozen
cat $OUT/ab-fz.txt >> $L
R=$PWD/$H/trees
(cd $R/fz && PYTHONPATH=$R/fz:$QP timeout 230 python3 -m vpce.bench --shapes llama3-8b --methods floor,quack-base-frozen,vpce-triton-frozen \
   --out $OUT/b-llama > $OUT/bench-llama.log 2>&1)
grep -v "\.\.\.$" $OUT/bench-llama.log | grep "^|\|floor " >> $L
cat $L
