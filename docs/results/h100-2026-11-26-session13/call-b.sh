# session 13, call B (asked for nvidia-h200, ran on an H100 80GB HBM3; carry [".scratch"]; call A had not carried
# .scratch and ran nothing): cuBLAS logits in K runs, errors and cost (#17)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1; L=$OUT/l; mkdir -p $L; trap 'cd $OUT && tar czf logs.tgz l' EXIT
timeout 60 python .scratch/ksplit.py time 2>&1 | tee $L/time.log
timeout 120 python .scratch/ksplit.py err > $L/err.log 2>&1; echo err rc $?
timeout 120 python .scratch/benchpatch.py 4096 --distill --methods floor,vpce-jsd,vpce-fkl,vpce-rkl --out $L/b1 --quiet > $L/b1.log 2>&1; echo b1 rc $?
timeout 200 python .scratch/benchpatch.py 0 --distill --methods floor,vpce-jsd,torch-fkl,vpce-fkl,torch-rkl,vpce-rkl --out $L/b0 --quiet > $L/b0.log 2>&1; echo b0 rc $?
