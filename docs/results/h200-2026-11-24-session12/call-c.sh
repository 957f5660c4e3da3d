# session 12, call C (nvidia-h200, carry [".scratch"]): the GEMM's share of the distillation losses' bias (#17)
export PYTHONPATH=$PWD; mkdir -p $OUT
timeout 400 python .scratch/gemm_bias.py 2>&1 | tee $OUT/gemm_bias.log
