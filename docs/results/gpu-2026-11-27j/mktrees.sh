#!/bin/bash
# the trees under .dev/trees/ that this session's calls ran (from the checkout's root); main = e753d07
set -e
R=.dev/trees; rm -rf $R; mkdir -p $R/main
git archive e753d07 vpce launch pyproject.toml | tar -x -C $R/main
for t in noar nohalf dyn dynh ab; do cp -r $R/main $R/$t; done
# noar: no dX all-reduce (timing only: dX is then wrong)
python3 - <<'PY'
import re
def sub(path, old, new):
    s = open(path).read(); assert old in s, (path, old); open(path, "w").write(s.replace(old, new))
R = ".dev/trees"
sub(f"{R}/noar/vpce/parallel.py", "        if not self.sp:\n            self.works.append(dist.all_reduce(self.dx[rows], group=g, async_op=True))",
    "        if not self.sp:\n            return  # EXPERIMENT: no dX all-reduce (timing only)")
for t in ("nohalf", "dynh"):  # each chunk's statistics in one launch under a group
    sub(f"{R}/{t}/vpce/triton_backend.py", "        if call.shard.sharded and c >= 4 * ROW_ALIGN:", "        if False:")
for t in ("dyn", "dynh"):  # quack's dynamic persistent scheduler in every vpce quack GEMM
    s = open(f"{R}/{t}/vpce/gemm.py").read(); open(f"{R}/{t}/vpce/gemm.py", "w").write(
        s.replace("is_dynamic_persistent=False", "is_dynamic_persistent=True"))
# ab: both as module toggles that ab.py flips between blocks of steps
s = open(f"{R}/ab/vpce/gemm.py").read().replace("is_dynamic_persistent=False", "is_dynamic_persistent=DYNAMIC")
open(f"{R}/ab/vpce/gemm.py", "w").write(s.replace("DW_TILE = dict(", "DYNAMIC = True  # EXPERIMENT toggle\nDW_TILE = dict(", 1))
sub(f"{R}/ab/vpce/triton_backend.py", "        if call.shard.sharded and c >= 4 * ROW_ALIGN:",
    "        if HALVES and call.shard.sharded and c >= 4 * ROW_ALIGN:")
sub(f"{R}/ab/vpce/triton_backend.py", "def _first_chunk(", "HALVES = True  # EXPERIMENT toggle\n\n\ndef _first_chunk(")
PY
git archive e753d07 tests | tar -x -C $R/dyn
