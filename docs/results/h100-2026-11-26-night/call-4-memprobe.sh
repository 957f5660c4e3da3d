#!/bin/bash
# GPU call M: HF step memory by phase and the live set at the step's peak, vpce at main vs ec8fad5 (before the
# autocast change), and liger.
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export REPO=$PWD
for t in "${@:-new:vpce pre:vpce new:liger}"; do :; done
for spec in ${SPECS:-new:vpce pre:vpce new:liger}; do
  tree=${spec%:*}; path=${spec#*:}
  if [ $tree = new ]; then pp=$PWD; else pp=$PWD/.scratch/$tree; fi
  (cd $pp && PYTHONPATH=$pp:/tmp/site timeout 150 python3 $REPO/.scratch/memprobe.py $path $tree 2>&1 | grep -v Warning | tail -20)
done 2>&1 | tee $OUT/m.txt
