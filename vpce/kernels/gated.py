"""One-pass scaling, and the speculative route's gated kernels.

``scale_cast`` scales an fp32 accumulator by a one-element factor and casts it (the fast route's backward).

For the speculative route (``vpce.speculation``): ``row_scale_cast`` scales each row of an fp32 ``[N, D]`` by its
token's upstream gradient and casts it; ``gated_weight_grad_`` is a small GEMM ``dW += P^T X`` (and ``db``) that,
like ``logits_tiles`` given a ``flag``, first reads a device flag and does nothing when it is 0, so that a
recompute the host cannot know is needed costs only its launches when it is not.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, _persistent
from .launch import first_launch

__all__ = ["scale_cast", "row_scale_cast", "gated_weight_grad_", "gated_scale_"]


@first_launch
@triton.jit
def _scale_cast_kernel(SRC, DST, G, numel, BLOCK: tl.constexpr):
    """``DST = (SRC * G[0]).to(DST.dtype)``, the product in fp32: one pass (``DST`` may be ``SRC``)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G)
    x = tl.load(SRC + offs, mask=mask, other=0.0)
    tl.store(DST + offs, (x * g).to(DST.dtype.element_ty), mask=mask)


@first_launch
@triton.jit
def _row_scale_cast_kernel(SRC, DST, G, N, D, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """``DST[i] = (SRC[i] * G[i]).to(DST.dtype)``: one pass over a contiguous fp32 ``[N, D]``."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok = rm < N
    mask = row_ok[:, None] & (rd < D)[None, :]
    offs = rm.to(tl.int64)[:, None] * D + rd[None, :]
    g = tl.load(G + rm, mask=row_ok, other=0.0)
    x = tl.load(SRC + offs, mask=mask, other=0.0)
    tl.store(DST + offs, (x * g[:, None]).to(DST.dtype.element_ty), mask=mask)


@triton.jit
def _weight_grad_tile(pid_v, pid_d, P, X, DW, DB, K, V, D, stride_pk, stride_pv, stride_xk, stride_xd, stride_wv,
                      stride_wd, HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, IEEE: tl.constexpr,
                      BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    """One ``[BLOCK_V, BLOCK_D]`` tile of ``_gated_weight_grad_kernel`` (and, at ``pid_d == 0``, its ``DB``)."""
    rv = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    rd = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    rk = tl.arange(0, BLOCK_K)
    v_ok = rv < V
    d_ok = rd < D
    p_ptrs = P + rk.to(tl.int64)[:, None] * stride_pk + rv.to(tl.int64)[None, :] * stride_pv
    x_ptrs = X + rk.to(tl.int64)[:, None] * stride_xk + rd.to(tl.int64)[None, :] * stride_xd
    acc = tl.zeros((BLOCK_V, BLOCK_D), dtype=tl.float32)
    col = tl.zeros((BLOCK_V,), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk < K - k * BLOCK_K
        a = tl.load(p_ptrs, mask=k_ok[:, None] & v_ok[None, :], other=0.0)
        if HAS_DW:
            b = tl.load(x_ptrs, mask=k_ok[:, None] & d_ok[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(tl.trans(a), b, acc, input_precision="ieee")
            else:
                acc = tl.dot(tl.trans(a), b, acc)
        if HAS_DB:
            col += tl.sum(a.to(tl.float32), axis=0)
        p_ptrs += BLOCK_K * stride_pk
        x_ptrs += BLOCK_K * stride_xk
    if HAS_DW:
        offs = rv.to(tl.int64)[:, None] * stride_wv + rd.to(tl.int64)[None, :] * stride_wd
        mask = v_ok[:, None] & d_ok[None, :]
        tl.store(DW + offs, tl.load(DW + offs, mask=mask, other=0.0) + acc, mask=mask)
    if HAS_DB:
        if pid_d == 0:  # one owner per column block
            tl.store(DB + rv, tl.load(DB + rv, mask=v_ok, other=0.0) + col, mask=v_ok)


@first_launch
@triton.jit
def _gated_weight_grad_kernel(
    # pointers
    P, X, DW, DB, FLAG,
    # shapes
    K, V, D,
    # strides
    stride_pk, stride_pv, stride_xk, stride_xd, stride_wv, stride_wd,
    # meta
    HAS_DW: tl.constexpr, HAS_DB: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """``DW [V, D] += P^T X`` and ``DB [V] += sum_k P[k]`` (fp32, in place) for one token block ``P [K, V]``,
    ``X [K, D]``, only where ``FLAG[0] != 0`` (else every program returns at once). A persistent grid: program
    ``pid`` takes the output tiles ``pid, pid + grid, ...``; each tile belongs to one program, which sums over all
    ``K`` in order: deterministic, no atomics."""
    if tl.load(FLAG) != 0:
        num_d = tl.cdiv(D, BLOCK_D)
        for t in range(tl.program_id(0), tl.cdiv(V, BLOCK_V) * num_d, tl.num_programs(0)):
            _weight_grad_tile(t // num_d, t % num_d, P, X, DW, DB, K, V, D, stride_pk, stride_pv, stride_xk,
                              stride_xd, stride_wv, stride_wd, HAS_DW, HAS_DB, IEEE, BLOCK_V, BLOCK_D, BLOCK_K)


@first_launch
@triton.jit
def _gated_scale_kernel(X, S, FLAG, numel, BLOCK: tl.constexpr):
    """``X *= S[0]`` (fp32, contiguous, in place) where ``FLAG[0] != 0``; a persistent grid that returns at once
    otherwise. (Times, not a fill: a NaN in ``X`` stays NaN under a zero scale.)"""
    if tl.load(FLAG) != 0:
        s = tl.load(S)
        for i in range(tl.program_id(0), tl.cdiv(numel, BLOCK), tl.num_programs(0)):
            offs = (tl.zeros([BLOCK], tl.int64) + i) * BLOCK + tl.arange(0, BLOCK)  # int64 whatever i's type
            mask = offs < numel
            tl.store(X + offs, tl.load(X + offs, mask=mask, other=0.0) * s, mask=mask)


def scale_cast(src: torch.Tensor, g: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``(src * g).to(dtype)`` for a contiguous ``src`` (fp32, or any dtype into ``out``) and a one-element fp32
    ``g``, in one pass, the product in fp32; ``out``: where to write it (``src`` itself: in place)."""
    out = torch.empty(src.shape, dtype=dtype, device=src.device) if out is None else out
    n = src.numel()
    if n:
        block = 4096 if src.is_cuda and not INTERPRET else 1024
        _scale_cast_kernel[(triton.cdiv(n, block),)](src, out, g.reshape(1), n, BLOCK=block, num_warps=4)
    return out


def gated_scale_(x: torch.Tensor, s: torch.Tensor, flag: torch.Tensor):
    """``x *= s`` (fp32 contiguous ``x``, one-element ``s``) where the device flag ``flag`` is non-zero; a flag of
    0 costs one short launch."""
    n = x.numel()
    if n:
        block = 4096 if x.is_cuda and not INTERPRET else 1024
        _gated_scale_kernel[(_persistent(x, triton.cdiv(n, block)),)](x, s.reshape(1), flag, n, BLOCK=block,
                                                                      num_warps=4)


def row_scale_cast(src: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(src * g[:, None]).to(dtype)`` for a contiguous fp32 ``src [N, D]`` and fp32 ``g [N]``, in one pass (the
    speculative route's dX: each row at its token's upstream gradient)."""
    n, d = src.shape
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    if n and d:
        gpu = src.is_cuda and not INTERPRET
        bm, bd = (16, 256) if gpu else (32, 64)
        _row_scale_cast_kernel[(triton.cdiv(n, bm), triton.cdiv(d, bd))](src, out, g.contiguous(), n, d,
                                                                          BLOCK_M=bm, BLOCK_D=bd, num_warps=4)
    return out


def gated_weight_grad_(dw: torch.Tensor | None, db: torch.Tensor | None, p: torch.Tensor, x: torch.Tensor,
                       flag: torch.Tensor):
    """``dw += p.T @ x`` and ``db += p.sum(0)`` (fp32 ``[V, D]`` / ``[V]``, in place; either may be None) for a
    token block's gradient ``p [K, V]`` and hidden states ``x [K, D]``, where the device flag ``flag`` (int32, one
    element) is non-zero; a flag of 0 leaves both untouched at the cost of a launch. The speculative route's
    fallback (``vpce.speculation``): cuBLAS cannot be told to skip on a device value."""
    k, v = p.shape
    d = x.shape[1]
    if k == 0 or v == 0 or (dw is None and db is None):
        return
    if INTERPRET or not x.is_cuda:
        bv, bd, bk, warps, stages = 32, 32, 16, 4, 1
    elif x.dtype == torch.float32:
        bv, bd, bk, warps, stages = 64, 64, 32, 4, 3
    else:
        bv, bd, bk, warps, stages = 128, 128, 64, 8, 3
    if dw is None:
        d = 1  # one column block (X unused): the grid walks the vocab blocks only
    grid = (_persistent(x, triton.cdiv(v, bv) * triton.cdiv(d, bd)),)
    dummy = p.new_empty(0, dtype=torch.float32)
    out = dw if dw is not None else dummy
    _gated_weight_grad_kernel[grid](
        p, x, out, db if db is not None else dummy, flag, k, v, d, p.stride(0), p.stride(1), x.stride(0),
        x.stride(1), out.stride(0) if dw is not None else 0, out.stride(1) if dw is not None else 0,
        HAS_DW=dw is not None, HAS_DB=db is not None, IEEE=x.dtype == torch.float32, BLOCK_V=bv, BLOCK_D=bd,
        BLOCK_K=bk, num_warps=warps, num_stages=stages)
