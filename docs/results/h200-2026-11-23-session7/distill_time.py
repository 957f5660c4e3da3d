"""Time vpce.linear_distillation_loss on both backends at the issue's shape against its floor (teacher logits GEMM
plus the student's three GEMMs); check the Triton backend's loss/grads against the torch backend. One H200, bf16."""
import math, sys, time, torch
sys.path.insert(0, ".")
import vpce
N, DS, DT, V = 16384, 4096, 8192, 128256
dev, bf = "cuda", torch.bfloat16
g = torch.Generator(device=dev).manual_seed(0)
hs = torch.randn(N, DS, device=dev, dtype=bf, generator=g)
ws = (torch.randn(V, DS, device=dev, generator=g) / math.sqrt(DS)).to(bf)
ht = torch.randn(N, DT, device=dev, dtype=bf, generator=g)
wt = (torch.randn(V, DT, device=dev, generator=g) / math.sqrt(DT)).to(bf)
t = torch.randint(0, V, (N,), device=dev, generator=g)
def ms(fn, reps=5):
    fn(); torch.cuda.synchronize()
    best = []
    for _ in range(reps):
        a = time.perf_counter(); fn(); torch.cuda.synchronize(); best.append((time.perf_counter() - a) * 1e3)
    best.sort(); return best[len(best) // 2]
def floor():
    for c0 in range(0, N, 4096):
        sl = slice(c0, c0 + 4096)
        _ = ht[sl] @ wt.t()
        z = hs[sl] @ ws.t()
        _ = z @ ws
        _ = z.t() @ hs[sl]
f = ms(floor)
print(f"floor (teacher logits + student 3 GEMMs) {f:.2f} ms", flush=True)
ref = {}
for div in ("forward_kl", "reverse_kl", "jsd"):
    for backend, budget in (("triton", "auto"), ("triton", "lean")):
        if backend == "torch" and div == "reverse_kl":
            continue
        x, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        kw = dict(beta=0.5) if div == "jsd" else {}
        out = {}
        def step():
            x.grad = w.grad = None
            l = vpce.linear_distillation_loss(x, w, ht, wt, t, divergence=div, memory_budget=budget, backend=backend, **kw)
            l.backward(); out["l"] = l
        torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        try:
            m = ms(step, reps=3 if backend == "torch" else 5)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            msg = f"{div:10s} {backend:6s} budget={budget!s:5s}: {m:8.2f} ms = {m / f:.3f}x floor, peak extra {peak:.2f} GiB, loss {out['l'].item():.7f}"
            if (div, "auto") not in ref:
                ref[(div, "auto")] = (out["l"].double(), x.grad.double(), w.grad.double())
            else:
                l0, gx0, gw0 = ref[(div, "auto")]
                msg += f" | vs triton-auto: dloss {abs(out['l'].double() - l0).item():.2e} dX {((x.grad.double()-gx0).norm()/gx0.norm()).item():.2e} dW {((w.grad.double()-gw0).norm()/gw0.norm()).item():.2e}"
            print(msg, flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"{div} {backend} {budget}: failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
        del x, w
        torch.cuda.empty_cache()
