"""Session 13 probe (#17): cuBLAS logits computed in K runs (the second run added to the first's rounded result
by addmm's beta=1 epilogue) -- does a shorter accumulation run cut the logits' shrink and the loss bias, at what
cost in time and in per-logit noise?"""
import math, sys, time, torch
from vpce.bench.peers import divergence_per_token
dev, bf = "cuda", torch.bfloat16
n, d, dt, v = 4096, 4096, 8192, 128256

def runs_mm(h, w, runs, inter=bf):
    k = h.shape[1]; s = k // runs
    if inter == bf:
        out = torch.mm(h[:, :s], w[:, :s].t())
        for r in range(1, runs):
            out.addmm_(h[:, r * s:(r + 1) * s], w[:, r * s:(r + 1) * s].t())
        return out
    out = torch.mm(h[:, :s], w[:, :s].t(), out_dtype=torch.float32)
    for r in range(1, runs):
        torch.addmm(out, h[:, r * s:(r + 1) * s], w[:, r * s:(r + 1) * s].t(), out_dtype=torch.float32, out=out)
    return out.to(bf)

def loss64(zs, zt, div, beta):
    out = 0.0
    for r in range(0, n, 1024):
        s, u = torch.log_softmax(zs[r:r + 1024].double(), -1), torch.log_softmax(zt[r:r + 1024].double(), -1)
        out += divergence_per_token(s, u, div, beta).sum().item()
    return out / n

def slope(z, z64):
    z = z.double()
    return ((z * z64).sum() / (z64 * z64).sum()).item() - 1

def rms(z, z64):
    return ((z.double() - z64).norm() / z64.norm()).item()

part = sys.argv[1]
if part == "err":
    for seed in range(2):
        g = torch.Generator(device=dev).manual_seed(seed)
        x = torch.randn(n, d, device=dev, generator=g).to(bf)
        w = (torch.randn(v, d, device=dev, generator=g) / math.sqrt(d)).to(bf)
        xt = torch.randn(n, dt, device=dev, generator=g).to(bf)
        wt = (torch.randn(v, dt, device=dev, generator=g) / math.sqrt(dt)).to(bf)
        ex = (x.double() @ w.double().T, xt.double() @ wt.double().T)
        made = {"F.linear both (today)": (x @ w.T, xt @ wt.T),
                "exact rounded to bf16": tuple(z.to(bf) for z in ex),
                "teacher 2 runs, bf16 between": (x @ w.T, runs_mm(xt, wt, 2)),
                "teacher 2 runs, fp32 between": (x @ w.T, runs_mm(xt, wt, 2, torch.float32)),
                "teacher 4 runs, bf16 between": (x @ w.T, runs_mm(xt, wt, 4)),
                "student 2 + teacher 2 runs, bf16": (runs_mm(x, w, 2), runs_mm(xt, wt, 2)),
                "student 2 + teacher 4 runs, bf16": (runs_mm(x, w, 2), runs_mm(xt, wt, 4)),
                "student 2 + teacher 4 runs, fp32": (runs_mm(x, w, 2, torch.float32), runs_mm(xt, wt, 4, torch.float32))}
        for name, (zs, zt) in made.items():
            print(f"seed {seed} {name:36s} scale-1 s {slope(zs, ex[0]):+.2e} t {slope(zt, ex[1]):+.2e}  "
                  f"rms s {rms(zs, ex[0]):.3e} t {rms(zt, ex[1]):.3e}", flush=True)
        for div, beta in (("jsd", 0.5), ("forward_kl", None), ("reverse_kl", None)):
            ref = loss64(*ex, div, beta)
            for name, (zs, zt) in made.items():
                l = loss64(zs, zt, div, beta)
                print(f"seed {seed} {div:10s} {name:36s} signed rel err {(l - ref) / abs(ref):+.2e}", flush=True)
        del made, ex
elif part == "time":
    c = 3072
    for k in (4096, 8192):
        h = torch.randn(c, k, device=dev).to(bf)
        w = (torch.randn(v, k, device=dev) / math.sqrt(k)).to(bf)
        out = torch.empty(c, v, device=dev, dtype=bf)
        def full():
            torch.mm(h, w.t(), out=out)
        def split(runs):
            s = k // runs
            def f():
                torch.mm(h[:, :s], w[:, :s].t(), out=out)
                for r in range(1, runs):
                    out.addmm_(h[:, r * s:(r + 1) * s], w[:, r * s:(r + 1) * s].t())
            return f
        fns = {"full": full, "2 runs": split(2), "4 runs": split(4)}
        ms = {name: [] for name in fns}
        for f in fns.values():
            for _ in range(3): f()
        torch.cuda.synchronize()
        for rnd in range(5):
            for name, f in fns.items():
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(10): f()
                b.record(); torch.cuda.synchronize()
                ms[name].append(a.elapsed_time(b) / 10)
        for name, t in ms.items():
            t.sort()
            print(f"K={k} chunk {c}x{v}: {name:7s} median {t[2]:.3f} ms  min {t[0]:.3f}  max {t[-1]:.3f}", flush=True)
