#!/bin/bash
# the whole suite with the hopper extra on one GPU at the next6 tree: the checkout copied to /tmp/serepo
# with the branch's vpce, tests, launch and pyproject.toml over it ; .whl -> /tmp/site
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
rm -rf /tmp/serepo && mkdir /tmp/serepo && cp -r $(ls -A | grep -v "^.scratch$\|^.whl$\|^.git$") /tmp/serepo/
R=$PWD/.scratch/qc11/trees/n6

rm -rf /tmp/serepo/vpce /tmp/serepo/tests /tmp/serepo/launch && cp -r $R/vpce $R/tests $R/launch $R/pyproject.toml /tmp/serepo/
cp docs/results/gpu-2026-11-27e/suite6.sh docs/results/gpu-2026-11-27e/groups.txt .scratch/instalog.py /tmp/serepo/ 2>/dev/null
ls docs/results/gpu-2026-11-27e/instalog.py .scratch/instalog.py 2>/dev/null
cd /tmp/serepo && grep -n "^LOGITS_TILE" vpce/gemm.py && GPU=0 TAG=hopper QUACK=1 SUITE_T=${SUITE_T:-300} bash suite6.sh
cat $OUT/suite-hopper.txt
