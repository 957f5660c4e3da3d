#!/bin/bash
# call C (x2, quack installed): the whole GPU suite at n8 on both routes at once: GPU 0 with the hopper extra, GPU 1
# without it (the Triton route), each in its own copy of the checkout with n8's tree over it
# (docs/results/gpu-2026-11-27e/suite6.sh, 8 groups at once); .whl -> /tmp/site
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
R=$PWD/.scratch/qc14/trees/n8
for tag in hopper triton; do
  S=/tmp/se-$tag; rm -rf $S && mkdir $S && cp -r $(ls -A | grep -v "^.scratch$\|^.whl$\|^.git$") $S/
  rm -rf $S/vpce $S/tests $S/launch && cp -r $R/* $S/
  cp docs/results/gpu-2026-11-27e/suite6.sh docs/results/gpu-2026-11-27e/groups.txt .scratch/qc14/instalog.py $S/
done
(cd /tmp/se-hopper && GPU=0 TAG=hopper QUACK=1 SUITE_T=${SUITE_T:-330} bash suite6.sh) &
(cd /tmp/se-triton && GPU=1 TAG=triton SUITE_T=${SUITE_T:-330} bash suite6.sh) &
wait
cat $OUT/suite-hopper.txt $OUT/suite-triton.txt
