"""Kernel-level A/B per chunk (fused GEMM+stats+P then P->grad, against cuBLAS logits + stored-logits passes),
and a host-side profile of one vpce step."""
import cProfile, io, math, pstats, statistics, sys, torch
import vpce, vpce.triton_backend as tb
from vpce import kernels

def bench(fn, reps=10):
    fn(); torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(reps): fn()
    b.record(); torch.cuda.synchronize()
    return a.elapsed_time(b) / reps

dev = torch.device("cuda")
for name, (C, D, V) in {"llama-chunk": (6144, 4096, 128256), "gemma-chunk": (2432, 2304, 256000)}.items():
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(C, D, device=dev, generator=g).bfloat16()
    w = (torch.randn(V, D, device=dev, generator=g) / math.sqrt(D)).bfloat16()
    t = torch.randint(0, V, (C,), device=dev, generator=g).to(torch.int32)
    p = torch.empty(C, V, device=dev, dtype=torch.bfloat16)
    nt = math.ceil(V / 256)
    f32 = dict(device=dev, dtype=torch.float32)
    tm, ts, zt = torch.empty(C, nt, **f32), torch.empty(C, nt, **f32), torch.empty(C, **f32)
    rows = (torch.zeros(C, **f32), torch.full((C,), 12.0, **f32), torch.full((C,), 0.5, **f32))
    coef = (torch.full((C,), 1e-4, **f32), None, torch.full((C,), -1e-4, **f32), None)
    res = {}
    for cap in (None, 30.0):
        comps = {
            "fused stats+P": lambda: kernels.logits_tiles(x, w, None, t, softcap=cap, tile_m=tm, tile_s=ts, zt=zt, p=p),
            "fused stats only": lambda: kernels.logits_tiles(x, w, None, t, softcap=cap, tile_m=tm, tile_s=ts, zt=zt),
            "probs_to_grad": lambda: kernels.probs_to_grad_(p, p, tm, rows, zt, t, (coef[0], coef[2], None), cap, 256),
            "cublas mm": lambda: torch.mm(x, w.t(), out=p),
            "stored stats": lambda: kernels.stored_logits(p, None, t, softcap=cap, tile_m=tm, tile_s=ts, zt=zt),
            "target logits": lambda: kernels.target_logits(x, w, None, t, zt, softcap=cap),
            "stored grad": lambda: kernels.stored_logits(p, None, t, softcap=cap, rows=rows, coef=coef),
        }
        for rnd in range(3):
            for k, fn in comps.items():
                res.setdefault((cap, k), []).append(bench(fn))
    print(f"## {name} C={C} D={D} V={V} (ms per call, median of 3 rounds of 10)")
    for (cap, k), v in res.items():
        print(f"  softcap={cap}  {k:18s} {statistics.median(v):7.3f}   ({' '.join(f'{x:.3f}' for x in v)})")
    gb = C * V * 2 / 1e9
    for cap in (None, 30.0):
        m = lambda k: statistics.median(res[(cap, k)])
        old = m("fused stats+P") + m("probs_to_grad")
        new = m("cublas mm") + m("stored stats") + m("target logits") + m("stored grad")
        print(f"  softcap={cap}: old {old:.3f} ms, new {new:.3f} ms; stats pass {gb / m('stored stats') * 1e3:.0f} GB/s, "
              f"grad pass {2 * gb / m('stored grad') * 1e3:.0f} GB/s, p2g {2 * gb / m('probs_to_grad') * 1e3:.0f} GB/s")
    del x, w, p; torch.cuda.empty_cache()

# host side: one Llama step's Python, with the GPU busy sleeping so nothing waits
N, D, V = 16384, 4096, 128256
x = torch.randn(N, D, device=dev).bfloat16().requires_grad_()
w = (torch.randn(V, D, device=dev) / 64).bfloat16().requires_grad_()
y = torch.randint(0, V, (N,), device=dev)
def step():
    x.grad = None; w.grad = None
    vpce.linear_cross_entropy(x, w, y).backward()
for _ in range(3): step()
torch.cuda.synchronize()
pr = cProfile.Profile()
for _ in range(5):
    torch.cuda._sleep(int(4e8))
    pr.enable(); step(); pr.disable()
    torch.cuda.synchronize()
s = io.StringIO(); st = pstats.Stats(pr, stream=s); st.sort_stats("tottime").print_stats(25)
st.sort_stats("cumulative").print_stats(30)
print(s.getvalue()[-12000:])
