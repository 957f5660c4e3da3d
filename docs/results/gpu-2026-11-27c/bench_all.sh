# the #36 table: every peer installed, one bench run per shape (SHAPE, METHODS)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .scratch/whl2/*.whl 2>&1 | tail -1
Q=/tmp/quack/site-packages
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site:$Q:$Q/nvidia_cutlass_dsl/dsl_packages
nvidia-smi --query-gpu=name --format=csv,noheader
git_commit=$(cat .scratch/commit.txt 2>/dev/null)
echo "tree: $git_commit"
timeout ${T:-560} python3 -m vpce.bench --shapes $SHAPE --methods $METHODS --out $OUT/b-$SHAPE 2>&1 | tee $OUT/bench-$SHAPE.log | grep -v "\.\.\.$" | tail -45
