# session 11, call A (nvidia-h200-x2): main (root) vs branch jsd-tp (.scratch/tp: mixture without guards, dX sum
# awaited in backward): mixture-pass microbench (looped tiles), distill tp=2 x2 rounds, CE tp=2
L=$OUT/l; mkdir -p $L; cat .scratch/COMMIT
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
M=$PWD; N=$PWD/.scratch/tp
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
(cd $N && CUDA_VISIBLE_DEVICES=0 PYTHONPATH=$N timeout 70 python $M/.scratch/mixloop.py > $L/mixloop.log 2>&1); cat $L/mixloop.log | grep -v Warn
D="launch/bench_tp.py --distill --methods floor,vpce-fkl,vpce-jsd --quiet"
for round in 1 2; do
(cd $M && PYTHONPATH=$M timeout 100 torchrun --standalone --nproc-per-node 2 $D --out $L/dmain$round > $L/bench-distill-main-$round.log 2>&1)
echo "== main $round"; grep "^| " $L/bench-distill-main-$round.log | grep -v "| method" | head -4
(cd $N && PYTHONPATH=$N timeout 100 torchrun --standalone --nproc-per-node 2 $D --out $L/dtp$round > $L/bench-distill-tp-$round.log 2>&1)
echo "== tp $round"; grep "^| " $L/bench-distill-tp-$round.log | grep -v "| method" | head -4
done
C="launch/bench_tp.py --methods floor,vpce-triton --quiet"
(cd $M && PYTHONPATH=$M timeout 80 torchrun --standalone --nproc-per-node 2 $C --out $L/cmain > $L/bench-ce-main.log 2>&1)
echo "== ce main"; grep "^| " $L/bench-ce-main.log | grep -v "| method" | head -3
(cd $N && PYTHONPATH=$N timeout 80 torchrun --standalone --nproc-per-node 2 $C --out $L/ctp > $L/bench-ce-tp.log 2>&1)
echo "== ce tp"; grep "^| " $L/bench-ce-tp.log | grep -v "| method" | head -3
