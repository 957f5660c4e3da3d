#!/bin/bash
# call F: quack installed; bench_tp final / main / final / main (final = the working tree: dynamic quack scheduler,
# one statistics launch per chunk); GPU tests (gpu or nccl) of the final tree; tp=1 benches (GPU 0 Llama, GPU 1
# Gemma); in-process A/B (ab tree: main vs dynh) at tp=2
export PYTHONUNBUFFERED=1
L=$OUT/f.txt; S=$PWD/.dev/s; R=$PWD/.dev/trees; F=$PWD
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
END=$(( $(date +%s) + ${KT:-500} ))
nvidia-smi --query-gpu=name --format=csv,noheader > $L; (git -C $F log --oneline -1 2>/dev/null || echo "no git") >> $L
bash $S/install.sh >> $L 2>&1 || { echo install failed; cat $L; exit 1; }
bench() {  # tag dir
  [ $(date +%s) -gt $((END - 60)) ] && { echo "bench $1 skipped" >> $L; return; }
  rm -rf /tmp/tp; (cd $2 && PYTHONPATH=$2:$QP timeout 75 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --out /tmp/tp >> $OUT/bench.log 2>&1)
  python3 $S/tp2.py "tp2 $1" /tmp/tp/bench-tp2.json >> $L 2>&1
}
bench final $F; bench main $R/main; bench final2 $F; bench main2 $R/main
(cd $F && PYTHONPATH=$F:$QP timeout 170 python3 -m pytest -q tests/test_multi_gpu.py tests/test_memory_route.py \
   tests/test_triton_backend.py -k "gpu or nccl" 2>&1 | tail -4 >> $L)
one() {  # gpu shape
  (cd $F && CUDA_VISIBLE_DEVICES=$1 PYTHONPATH=$F:$QP timeout 110 python3 -m vpce.bench --shapes $2 \
     --methods floor,vpce-triton,vpce-softcap --skip-no-grad --row-timeout 90 --out /tmp/one-$2 > $OUT/one-$2.log 2>&1)
  python3 $S/rows.py "tp1 $2" /tmp/one-$2/bench.json
}
if [ $(date +%s) -lt $((END - 110)) ]; then
  one 0 llama3-8b > /tmp/o1 2>&1 & one 1 gemma2-2b > /tmp/o2 2>&1 & wait; cat /tmp/o1 /tmp/o2 >> $L
fi
[ $(date +%s) -lt $((END - 70)) ] && (cd $R/ab && PYTHONPATH=$R/ab:$QP timeout 70 torchrun --standalone --nproc-per-node 2 \
   $S/ab.py --rounds 12 --variants main,dynh >> $L 2>> $OUT/ab.err)
cat $L
