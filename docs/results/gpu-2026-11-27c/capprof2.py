"""capprof.py's timings for one copy of the package (VARIANT names it): plain and soft cap, stats and grad passes,
default launch and 8-row programs. Appends to $OUT/capprof2.txt."""
import os, torch, triton
from vpce import kernels

def t(fn, reps=20):
    for _ in range(3): fn()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / reps

M, V = 8192, 128256
torch.manual_seed(0)
P0 = (torch.randn(M, V, device="cuda") * 3).to(torch.bfloat16)
P = P0.clone()
tl_local = torch.randint(0, V, (M,), device="cuda", dtype=torch.int32)
nt = triton.cdiv(V, kernels.tile_n(P))
f32 = dict(device="cuda", dtype=torch.float32)
tm, ts = torch.empty(M, nt, **f32), torch.empty(M, nt, **f32)
rows = (torch.zeros(M, **f32), torch.full((M,), 15.0, **f32), torch.full((M,), 0.5, **f32))
coef = (torch.full((M,), 1e-4, **f32), None, torch.full((M,), -1e-4, **f32), None)
with open(os.path.join(os.environ["OUT"], "capprof2.txt"), "a") as f:
    for cap in (None, 30.0):
        for launch in ({}, {"block_m": 8}):
            st = t(lambda: kernels.stored_logits(P0, None, tl_local, softcap=cap, tile_m=tm, tile_s=ts, **launch))
            gr = t(lambda: kernels.stored_logits(P, None, tl_local, softcap=cap, rows=rows, coef=coef, **launch))
            line = f"{os.environ['VARIANT']:10s} cap={cap} {launch} stats {st:.4f} grad {gr:.4f}"
            print(line, flush=True); f.write(line + "\n")
