# session 12, calls D and E (nvidia-h200, carry [".scratch"]): promote.py as it stood at each call (D: the P K-blocks
# unrolled in a static_range, out of shared memory for P >= 2; E: the form kept here, one load per iteration)
mkdir -p $OUT && timeout 500 python .scratch/promote.py 2>&1 | grep -v Warn | tee $OUT/promote.log | tail -50
