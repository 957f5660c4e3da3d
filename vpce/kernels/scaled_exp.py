"""The scaled-exponential route's two small kernels (``vpce.gemm.ScaledExps``).

There the logits GEMM's epilogue (``vpce.gemm.scaled_exps``) stores, instead of the logits, ``E = 2^(z log2 e - k)``
in bf16, with ``k`` an integer per (row, ``group`` columns): the tile's max logit in log2 units, rounded. It also
writes per (row, group) ``k`` and the sum of the unrounded ``E``, and the target column's raw fp32 logit.

* ``scaled_exp_lse``: per row, the log-sum-exp of this shard's logits from those groups (the statistics then go on
  as the statistics epilogue's do: ``target_out_of_lse``, ``reduce_tiles``, the exchange).
* ``scaled_exp_grad``: once the global statistics are in, per row the factors that turn ``E`` into the gradient,
  so that no pass rewrites ``[C, V]``: ``dL/dz = diag(v) (u ⊙ E)``, ``u`` a power of two per (row, 64 columns)
  (the ``strip``, bf16, ``[V / 64, C]``, as quack's A-operand transforms read it), ``v`` per row in fp32. The
  target's entry and its 64 columns are rewritten: the target's gradient ``-a q`` (``q = 1 - p_t``) goes into
  ``E`` at about 1 in magnitude, and its strip entry takes the scale. There every other entry is at most ``q``
  times the row's factor, so none of the 64 overflows.

Exactness: ``u`` is a power of two and ``E`` holds each ``exp`` rounded once from the fp32 accumulator, so
``u ⊙ E`` is the gradient rounded once per entry, as the statistics epilogue's gradient pass rounds it (that one
from the bf16-rounded logit). Entries below ``2^-133`` of the row's scale flush to zero (their share of any sum
is below fp32's resolution).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import INTERPRET, LOG2E, LN2

__all__ = ["scaled_exp_lse", "scaled_exp_grad", "STRIP_COLS"]

STRIP_COLS = 64  # columns per strip entry: quack's transforms scale A per (row, 64-column k-tile)


@triton.jit
def _scaled_exp_lse_kernel(KK, SE, LSE, C, T, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per row: ``k_r = max_t KK``, ``LSE = k_r ln 2 + log(sum_t SE 2^(KK - k_r))``."""
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = rows < C
    base = rows.to(tl.int64) * T
    m2 = tl.full([BLOCK_C, BLOCK_T], float("-inf"), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        cols = t0 + tl.arange(0, BLOCK_T)
        msk = ok[:, None] & (cols < T)[None, :]
        m2 = tl.maximum(m2, tl.load(KK + base[:, None] + cols[None, :], mask=msk, other=float("-inf")))
    kr = tl.max(m2, 1)
    s2 = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        cols = t0 + tl.arange(0, BLOCK_T)
        msk = ok[:, None] & (cols < T)[None, :]
        k = tl.load(KK + base[:, None] + cols[None, :], mask=msk, other=0.0)
        se = tl.load(SE + base[:, None] + cols[None, :], mask=msk, other=0.0)
        s2 += se * tl.exp2(k - kr[:, None])
    tl.store(LSE + rows, kr * LN2 + tl.log(tl.sum(s2, 1)), mask=ok)


def scaled_exp_lse(kk: torch.Tensor, sum_exp: torch.Tensor) -> torch.Tensor:
    """``[C]`` fp32: each row's log-sum-exp over this shard's columns from the epilogue's ``kk [C, T]`` (``k`` per
    group, log2 units) and ``sum_exp [C, T]`` (each group's sum of ``2^(z log2 e - k)``)."""
    c, t = kk.shape
    lse = torch.empty(c, dtype=torch.float32, device=kk.device)
    if c:
        block_c = 16 if INTERPRET or not kk.is_cuda else 64
        _scaled_exp_lse_kernel[(triton.cdiv(c, block_c),)](kk, sum_exp, lse, c, t, BLOCK_C=block_c, BLOCK_T=32,
                                                           num_warps=4)
    return lse


@triton.jit
def _scaled_exp_grad_kernel(E, KK, TL, LSE, Q, A, STRIP, STRIP2, V_OUT, C, V, T, stride_e, stride_s, stride_s2,
                            GROUP: tl.constexpr, TWO: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_J: tl.constexpr,
                            SCOLS: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = rows < C
    r64 = rows.to(tl.int64)
    lse2 = tl.load(LSE + rows, mask=ok, other=0.0) * LOG2E
    m2 = tl.floor(lse2 + 0.5)  # an integer near lse log2 e: v = a 2^(m2 - lse log2 e) lies within a factor 1.42 of a
    a = tl.load(A + rows, mask=ok, other=0.0)
    tl.store(V_OUT + rows, a * tl.exp2(m2 - lse2), mask=ok)
    # the target's 64 columns: the shift ``s`` that brings its gradient to about 1 in magnitude
    t = tl.load(TL + rows, mask=ok, other=-1)
    q = tl.load(Q + rows, mask=ok, other=0.0)
    fix = ok & (t >= 0) & (a != 0.0)
    tc = tl.where(fix, t, 0)
    kt = tl.load(KK + r64 * T + tc // GROUP, mask=fix, other=0.0)
    delta = lse2 - kt
    s = tl.where(q > 0.0, tl.floor(delta + tl.log2(q) + 0.5), 0.0)
    s = tl.where(fix, s, 0.0)
    jt = tc // SCOLS
    # the strip: 2^(k - m2) per 64 columns, the target's shifted by ``s``
    for j0 in range(0, V // SCOLS, BLOCK_J):
        js = j0 + tl.arange(0, BLOCK_J)
        msk = ok[None, :] & (js < V // SCOLS)[:, None]
        k = tl.load(KK + r64[None, :] * T + (js * SCOLS // GROUP)[:, None], mask=msk, other=0.0)
        k = k + tl.where(js[:, None] == jt[None, :], s[None, :], 0.0)
        u = tl.exp2(k - m2[None, :]).to(STRIP.dtype.element_ty)
        tl.store(STRIP + js.to(tl.int64)[:, None] * stride_s + rows[None, :], u, mask=msk)
        if TWO:
            tl.store(STRIP2 + js.to(tl.int64)[:, None] * stride_s2 + rows[None, :], u, mask=msk)
    # the target's 64 entries of E: the others times 2^-s (exact but for underflow), the target's -q 2^(delta - s)
    cols = jt[:, None] * SCOLS + tl.arange(0, SCOLS)[None, :]
    offs = r64[:, None] * stride_e + cols
    blk = fix[:, None] & (cols < V)
    e = tl.load(E + offs, mask=blk, other=0.0).to(tl.float32)
    e = tl.where(cols == tc[:, None], (-q * tl.exp2(delta - s))[:, None], e * tl.exp2(-s)[:, None])
    tl.store(E + offs, e.to(E.dtype.element_ty), mask=blk)



def scaled_exp_grad(e: torch.Tensor, kk: torch.Tensor, t_local: torch.Tensor, lse: torch.Tensor, q: torch.Tensor,
                    a: torch.Tensor, strip: torch.Tensor, v_out: torch.Tensor, group: int,
                    strip2: torch.Tensor | None = None) -> None:
    """For rows whose gradient is ``a (p - onehot(t))`` (the cross-entropy without smoothing or z-loss: ``c = -a``
    in ``vpce.formulas.Coefficients``), with ``E`` ``[C, V]`` as the epilogue stored it and ``kk [C, V / group]``:
    writes ``strip [V / 64, C]`` (bf16 powers of two; also into ``strip2``, another ``[V / 64, *]`` view, where
    given), ``v_out [C]`` fp32, and rewrites each row's target block of ``E`` (``t_local`` -1: the target is on
    another rank, nothing to rewrite), so that the gradient is ``v_out[i] * strip[j // 64, i] * E[i, j]``.
    ``lse`` and ``q`` are the rows' global statistics (``RankStats.lse``, ``.q``)."""
    c, v = e.shape
    if c == 0:
        return
    gpu = e.is_cuda and not INTERPRET
    block_c = 64 if gpu else 16
    other = strip if strip2 is None else strip2
    _scaled_exp_grad_kernel[(triton.cdiv(c, block_c),)](
        e, kk, t_local, lse, q, a, strip, other, v_out, c, v, kk.shape[1], e.stride(0), strip.stride(0),
        other.stride(0), GROUP=group, TWO=strip2 is not None, BLOCK_C=block_c, BLOCK_J=32 if gpu else 16,
        SCOLS=STRIP_COLS, num_warps=4)
