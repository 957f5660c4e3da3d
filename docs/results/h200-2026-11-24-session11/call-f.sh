# session 11, call F (nvidia-h200-x2): distillation fast-route buffers 1.5 GiB / 1.5x dW accumulator (HEAD) against
# 1 GiB / 1x (338ad6e, .scratch/old): tp=2 alternating x2; then one GPU HEAD (forward KL, JSD) beside the GPU tests
L=$OUT/l; mkdir -p $L; cat .scratch/COMMIT
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
M=$PWD; O=$PWD/.scratch/old
D="launch/bench_tp.py --distill --methods floor,vpce-fkl,vpce-jsd --quiet"
for round in 1 2; do
(cd $M && PYTHONPATH=$M timeout 90 torchrun --standalone --nproc-per-node 2 $D --out $L/tp2new$round > $L/tp2-new-$round.log 2>&1)
echo "== new $round"; grep "^| " $L/tp2-new-$round.log | grep -v "| method\|---" | head -3
(cd $O && PYTHONPATH=$O timeout 90 torchrun --standalone --nproc-per-node 2 $D --out $L/tp2old$round > $L/tp2-old-$round.log 2>&1)
echo "== old $round"; grep "^| " $L/tp2-old-$round.log | grep -v "| method\|---" | head -3
done
(cd $M && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$M timeout 150 python -m vpce.bench --distill --methods floor,vpce-fkl,vpce-jsd --quiet --out $L/tp1new > $L/tp1-new.log 2>&1; echo "== tp1 new"; grep "^| \|floor" $L/tp1-new.log | grep -v "| method\|---" | head -4) &
(cd $M && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$M timeout 150 python -m pytest -q tests/test_distillation_triton.py -p no:cacheprovider > $L/gpu-tests.log 2>&1; echo "== tests"; tail -1 $L/gpu-tests.log) &
wait
