# session 11, call E (nvidia-h200-x2): GPU 0: GPU tests of HEAD (lean backward buffers not zero-filled);
# GPU 1: lean rows HEAD vs 69ee568 (.scratch/old), then distill one GPU: HEAD vs HEAD with FAST_GIB 1.5 (.scratch/fg)
L=$OUT/l; mkdir -p $L; cat .scratch/COMMIT
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
M=$PWD; O=$PWD/.scratch/old; F=$PWD/.scratch/fg
(cd $M && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$M timeout 330 python -m pytest -q -x tests/test_triton_backend.py tests/test_distillation_triton.py tests/test_memory_route.py tests/test_memory.py -p no:cacheprovider > $L/gpu-tests.log 2>&1; echo "== tests"; tail -2 $L/gpu-tests.log) &
(LB="-m vpce.bench --shapes llama3-8b,gemma2-2b --methods floor,vpce-triton-lean --skip-no-grad --quiet"
 cd $M && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$M timeout 90 python $LB --out $L/lean-new > $L/lean-new.log 2>&1; echo "== lean new"; grep "^| \|floor" $L/lean-new.log | grep -v "| method\|---"
 cd $O && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$O timeout 90 python $LB --out $L/lean-old > $L/lean-old.log 2>&1; echo "== lean old"; grep "^| \|floor" $L/lean-old.log | grep -v "| method\|---"
 DB="-m vpce.bench --distill --methods floor,vpce-jsd --quiet"
 cd $F && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$F timeout 150 python $DB --out $L/d-fg > $L/distill-fg.log 2>&1; echo "== distill FAST_GIB 1.5"; grep "^| \|floor" $L/distill-fg.log | grep -v "| method\|---"
 cd $M && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$M timeout 150 python $DB --out $L/d-new > $L/distill-new.log 2>&1; echo "== distill HEAD"; grep "^| \|floor" $L/distill-new.log | grep -v "| method\|---") &
wait
