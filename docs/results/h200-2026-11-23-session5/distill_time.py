"""Time vpce.linear_distillation_loss (torch backend on CUDA) at the issue's shape against its floor: the teacher's
logits GEMM plus the student's three GEMMs. One H200, bf16."""
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
def ms(fn, reps=3):
    fn(); torch.cuda.synchronize()
    a = time.perf_counter()
    for _ in range(reps): fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - a) / reps * 1e3
# floor: teacher logits + student logits, dX, dW (cuBLAS, bf16 out), the logits in 4 slices to bound memory
def floor():
    for c0 in range(0, N, 4096):
        sl = slice(c0, c0 + 4096)
        _ = ht[sl] @ wt.t()
        z = hs[sl] @ ws.t()
        _ = z @ ws
        _ = z.t() @ hs[sl]
f = ms(floor)
print(f"floor (teacher logits + student 3 GEMMs) {f:.1f} ms")
for div in ("forward_kl", "jsd"):
    for budget in ("auto", 2.0):
        x, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
        def step():
            x.grad = w.grad = None
            kw = dict(beta=0.5) if div == "jsd" else {}
            vpce.linear_distillation_loss(x, w, ht, wt, t, divergence=div, memory_budget=budget, **kw).backward()
        torch.cuda.reset_peak_memory_stats(); base = torch.cuda.memory_allocated()
        try:
            m = ms(step, reps=2)
            peak = (torch.cuda.max_memory_allocated() - base) / 2**30
            print(f"{div:10s} memory_budget={budget!s:5s}: {m:9.1f} ms = {m / f:.2f}x floor, peak extra {peak:.2f} GiB")
        except Exception as e:  # noqa: BLE001
            print(f"{div} {budget}: failed: {type(e).__name__}: {str(e)[:200]}")
