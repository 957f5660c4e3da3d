#!/bin/bash
# Next session, call 2 (one GPU): the HF Trainer step at the current main (b1e0068's P rule: expect vpce ~14.37 GiB),
# Megatron tp=1 at V=256000. Call 3 (nvidia-h100-x2): CASES=mg-tp2-256k.
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=$PWD:/tmp/site
for c in ${CASES:-hf mg-tp1-256k}; do
  echo "=== $c $(date +%T)"
  case $c in
    hf) timeout 220 python3 launch/train_step.py hf --steps 100 --out $OUT/hf ;;
    mg-tp1-256k) timeout 300 torchrun --standalone --nproc-per-node 1 launch/train_step.py megatron --vocab 256000 --steps 100 --out $OUT/mg-tp1-256k ;;
    mg-tp2-256k) timeout 300 torchrun --standalone --nproc-per-node 2 launch/train_step.py megatron --vocab 256000 --steps 100 --out $OUT/mg-tp2-256k ;;
  esac 2>&1 | tee -a $OUT/log.txt | grep "tokens/s\|Error" | tail -12
  rm -rf $OUT/*/path-* $OUT/*/loss.pdf
done
