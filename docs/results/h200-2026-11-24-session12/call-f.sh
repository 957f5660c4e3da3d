# session 12, call F (nvidia-h200, carry [".scratch", ".whl-liger"]): the bench's new header field (the loss error of
# float64 math on the GEMM's logits) beside every --distill row but the lean ones
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl-liger/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit
L=$OUT/l; mkdir -p $L
trap 'cd $OUT && tar czf logs.tgz l && rm -rf l' EXIT
timeout 400 python -m vpce.bench --distill --methods floor,torch-fkl,liger-fkl,vpce-fkl,torch-jsd,liger-jsd,vpce-jsd,torch-rkl,liger-rkl,vpce-rkl --out $L/d --quiet > $L/bench-distill.log 2>&1; echo rc $?
grep "^floor\|^| " $L/bench-distill.log | grep -v "| method\|---"
