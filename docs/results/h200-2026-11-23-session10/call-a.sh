# session 10, call A (nvidia-h200-x2): distill tp=2 main vs branch distill-combine (.scratch/dc), traces of both ranks,
# Gemma/Llama single-GPU timelines (current fast route), distillation GPU tests on main
L=$OUT/l; mkdir -p $L /tmp/tr /tmp/trdc; cat .scratch/COMMIT; nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
for round in 1 2; do
PYTHONPATH=$PWD timeout 100 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill --methods floor,vpce-fkl,vpce-jsd --out $L/main$round --quiet > $L/bench-main-$round.log 2>&1
echo "== main $round"; grep "^| \|floor" $L/bench-main-$round.log | head -6
(cd .scratch/dc && PYTHONPATH=$PWD timeout 100 torchrun --standalone --nproc-per-node 2 launch/bench_tp.py --distill --methods floor,vpce-fkl,vpce-jsd --out $L/dc$round --quiet > $L/bench-dc-$round.log 2>&1)
echo "== dc $round"; grep "^| \|floor" $L/bench-dc-$round.log | head -6
done
(cd .scratch/dc && PYTHONPATH=$PWD timeout 70 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py --distill jsd --reps 10 --profile-steps 2 --out /tmp/trdc > $L/prof-dc-jsd-tp2.log 2>&1)
grep "median" $L/prof-dc-jsd-tp2.log
PYTHONPATH=$PWD timeout 60 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py --reps 10 --profile-steps 2 --out /tmp/tr > $L/prof-ce-tp2.log 2>&1
grep "median" $L/prof-ce-tp2.log
for f in /tmp/trdc/*.json /tmp/tr/*.json; do gzip -c $f > $L/$(basename $(dirname $f))-$(basename $f).gz; done
PYTHONPATH=$PWD timeout 60 python .scratch/timeline.py gemma > $L/timeline-gemma.log 2>&1
PYTHONPATH=$PWD timeout 60 python .scratch/timeline.py llama > $L/timeline-llama.log 2>&1
tail -3 $L/timeline-gemma.log
PYTHONPATH=$PWD timeout 170 python -m pytest -q -x tests/test_multi_gpu.py tests/test_distillation_tp.py tests/test_distillation_triton.py -p no:cacheprovider > $L/gpu-tests.log 2>&1; tail -3 $L/gpu-tests.log
cd $OUT && tar czf logs.tgz l && rm -rf l
