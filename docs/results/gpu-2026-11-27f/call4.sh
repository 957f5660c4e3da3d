#!/bin/bash
# call B (right after qc9/a.sh): quack installed; the epilogue probe (qlse2.py) on the se tree, the pick of its
# config (kept in /tmp for call C), the branch's GPU tests with the extra at that config.
export PYTHONUNBUFFERED=1
L=$OUT/b.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat .scratch/qc9/commit.txt >> $L
bash .scratch/qc3/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
R=$PWD/.scratch/qc9/trees
(cd $R/se && PYTHONPATH=$R/se:$QP timeout 260 python3 $OLDPWD/.scratch/qc10/qlse2.py > $OUT/qlse2.log 2>&1)
grep -v "^$" $OUT/qlse2.log | cut -c1-260 >> $L
cp $OUT/qlse2.json /tmp/qlse2.json
python3 .scratch/qc10/pick.py /tmp/qlse2.json > /tmp/pick.txt 2>> $L; cat /tmp/pick.txt >> $L
grep -q LOGITS_TILE /tmp/pick.txt && sed -i "s/^LOGITS_TILE = .*/$(cat /tmp/pick.txt)/" $R/se/vpce/gemm.py
grep -n "^LOGITS_TILE" $R/se/vpce/gemm.py >> $L
(cd $R/se && PYTHONPATH=$R/se:$QP timeout 170 python3 -m pytest -q -p no:cacheprovider -rfE tests/test_triton_backend.py \
   -k "epilogue or matches_oracle or hopper" > $OUT/tests.txt 2>&1); tail -12 $OUT/tests.txt | cut -c1-300 >> $L
cat $L
