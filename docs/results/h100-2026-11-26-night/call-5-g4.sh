#!/bin/bash
# GPU call G4: (1) the HF Trainer step, vpce path, after the lm_head stand-in; (2) the HF step's memory and time
# with the fast route's P at 1, 0.5, 0.25 x dW; (3) Llama-3-8B bench rows at those shares; (4) distillation A/B
# one-loop vs d342e2b.
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
fi
export REPO=$PWD
nvidia-smi --query-gpu=name --format=csv,noheader | tee $OUT/g4.txt
echo "== hf vpce $(date +%T)" >> $OUT/g4.txt
PYTHONPATH=$PWD:/tmp/site timeout 100 python3 launch/train_step.py hf --paths vpce --steps 60 --out /tmp/hf 2>&1 | grep "tokens/s" | tee -a $OUT/g4.txt
for sh in 1.0 0.5 0.25; do
  echo "== memprobe share $sh $(date +%T)" >> $OUT/g4.txt
  PSHARE=$sh PYTHONPATH=$PWD:$PWD/.scratch:/tmp/site timeout 90 python3 .scratch/memprobe.py vpce new 2>&1 | grep -v Warn | head -8 | tee -a $OUT/g4.txt
done
for sh in 1.0 0.5 0.25 0.25 0.5 1.0; do
  PSHARE=$sh PYTHONPATH=$PWD:$PWD/.scratch timeout 60 python3 -c "import psize, runpy, sys; sys.argv=['vpce.bench','--shapes','llama3-8b','--methods','floor,vpce-triton,vpce-logprobs-top1','--skip-no-grad','--out','/tmp/p']; runpy.run_module('vpce.bench', run_name='__main__')" > /tmp/p.txt 2>&1
  python3 - $sh <<'PY' 2>&1 | tee -a $OUT/g4.txt
import json, sys
d = json.load(open("/tmp/p/bench.json"))
print("ce share", sys.argv[1], " ".join(f"{r['method']}={r['ms']:.2f}({r.get('x_floor') or 1:.3f},{r.get('extra_gib') or 0:.2f})" for r in d["rows"]))
PY
done
i=0
for tree in oneloop base base oneloop; do
  i=$((i+1))
  (cd .scratch/$tree && timeout 80 python3 -m vpce.bench --distill --methods floor,vpce-fkl,vpce-fkl-lean,vpce-jsd,vpce-jsd-lean,vpce-rkl --skip-no-grad --out /tmp/d-$i > /tmp/d-$i.txt 2>&1)
  python3 - $tree $i <<'PY' 2>&1 | tee -a $OUT/g4.txt
import json, os, sys
t, i = sys.argv[1:]
d = json.load(open(f"/tmp/d-{i}/bench-distill.json"))
print("distill", t, " ".join(f"{r['method']}={r['ms']:.2f}({r.get('x_floor') or 1:.3f})" for r in d["rows"]))
with open(f"{os.environ['OUT']}/g4-distill.jsonl", "a") as f:
    f.write(json.dumps({"tree": t, "round": int(i), "bench": d}) + "\n")
PY
done
echo "end $(date +%T)" >> $OUT/g4.txt
