"""Session 12: where the distillation losses' -8e-6 relative bias against float64 comes from (#17): the logits'
rounding to bf16, or cuBLAS's tensor-core GEMM? Session 10's inputs (jsd_err.py), N=4096, D=4096, D_T=8192,
V=128256; each divergence computed in float64 from logits made several ways."""
import math, torch
from vpce.bench.peers import divergence_per_token
dev, bf = "cuda", torch.bfloat16
n, d, dt, v = 4096, 4096, 8192, 128256
B = torch.backends.cuda.matmul

def loss64(zs, zt, div, beta):
    out = 0.0
    for r in range(0, n, 1024):
        s, u = torch.log_softmax(zs[r:r + 1024].double(), -1), torch.log_softmax(zt[r:r + 1024].double(), -1)
        out += divergence_per_token(s, u, div, beta).sum().item()
    return out / n

def slope(z, z64):  # least-squares scale of z against the exact logits, minus 1
    z = z.double()
    return ((z * z64).sum() / (z64 * z64).sum()).item() - 1

for seed in range(3):
    g = torch.Generator(device=dev).manual_seed(seed)
    x = torch.randn(n, d, device=dev, generator=g).to(bf)
    w = (torch.randn(v, d, device=dev, generator=g) / math.sqrt(d)).to(bf)
    xt = torch.randn(n, dt, device=dev, generator=g).to(bf)
    wt = (torch.randn(v, dt, device=dev, generator=g) / math.sqrt(dt)).to(bf)
    ex = (x.double() @ w.double().T, xt.double() @ wt.double().T)
    made = {"exact (fp64 GEMM)": ex,
            "exact rounded to bf16": tuple(z.to(bf) for z in ex),
            "cuBLAS fp32 out": (torch.mm(x, w.T, out_dtype=torch.float32), torch.mm(xt, wt.T, out_dtype=torch.float32))}
    made["cuBLAS fp32 out rounded to bf16"] = tuple(z.to(bf) for z in made["cuBLAS fp32 out"])
    made["cuBLAS bf16 out (F.linear)"] = (x @ w.T, xt @ wt.T)
    flag = B.allow_bf16_reduced_precision_reduction
    B.allow_bf16_reduced_precision_reduction = False
    made["cuBLAS bf16 out, no reduced-precision reduction"] = (x @ w.T, xt @ wt.T)
    B.allow_bf16_reduced_precision_reduction = flag
    made["student cuBLAS bf16, teacher exact"] = (made["cuBLAS bf16 out (F.linear)"][0], ex[1])
    made["student exact, teacher cuBLAS bf16"] = (ex[0], made["cuBLAS bf16 out (F.linear)"][1])
    for div, beta in (("jsd", 0.5), ("forward_kl", None)):
        ref = loss64(*ex, div, beta)
        for name, (zs, zt) in made.items():
            l = loss64(zs, zt, div, beta)
            sl = f"  logits' scale - 1: student {slope(zs, ex[0]):+.2e} teacher {slope(zt, ex[1]):+.2e}" if div == "jsd" else ""
            print(f"seed {seed} {div:10s} {name:48s} signed rel err {(l - ref) / abs(ref):+.2e}{sl}", flush=True)
    del made, ex
