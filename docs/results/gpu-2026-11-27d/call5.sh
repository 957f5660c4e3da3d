#!/bin/bash
# x2 call 5 (quack installed by call 4): tp=2 with the hopper extra (floor, vpce-triton), twice; then every peer in
# one run per head: Llama-3-8B on GPU 0, Gemma-2-2B (no quack base: it stalls there) on GPU 1
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .scratch/whl2/*.whl 2>&1 | tail -1
Q=/tmp/quack/site-packages
QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
L=$OUT/call5.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat .scratch/commit.txt >> $L
for i in 1 2; do
  rm -rf /tmp/tpq$i
  PYTHONPATH=$PWD:$QP timeout 150 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --methods floor,vpce-triton \
     --out /tmp/tpq$i > /tmp/tpq$i.log 2>&1
  python3 - /tmp/tpq$i <<'PY' >> $L 2>&1
import json, sys
d = json.load(open(sys.argv[1] + "/bench-tp2.json"))
print("tp2 hopper", " ".join(f"{r['method']}={r['ms'] or 0:.2f}({r.get('x_floor') or 0:.4f},"
      f"{r.get('extra_gib') or 0:.2f}GiB,dx{r.get('dx_err') or 0:.1e},dw{r.get('dw_err') or 0:.1e})" for r in d["rows"]
      if r.get("rank") == "max"), "| extra:", d.get("versions", {}).get("quack", d.get("versions")))
PY
done
cp /tmp/tpq1/bench-tp2.json $OUT/bench-tp2-hopper.json
export PYTHONPATH=$PWD:/tmp/site:$QP
M="floor,compile,liger,quack,quack-base,trl,vpce-triton,vpce-triton-lean,vpce-softcap,vpce-all,vpce-dft,vpce-metrics,compile-frozen,quack-base-frozen,vpce-triton-frozen"
MG=${M//quack-base,/}; MG=${MG//,quack-base-frozen/}
(CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m vpce.bench --shapes llama3-8b --methods $M --out $OUT/b-llama3-8b > $OUT/bench-llama3-8b.log 2>&1) &
(CUDA_VISIBLE_DEVICES=1 timeout 420 python3 -m vpce.bench --shapes gemma2-2b --methods $MG  --out $OUT/b-gemma2-2b > $OUT/bench-gemma2-2b.log 2>&1) &
wait
cat $L; for s in llama3-8b gemma2-2b; do grep -v "\.\.\.$" $OUT/bench-$s.log | grep "^|\|floor " ; done
