#!/bin/bash
# x2 call 4: quack installed; the whole suite twice at once: GPU 0 without the hopper extra, GPU 1 with it
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl > $OUT/install.txt 2>&1
bash .scratch/qc3/install.sh >> $OUT/install.txt 2>&1 || { echo install failed; cat $OUT/install.txt; exit 1; }
(GPU=0 TAG=plain QUACK=0 bash .scratch/qc4/suite.sh) &
(GPU=1 TAG=hopper QUACK=1 bash .scratch/qc4/suite.sh) &
wait
cat $OUT/suite-plain.txt $OUT/suite-hopper.txt
