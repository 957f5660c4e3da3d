#!/bin/bash
# call 3 (x2, right after 2; quack and .whl installed): tp=2 with the extra, main / next / next / main; then every
# peer, one head at a time on GPU 0 (Llama-3-8B, then Gemma-2-2B without quack's base path, which stalls there),
# at tree $TREE.
export PYTHONUNBUFFERED=1
H=.scratch/qc6
R=$PWD/$H/trees
Q=/tmp/quack/site-packages; QP=$Q:$Q/nvidia_cutlass_dsl/dsl_packages
L=$OUT/c3.txt
nvidia-smi --query-gpu=name --format=csv,noheader > $L; cat $H/commit.txt >> $L; echo "every-peer tree: $TREE" >> $L
i=0
for tree in main next next main; do
  i=$((i+1)); rm -rf /tmp/tp; (cd $R/$tree && PYTHONPATH=$R/$tree:$QP timeout 120 torchrun --standalone --nproc-per-node 2 \
     launch/bench_tp.py --methods floor,vpce-triton --out /tmp/tp > /tmp/tp.log 2>&1)
  cp /tmp/tp/bench-tp2.json $OUT/tp2-$i-$tree.json 2>/dev/null || tail -20 /tmp/tp.log >> $L
  python3 -c "
import json; d=json.load(open('/tmp/tp/bench-tp2.json'))
print('tp2 hopper $tree', ' '.join(f\"{r['method']}={r['ms'] or 0:.2f}({r.get('x_floor') or 0:.4f},{r.get('extra_gib') or 0:.2f}GiB,dx{r.get('dx_err') or 0:.1e},dw{r.get('dw_err') or 0:.1e})\" for r in d['rows'] if r.get('rank')=='max'))" >> $L 2>&1
done
M="floor,compile,liger,quack,quack-base,trl,vpce-triton,vpce-triton-lean,vpce-softcap,vpce-all,vpce-dft,vpce-metrics,compile-frozen,quack-base-frozen,vpce-triton-frozen"
MG=${M//quack-base,/}; MG=${MG//,quack-base-frozen/}
export CUDA_VISIBLE_DEVICES=0
(cd $R/$TREE && PYTHONPATH=$R/$TREE:/tmp/site:$QP timeout 300 python3 -m vpce.bench --shapes llama3-8b --methods $M --out $OUT/b-llama3-8b > $OUT/bench-llama3-8b.log 2>&1)
(cd $R/$TREE && PYTHONPATH=$R/$TREE:/tmp/site:$QP timeout 120 python3 -m vpce.bench --shapes gemma2-2b --methods $MG --out $OUT/b-gemma2-2b > $OUT/bench-gemma2-2b.log 2>&1)
cat $L; for s in llama3-8b gemma2-2b; do grep -v "\.\.\.$" $OUT/bench-$s.log | grep "^|\|floor " ; done
