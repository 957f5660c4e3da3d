"""Distillation kernels on one chunk: tile shapes/warps sweep per kernel, and a per-kernel profile of whole steps."""
import math, sys, torch, triton
from collections import defaultdict
sys.path.insert(0, ".")
import vpce
from vpce import kernels
from vpce.distill import DistillRows
dev, bf = "cuda", torch.bfloat16
ms = lambda fn: triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")
orig = kernels._distill_blocks
CFGS = [(16, 256, 8), (16, 256, 4), (8, 256, 4), (8, 512, 4), (8, 512, 8), (16, 512, 8), (32, 256, 8), (4, 1024, 4),
        (4, 512, 4), (2, 1024, 4), (1, 2048, 4), (1, 4096, 8)]
for C, V in ((2048, 128256), (2048, 256000)):
    g = torch.Generator(device=dev).manual_seed(0)
    z0 = (torch.randn(C, V, device=dev, generator=g) * 3).to(bf)
    y = (torch.randn(C, V, device=dev, generator=g) * 3).to(bf)
    z = z0.clone()
    t = torch.randint(0, V, (C,), device=dev, dtype=torch.int32, generator=g)
    gb = C * V * 2 / 1e9
    rows = DistillRows(*(torch.zeros(C, device=dev) for _ in range(4)), torch.zeros(C, device=dev), None, None, None)
    kd = torch.ones(C, device=dev)
    print(f"## C={C} V={V}: one bf16 buffer {gb:.2f} GB", flush=True)
    for cfg in CFGS:
        kernels._distill_blocks = lambda x, cfg=cfg: cfg
        out = []
        for name, nbuf, fn in (
            ("stats fkl", 2, lambda: kernels.distill_stats(z, y, t, torch.empty(5, C, device=dev), kl=1, ce=False, softcap=None, t_softcap=None, inv_t=1.0)),
            ("stats jsd", 2, lambda: kernels.distill_stats(z, y, t, torch.empty(4, C, device=dev), kl=0, ce=False, softcap=None, t_softcap=None, inv_t=1.0)),
            ("mixture", 2, lambda: kernels.distill_mixture(z, y, rows.m_z, rows.log_s_z, rows.m_y, rows.log_s_y, beta=0.5, softcap=None, t_softcap=None, inv_t=1.0)),
            ("grad fkl", 3, lambda: kernels.distill_grad_(z, y, z, t, rows, kd, None, kind=0, beta=0.5, softcap=None, t_softcap=None, inv_t=1.0)),
            ("grad jsd", 3, lambda: kernels.distill_grad_(z, y, z, t, rows, kd, None, kind=2, beta=0.5, softcap=None, t_softcap=None, inv_t=1.0)),
        ):
            try:
                t_ms = ms(fn)
                out.append(f"{name} {t_ms:6.3f} ms {nbuf * gb / t_ms:5.2f} TB/s")
            except Exception as e:
                out.append(f"{name} failed {type(e).__name__}")
        print(f"  {cfg}: " + " | ".join(out), flush=True)
    kernels._distill_blocks = orig
    del z0, y, z
    torch.cuda.empty_cache()

# whole steps under the profiler (default blocks), issue shape
N, DS, DT, V = 16384, 4096, 8192, 128256
g = torch.Generator(device=dev).manual_seed(0)
hs = torch.randn(N, DS, device=dev, dtype=bf, generator=g)
ws = (torch.randn(V, DS, device=dev, generator=g) / math.sqrt(DS)).to(bf)
ht = torch.randn(N, DT, device=dev, dtype=bf, generator=g)
wt = (torch.randn(V, DT, device=dev, generator=g) / math.sqrt(DT)).to(bf)
tt = torch.randint(0, V, (N,), device=dev, generator=g)
for div in ("forward_kl", "jsd"):
    x, w = hs.clone().requires_grad_(), ws.clone().requires_grad_()
    def step():
        x.grad = w.grad = None
        vpce.linear_distillation_loss(x, w, ht, wt, tt, divergence=div, backend="triton").backward()
    step(); step(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    agg = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            a = agg[e.name[:90]]; a[0] += 1; a[1] += e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total
    tot = sum(v[1] for v in agg.values()) / 3 / 1e3
    print(f"## profile {div}: kernel time {tot:.2f} ms/step", flush=True)
    for k, v in sorted(agg.items(), key=lambda kv: -kv[1][1])[:14]:
        print(f"  {v[1] / 3 / 1e3:8.3f} ms  {v[0] // 3:4d}x  {k}")
    del x, w
