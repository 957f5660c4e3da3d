# session 9, call C (nvidia-h200-x2): JSD mixture variants; where the distillation step's idle time is
export PYTHONPATH=$PWD
L=$OUT/l; mkdir -p $L /tmp/tr; cat .scratch/COMMIT
timeout 120 python .scratch/jsdmix.py > $L/jsdmix.log 2>&1; cat $L/jsdmix.log | grep -v Warn
for d in forward_kl jsd; do
  timeout 70 torchrun --standalone --nproc-per-node 2 launch/profile_tp.py --distill $d --reps 10 --profile-steps 3 --out /tmp/tr > $L/prof-$d-tp2.log 2>&1
  grep "median\|NCCL kernels" $L/prof-$d-tp2.log
  for r in 0 1; do echo "== $d tp2 rank $r"; python .scratch/gaps.py /tmp/tr/trace-$d-tp2-rank$r.json; done > $L/gaps-$d-tp2.log 2>&1
  head -60 $L/gaps-$d-tp2.log
done
timeout 60 python launch/profile_tp.py --distill forward_kl --reps 10 --profile-steps 3 --out /tmp/tr > $L/prof-fkl-tp1.log 2>&1
grep "median" $L/prof-fkl-tp1.log
python .scratch/gaps.py /tmp/tr/trace-forward_kl-tp1-rank0.json > $L/gaps-fkl-tp1.log 2>&1; head -40 $L/gaps-fkl-tp1.log
cd $OUT && tar czf logs.tgz l && rm -rf l
