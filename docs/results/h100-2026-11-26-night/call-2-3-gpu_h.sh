#!/bin/bash
# GPU call H (#35, next session): the HF step after the autocast fp32 dW change, Megatron tp=1 with --repeats 4. Was: GPU calls C (#35): launch/train_step.py cases on one H100. Usage: bash .scratch/gpu_c.sh CASE...
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export PYTHONPATH=$PWD:/tmp/site
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
for c in "$@"; do
  echo "=== $c $(date +%T)"
  case $c in
    mg-tp1-rep) timeout 500 torchrun --standalone --nproc-per-node 1 launch/train_step.py megatron --paths megatron,vpce --repeats 4 --steps 100 --out $OUT/mg-tp1-rep ;;
    mg-tp1) timeout 400 torchrun --standalone --nproc-per-node 1 launch/train_step.py megatron --steps 100 --out $OUT/mg-tp1 ;;
    hf) timeout 400 env CUDA_VISIBLE_DEVICES=0 python3 launch/train_step.py hf --steps 100 --out $OUT/hf ;;
    hf-max) timeout 400 env CUDA_VISIBLE_DEVICES=0 python3 launch/train_step.py hf --find-max-seq --seq-granule 4096 --out $OUT/hf-max ;;
    mg-max) timeout 400 torchrun --standalone --nproc-per-node 1 launch/train_step.py megatron --find-max-seq --paths megatron,vpce --seq-granule 4096 --out $OUT/mg-max ;;
    mg-tp2) timeout 400 torchrun --standalone --nproc-per-node 2 launch/train_step.py megatron --steps 100 --out $OUT/mg-tp2 ;;
    bench-tp2) timeout 300 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --shapes llama3-8b --methods floor,vpce-triton,vpce-grpo,vpce-gspo --out /tmp/btp && cp /tmp/btp/*.json $OUT/ ;;
  esac 2>&1 | tee -a $OUT/log.txt | grep -v "^\[rank" | tail -25
  rm -f $OUT/*/loss.pdf
done
