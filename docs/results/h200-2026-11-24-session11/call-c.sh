# session 11, call C (nvidia-h200-x2): GPU 0: the long-context rows (Llama-3-8B head at N=131072/262144: floor over
# token chunks where it does not fit, default, lean, lean with main_grad, torch eager, torch.compile);
# GPU 1: the lean rows at N=16384 (both heads, main_grad too), then distill one GPU: tree vs 1ef8b2f (.scratch/old)
L=$OUT/l; mkdir -p $L; cat .scratch/COMMIT
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
M=$PWD; O=$PWD/.scratch/old
export PYTHONPATH=$M
(CUDA_VISIBLE_DEVICES=0 timeout 560 python -m vpce.bench --shapes llama3-8b-128k,llama3-8b-256k --methods floor,vpce-triton,vpce-triton-lean,vpce-triton-lean-main-grad,torch,compile --skip-no-grad --reps 5 --rep-time 0 --out $L/long > $L/bench-long.log 2>&1; echo "== long rc $?"; grep "^| \|floor" $L/bench-long.log | grep -v "| method\|---") &
(CUDA_VISIBLE_DEVICES=1 timeout 120 python -m vpce.bench --shapes llama3-8b,gemma2-2b --methods floor,vpce-triton-lean,vpce-triton-lean-main-grad --skip-no-grad --quiet --out $L/lean > $L/bench-lean.log 2>&1; echo "== lean"; grep "^| \|floor" $L/bench-lean.log | grep -v "| method\|---"
 CUDA_VISIBLE_DEVICES=1 timeout 170 python -m vpce.bench --distill --methods floor,vpce-fkl,vpce-jsd --quiet --out $L/d1new > $L/distill-tp1-new.log 2>&1; echo "== distill tp1 new"; grep "^| \|floor" $L/distill-tp1-new.log | grep -v "| method\|---" | head -4
 (cd $O && CUDA_VISIBLE_DEVICES=1 PYTHONPATH=$O timeout 170 python -m vpce.bench --distill --methods floor,vpce-fkl,vpce-jsd --quiet --out $L/d1old > $L/distill-tp1-old.log 2>&1); echo "== distill tp1 old"; grep "^| \|floor" $L/distill-tp1-old.log | grep -v "| method\|---" | head -4) &
wait
