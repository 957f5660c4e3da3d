#!/bin/bash
# call S (x2, quack installed by call G): the whole GPU suite of the working tree on both routes at once, GPU 0 with
# the hopper extra, GPU 1 without it, each in its own copy of the checkout (suite6.sh, 8 groups at once); the
# peers' wheels (.whl) -> /tmp/site
export PYTHONUNBUFFERED=1
S=$PWD/.dev/s
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > $OUT/pip.txt 2>&1
for tag in hopper triton; do
  X=/tmp/se-$tag; rm -rf $X && mkdir $X && cp -r $(ls -A | grep -v "^.dev$\|^.whl$\|^.git$\|^.whl-quack$") $X/
  cp $S/suite6.sh $S/groups.txt $S/instalog.py $X/
done
(cd /tmp/se-hopper && GPU=0 TAG=hopper QUACK=1 SUITE_T=${SUITE_T:-330} bash suite6.sh) &
(cd /tmp/se-triton && GPU=1 TAG=triton SUITE_T=${SUITE_T:-330} bash suite6.sh) &
wait
cat $OUT/suite-hopper.txt $OUT/suite-triton.txt
