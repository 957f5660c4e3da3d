"""Probe (twelfth session): can the gradient pass (bandwidth-bound, in place over bf16 P) run beside a quack GEMM
on a few SMs, as a persistent grid of K programs on a high-priority side stream, so that the GEMM (dynamic
persistent scheduler) loses only K SMs while it runs?  One GPU, tp=2 chunk shapes of the Llama-3-8B head.

    python ov.py
"""
import statistics
import sys

import torch
import triton
import triton.language as tl

from vpce import kernels
from vpce.gemm import logits_with_stats, scaled_weight_grad, _quack, _config, DX_TILE

LOG2E = 1.4426950408889634


@triton.jit
def grad_kernel(P, LSE, T, A, M, V, stride, BM: tl.constexpr, BN: tl.constexpr, NPROG: tl.constexpr):
    """g = a * exp(z - lse) - a [col == t], in place; persistent: program i takes tiles i, i + NPROG, ...,
    the next tile's load issued before the current one is stored."""
    pid = tl.program_id(0)
    ncol = tl.cdiv(V, BN)
    total = tl.cdiv(M, BM) * ncol
    tile = pid
    rm = (tile // ncol) * BM + tl.arange(0, BM)
    rn = (tile % ncol) * BN + tl.arange(0, BN)
    msk = (rm < M)[:, None] & (rn < V)[None, :]
    offs = rm.to(tl.int64)[:, None] * stride + rn[None, :]
    cur = tl.load(P + offs, mask=msk, other=0.0)  # a tile past the last has rows >= M: masked
    for _ in range(pid, total, NPROG):
        nt = tile + NPROG
        nrm = (nt // ncol) * BM + tl.arange(0, BM)
        nrn = (nt % ncol) * BN + tl.arange(0, BN)
        nmsk = (nrm < M)[:, None] & (nrn < V)[None, :]
        noffs = nrm.to(tl.int64)[:, None] * stride + nrn[None, :]
        nxt = tl.load(P + noffs, mask=nmsk, other=0.0)
        lse = tl.load(LSE + rm, mask=rm < M, other=0.0)
        a = tl.load(A + rm, mask=rm < M, other=0.0)
        t = tl.load(T + rm, mask=rm < M, other=-1)
        g = tl.exp2((cur.to(tl.float32) - lse[:, None]) * 1.4426950408889634) * a[:, None]
        g = tl.where(rn[None, :] == t[:, None], g - a[:, None], g)
        tl.store(P + offs, g.to(P.dtype.element_ty), mask=msk)
        cur, tile, rm, rn, msk, offs = nxt, nt, nrm, nrn, nmsk, noffs


@triton.jit
def grad_plain(P, LSE, T, A, M, V, stride, BM: tl.constexpr, BN: tl.constexpr, NPROG: tl.constexpr,
               STAGES: tl.constexpr):
    pid = tl.program_id(0)
    ncol = tl.cdiv(V, BN)
    total = tl.cdiv(M, BM) * ncol
    for tile in tl.range(pid, total, NPROG, num_stages=STAGES):
        rm = (tile // ncol) * BM + tl.arange(0, BM)
        rn = (tile % ncol) * BN + tl.arange(0, BN)
        msk = (rm < M)[:, None] & (rn < V)[None, :]
        offs = rm.to(tl.int64)[:, None] * stride + rn[None, :]
        cur = tl.load(P + offs, mask=msk, other=0.0)
        lse = tl.load(LSE + rm, mask=rm < M, other=0.0)
        a = tl.load(A + rm, mask=rm < M, other=0.0)
        t = tl.load(T + rm, mask=rm < M, other=-1)
        g = tl.exp2((cur.to(tl.float32) - lse[:, None]) * 1.4426950408889634) * a[:, None]
        g = tl.where(rn[None, :] == t[:, None], g - a[:, None], g)
        tl.store(P + offs, g.to(P.dtype.element_ty), mask=msk)


def grad(p, lse, t, a, K, BM, BN, W, kind="pre"):
    m, v = p.shape
    grid = K if K > 0 else triton.cdiv(m, BM) * triton.cdiv(v, BN)
    if kind == "pre":
        grad_kernel[(grid,)](p, lse, t, a, m, v, p.stride(0), BM=BM, BN=BN, NPROG=grid, num_warps=W)
    else:
        grad_plain[(grid,)](p, lse, t, a, m, v, p.stride(0), BM=BM, BN=BN, NPROG=grid, num_warps=W,
                            STAGES=int(kind[-1]))


def med(fn, reps=12):
    ts = []
    for _ in range(reps + 2):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        torch.cuda._sleep(2000000)
        s.record(); fn(); e.record(); torch.cuda.synchronize()
        ts.append(s.elapsed_time(e))
    return statistics.median(ts[2:])


dev = torch.device("cuda")
n, d, v = 8192, 4096, 64128
torch.manual_seed(0)
h = (torch.randn(n, d, device=dev) * 0.5).to(torch.bfloat16)
w = (torch.randn(v, d, device=dev) * 0.02).to(torch.bfloat16)
t = torch.randint(0, v, (n,), device=dev, dtype=torch.int32)
zt = torch.empty(n, device=dev)
p1 = torch.empty(n, v, dtype=torch.bfloat16, device=dev)  # the GEMM's output
p2 = torch.randn(n, v, device=dev).to(torch.bfloat16)    # the gradient pass's buffer (another chunk)
lse = torch.full((n,), 12.0, device=dev)
a = torch.full((n,), 1.0 / n, device=dev)
side = torch.cuda.Stream(priority=-1)
print(torch.cuda.get_device_name(), torch.__version__, triton.__version__, flush=True)

gemms = {
    "stats": lambda: logits_with_stats(p1, h, w, t, zt),
    "dw": lambda: scaled_weight_grad(None, p1, h, torch.ones((), device=dev), torch.bfloat16),
}
dx32 = torch.empty(n, d, device=dev)
gemms["dx32"] = lambda: _quack().gemm_tuned.fn(p1, w, dx32, config=_config(DX_TILE))
gemms["cublas_dx32"] = lambda: torch.mm(p1, w, out_dtype=torch.float32)
for k, f in gemms.items():
    f()
torch.cuda.synchronize()
alone = {k: med(f) for k, f in gemms.items()}
print("GEMM alone:", " ".join(f"{k} {x:.3f}" for k, x in alone.items()), flush=True)
# vpce's own gradient pass (two halves as at tp=2) for reference
rows = (torch.zeros(n, device=dev), lse, torch.ones(n, device=dev))
coef = (a, None, a, None)
half = n // 2
def vgrad():
    for r in (slice(0, half), slice(half, n)):
        kernels.stored_logits(p2[r], None, t[r], rows=tuple(x[r] for x in rows), coef=(a[r], None, a[r], None))
vgrad()
print(f"vpce stored_logits grad, two halves: {med(vgrad):.3f} ms", flush=True)

configs = [(0, 64, 256, 16, "pre")]
for K in (16, 24, 32, 48):
    for BM, BN, W in ((64, 256, 16), (32, 512, 16)):
        configs.append((K, BM, BN, W, "pre"))
for K in (24, 32):
    configs += [(K, 64, 256, 16, "st1"), (K, 64, 256, 16, "st3")]
for K, BM, BN, W, kind in configs:
    g = lambda: grad(p2, lse, t, a, K, BM, BN, W, kind)
    g()
    line = f"K={K:3d} BM={BM:3d} BN={BN} W={W:2d} {kind}: alone {med(g):.3f} ms"
    for name in ("stats", "dw", "dx32"):
        f = gemms[name]

        def both():
            ev = torch.cuda.current_stream().record_event()
            side.wait_event(ev)
            with torch.cuda.stream(side):
                g()
            f()
            torch.cuda.current_stream().wait_stream(side)

        def serial():
            g()
            f()
        both(); serial()
        b, sr = [], []
        for _ in range(3):
            b.append(med(both, 5)); sr.append(med(serial, 5))
        b, sr = statistics.median(b), statistics.median(sr)
        line += f" | {name} {b:.3f} serial {sr:.3f} ({sr - b:+.3f})"
    print(line, flush=True)
