"""Session 13 (#17): the bench with the distillation's logits GEMMs in K runs of at most RUN (monkeypatched into
vpce.distill_triton; RUN=0: the package as it is)."""
import sys, torch
import vpce.distill_triton as dtr
from vpce.bench.cli import main
RUN = int(sys.argv[1])
base = dtr.logits_into
def runs_into(out, h, w, b):
    k = h.shape[1]
    runs = -(-k // RUN)
    if runs <= 1:
        return base(out, h, w, b)
    s = k // runs
    base(out, h[:, :s], w[:, :s], b)
    for r in range(1, runs):
        out.addmm_(h[:, r * s:(r + 1) * s], w[:, r * s:(r + 1) * s].t())
    return out
if RUN:
    dtr.logits_into = runs_into
sys.exit(main(sys.argv[2:]))
