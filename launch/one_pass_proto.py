"""Prototype for measurement, not part of the package: the fast route's two bandwidth passes (statistics, then the
gradient in place) as one pass per row, for a single process (no exchange sits between the two halves).

    python launch/one_pass_proto.py [--shapes llama3-8b,gemma2-2b] [--chunk 4096]   # one GPU
    TRITON_INTERPRET=1 python launch/one_pass_proto.py --check-only                 # CPU: correctness only

The idea ("what would close the gap" in docs/benchmarks.md): one program per row reads the
row's stored logits once for the online max / sum of exp (the target left out: its exact logit comes from
``kernels.target_logits``), combines them with the target, and then walks the row again from its end, so the
tiles it read last are re-read from L2 rather than from HBM, writing the gradient in place. A Llama-3-8B row is
256 KB (one program per SM: 33 MB in flight, under the 50 MB L2), a Gemma-2-2B row 512 KB (not all of it fits).
Plain cross-entropy only, at unit upstream scale (``a = 1, c = -1``); the variants (z-loss: ``a`` affine in
``lse``; smoothing: a constant ``d``; soft cap: ``dcap``) would add per-element work the two-pass kernels already
do. It prints the time of each form and checks that both give the same gradient bits.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vpce import kernels  # noqa: E402
from vpce.formulas.softmax import ce_coefficients  # noqa: E402
from vpce.options import LossOptions  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
SHAPES = {"llama3-8b": (4096, 128256), "gemma2-2b": (2304, 256000)}


@triton.jit
def _one_pass_kernel(L, TL, ZT, OUT_M, OUT_LSE, OUT_Q, V, stride_l, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(TL + row)
    zt = tl.load(ZT + row)
    base = L + row * stride_l
    cols = tl.arange(0, BLOCK_N)
    n_blocks = tl.cdiv(V, BLOCK_N)
    # pass 1: online max and sum of exp over every column but the target's
    m = tl.full([], float("-inf"), tl.float32)
    s = tl.zeros([], tl.float32)
    for i in range(0, n_blocks):
        c = i * BLOCK_N + cols
        z = tl.load(base + c, mask=c < V, other=float("-inf")).to(tl.float32)
        z = tl.where(c == t, float("-inf"), z)
        m_new = tl.maximum(m, tl.max(z, axis=0))
        safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - safe) + tl.sum(tl.exp(z - safe), axis=0)
        m = m_new
    big = tl.maximum(m, zt)
    safe = tl.where(big == float("-inf"), 0.0, big)
    x = s * tl.exp(m - safe)
    total = x + tl.exp(zt - safe)
    lse = safe + tl.log(total)
    q = x / total
    tl.store(OUT_M + row, big)
    tl.store(OUT_LSE + row, lse)
    tl.store(OUT_Q + row, q)
    # pass 2, from the row's end (its last tiles are still in L2): dL/dz = p off the target, -(1 - p_t) = -q at it
    for j in range(0, n_blocks):
        c = (n_blocks - 1 - j) * BLOCK_N + cols
        z = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
        g = tl.where(c == t, -q, tl.exp(z - lse))
        tl.store(base + c, g.to(L.dtype.element_ty), mask=c < V)


def one_pass_(logits, t_local, zt, block_n=4096, num_warps=8):
    """Statistics and the plain cross-entropy's gradient (unit scale) in one launch, one program per row."""
    c, v = logits.shape
    f32 = dict(dtype=torch.float32, device=logits.device)
    m, lse, q = torch.empty(c, **f32), torch.empty(c, **f32), torch.empty(c, **f32)
    _one_pass_kernel[(c,)](logits, t_local, zt, m, lse, q, v, logits.stride(0), BLOCK_N=block_n,
                           num_warps=num_warps)
    return m, lse, q


def two_pass_(logits, t_local, zt):
    """What the fast route runs today at tp=1: stats pass, tile reduction, combine, coefficients, grad pass."""
    c, v = logits.shape
    bn = kernels.tile_n(logits)
    nt = triton.cdiv(v, bn)
    f32 = dict(dtype=torch.float32, device=logits.device)
    tm, ts = torch.empty(c, nt, **f32), torch.empty(c, nt, **f32)
    kernels.stored_logits(logits, None, t_local, tile_m=tm, tile_s=ts, zt=zt)  # zt: target_logits', given
    st = kernels.combine_rank_stats(kernels.reduce_tiles(tm, ts, None, None, zt).unsqueeze(0), 0)
    co = ce_coefficients(torch.ones(c, **f32), st.lse, LossOptions(), v)
    kernels.stored_logits(logits, None, t_local, rows=(st.m, st.lse, st.q), coef=co)
    return st.m, st.lse, st.q


def check(c, d, v, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(c, d, generator=g, device=device).to(dtype)
    w = (torch.randn(v, d, generator=g, device=device) / math.sqrt(d)).to(dtype)
    t = torch.randint(0, v, (c,), generator=g, device=device).to(torch.int32)
    t[::7] = -1  # target in another shard (or ignored): no target column here
    a = torch.mm(x, w.t())
    b = a.clone()
    zt = torch.empty(c, dtype=torch.float32, device=device)
    kernels.target_logits(x, w, None, t, zt)
    one = one_pass_(a, t, zt, block_n=64 if INTERPRET else 4096, num_warps=4 if INTERPRET else 8)
    two = two_pass_(b, t, zt.clone())
    err = (a.double() - b.double()).abs().max().item()
    scale = b.double().abs().max().item()
    lse_err = (one[1] - two[1]).abs().max().item()
    print(f"check C={c} D={d} V={v} {dtype}: max |grad one - two| = {err:.3e} (max |grad| {scale:.3e}), "
          f"max |lse one - two| = {lse_err:.3e}")
    tol = 4 * torch.finfo(dtype).eps * scale
    assert err <= tol and lse_err <= 1e-5 * max(1.0, two[1].abs().max().item()), (err, tol, lse_err)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama3-8b,gemma2-2b")
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--check-only", action="store_true")
    args = ap.parse_args()
    device = "cpu" if INTERPRET else "cuda"
    check(37, 24, 301, torch.float32, device)
    if args.check_only:
        return
    check(1000, 512, 50000, torch.bfloat16, device)
    for name in args.shapes.split(","):
        d, v = SHAPES[name]
        c = args.chunk
        x = torch.randn(c, d, device=device, dtype=torch.bfloat16)
        w = (torch.randn(v, d, device=device) / math.sqrt(d)).to(torch.bfloat16)
        t = torch.randint(0, v, (c,), device=device, dtype=torch.int32)
        logits = torch.mm(x, w.t())
        zt = torch.empty(c, dtype=torch.float32, device=device)
        kernels.target_logits(x, w, None, t, zt)
        gb = logits.numel() * 2 / 1e9
        ms = lambda fn: triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")  # noqa: E731
        t2 = ms(lambda: two_pass_(logits, t, zt))
        print(f"## {name}: chunk C={c}, V={v} ({gb:.2f} GB of bf16 logits)")
        print(f"  two passes (today)   {t2:7.3f} ms  ({3 * gb / t2 * 1e3:6.0f} GB/s for 3 x the logits)")
        for bn, nw in ((2048, 4), (2048, 8), (4096, 8), (8192, 8), (8192, 16)):
            t1 = ms(lambda: one_pass_(logits, t, zt, block_n=bn, num_warps=nw))
            print(f"  one pass BLOCK_N={bn:5d} warps={nw:2d} {t1:7.3f} ms  ({3 * gb / t1 * 1e3:6.0f} GB/s for 3 x)")


if __name__ == "__main__":
    main()
