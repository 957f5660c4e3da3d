# session 12, call B (nvidia-h200, carry [".scratch"]): #17's JSD loss error with the teacher's logits in fp32
L=$OUT/l; mkdir -p $L; git log --oneline -1 2>/dev/null
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
export PYTHONPATH=$PWD
run() { n=$1; shift; timeout 200 python .scratch/fp32t.py "$@" --distill --out $L/$n --quiet > $L/$n.log 2>&1; echo "== $n rc $?"; grep "^floor\|^| " $L/$n.log | grep -v "| method\|---"; }
run fp32t-c2048 fp32t 1.0 --methods floor,torch-jsd,vpce-jsd,torch-fkl,vpce-fkl,torch-rkl,vpce-rkl
run bf16-c2048 bf16 1.0 --methods floor,vpce-jsd,vpce-fkl
run bf16-default bf16 1.5 --methods floor,vpce-jsd,vpce-fkl
run fp32t-default fp32t 1.5 --methods floor,vpce-jsd
