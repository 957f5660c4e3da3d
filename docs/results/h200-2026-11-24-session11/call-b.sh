# session 11, call B (nvidia-h200-x2): branch jsd-tp (.scratch/tp): profiles of tp=2 JSD and CE with the layout passed
# (traces of both ranks), GPU tests of the branch, two more distill A/B rounds (main root vs branch)
L=$OUT/l; mkdir -p $L /tmp/trj /tmp/trc; cat .scratch/COMMIT
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
M=$PWD; N=$PWD/.scratch/tp
(cd $N && PYTHONPATH=$N timeout 80 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py --distill jsd --reps 10 --profile-steps 2 --out /tmp/trj > $L/prof-jsd-tp2.log 2>&1)
grep "median" $L/prof-jsd-tp2.log
(cd $N && PYTHONPATH=$N timeout 60 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py --reps 10 --profile-steps 2 --out /tmp/trc > $L/prof-ce-tp2.log 2>&1)
grep "median" $L/prof-ce-tp2.log
for f in /tmp/trj/*.json /tmp/trc/*.json; do gzip -c $f > $L/$(basename $(dirname $f))-$(basename $f).gz; done
(cd $N && PYTHONPATH=$N timeout 200 python -m pytest -q -x tests/test_multi_gpu.py tests/test_distillation_tp.py tests/test_distillation_triton.py -p no:cacheprovider > $L/gpu-tests.log 2>&1); tail -3 $L/gpu-tests.log
D="launch/bench_tp.py --distill --methods floor,vpce-fkl,vpce-jsd --quiet"
for round in 3 4; do
(cd $N && PYTHONPATH=$N timeout 100 torchrun --standalone --nproc-per-node 2 $D --out $L/dtp$round > $L/bench-distill-tp-$round.log 2>&1)
echo "== tp $round"; grep "^| " $L/bench-distill-tp-$round.log | grep -v "| method" | head -4
(cd $M && PYTHONPATH=$M timeout 100 torchrun --standalone --nproc-per-node 2 $D --out $L/dmain$round > $L/bench-distill-main-$round.log 2>&1)
echo "== main $round"; grep "^| " $L/bench-distill-main-$round.log | grep -v "| method" | head -4
done
