"""The distillation family (``vpce.backends.triton.distill_forward``): bandwidth-bound passes over a token
chunk's student and teacher logits.

cuBLAS writes both heads' chunk logits ``[C, V]`` in the inputs' dtype (biases included). These kernels read
them once per pass, apply each head's soft cap and the temperature on load in fp32, and work on one
``[BLOCK_M, BLOCK_N]`` tile per program (int64 offsets, no atomics):

* ``_distill_stats_kernel``: per (row, tile) each head's tile max and sum of ``exp`` relative to it, the KL's
  softmax-weighted sum (``sum e^{y - m} (y - z)`` or ``sum e^{z - m} (z - y)``), and with the cross-entropy the
  untempered student's max and sum of ``exp`` but the target's; the target's logit is stored by the one tile
  that holds it;
* ``_distill_reduce_kernel``: per row over its tiles, the packed ``[R, C]`` statistics of ``vpce.formulas.distill``
  (each head rescaled to its row max; plain sums for the JSD's mixture partials);
* ``_combine_distill_kernel``: every rank's packed statistics ``[W, R, C]`` combined into both heads' global
  max, ``log S`` and the KL's softmax expectation (``vpce.formulas.distill``'s ``_combine_head``, in one launch);
* ``_distill_mixture_kernel``: the JSD's second pass, per tile ``sum q (u - log m)`` and ``sum p (s - log m)``
  from the global log-softmax statistics;
* ``_distill_grad_kernel``: the student's ``dL/dx`` (``vpce.formulas.distill``'s formulas, per-row weights folded in),
  written in the logits' dtype over the student's logits in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..options import Folded
from .common import INTERPRET, LN2, LOG2E, _exp, _program_tile, _softcap, _softcap_value, _tiles_max
from .launch import first_launch

__all__ = ["distill_stats", "combine_distill_heads", "distill_mixture", "distill_grad_", "distill_block_align"]


@triton.jit
def _log2(x, FAST_LOG: tl.constexpr):
    """``log2 x``. ``FAST_LOG`` (compiled for NVIDIA GPUs): PTX's hardware ``lg2.approx.ftz.f32``, the same class of
    approximation as the ``ex2.approx.ftz`` that ``tl.exp2`` compiles to, instead of libdevice's (about 40
    instructions per element on sm_90), which held the JSD's mixture pass far below the statistics pass's
    bandwidth (docs/benchmarks.md). ``ftz``: the callers' arguments are never denormal, and the non-ftz form adds a
    fix-up per element."""
    if FAST_LOG:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return tl.log2(x)


@triton.jit
def _jsd_terms(s, u, beta, FAST_LOG: tl.constexpr, CLAMP: tl.constexpr):
    """The JSD's per-element terms from the base-2 log-probabilities ``s = log2 p`` (student), ``u = log2 q``
    (teacher) and the mixture ``m = beta q + (1 - beta) p`` (``0 < beta < 1``): ``p``, ``q``, ``s - log2 m`` and
    ``u - log2 m``, with four transcendentals per element (three ``exp2``, one ``log2``) and no conversion
    between bases (the callers scale the sums by ``ln 2``).

    Relative to the larger of the two log-probabilities (``d = u - s``, ``a = -|d|``): ``log2 m`` minus the
    larger is ``-L = log2(w + (1 - w) 2^a)`` with ``w`` the larger one's mixture weight, an argument in
    ``[min(beta, 1 - beta), 1]``; the larger's difference is ``L`` and the smaller's ``a + L``. No cancellation
    between two large logs, and the log's absolute error (the hardware approximation's included) stays at the
    scale of ``L``, not of ``log m``, which keeps the JSD's error against float64 at torch eager fp32's, where
    ``log m`` taken directly is several times worse (tests/distill/test_distillation_triton.py). A NaN in either
    head gives NaN terms; ``-inf`` in both (padding) gives ``p = q = 0``, whose terms the callers drop.

    ``CLAMP`` (for the sums of both heads' terms, where a NaN in either head reaches them through ``p`` or ``q``):
    ``a`` is clamped at ``-1e30`` (``tl.maximum`` returns the number where the other operand is NaN), so a head at
    ``-inf`` or both (padding) give finite differences beside a zero probability and every term ``p (s - log2 m)``
    is 0 there without a guard. Not for the student's gradient, which uses no ``q``: a NaN in the teacher reaches it
    only through ``a``."""
    d = u - s
    a = -tl.abs(d)
    if CLAMP:
        a = tl.maximum(a, -1e30)
    u_hi = d > 0
    w = tl.where(u_hi, beta, 1.0 - beta)
    w_lo = tl.where(u_hi, 1.0 - beta, beta)
    big = -_log2(tl.fma(w_lo, tl.exp2(a), w), FAST_LOG)
    s_m = tl.where(u_hi, a + big, big)
    u_m = tl.where(u_hi, big, a + big)
    return tl.exp2(s), tl.exp2(u), s_m, u_m


@triton.jit
def _max_exp(z):
    """Row max of a tile and ``exp(z - max)`` (a row of ``-inf`` gives 0, not NaN)."""
    m = tl.max(z, axis=1)
    return m, _exp(z - tl.where(m == float("-inf"), 0.0, m)[:, None])


@triton.jit
def _row_log2_probs(x, RM, RLS, rm, row_ok):
    """``(x - M) log2(e) - log2 S`` with the rows' global max ``M`` and ``log S``: a tile's log-softmax in base 2
    (``exp2`` of it is the softmax, with no multiply per element), one ``fma`` per element."""
    m = tl.load(RM + rm, mask=row_ok, other=0.0)[:, None]
    ls2 = (tl.load(RLS + rm, mask=row_ok, other=0.0) * LOG2E)[:, None]
    return tl.fma(x - m, LOG2E, -ls2)


@triton.jit
def _distill_load(Z, Y, rm, rn, mask, stride_zm, stride_ym, softcap, t_softcap, inv_t,
                  SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr, TEMPERATURE: tl.constexpr):
    """A tile of both heads in fp32: the student's capped logit ``z1``, its tempered ``z``, the cap's derivative,
    and the teacher's capped, tempered ``y``."""
    rn64 = rn.to(tl.int64)[None, :]
    x = tl.load(Z + rm.to(tl.int64)[:, None] * stride_zm + rn64, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(Y + rm.to(tl.int64)[:, None] * stride_ym + rn64, mask=mask, other=0.0).to(tl.float32)
    z1 = x
    dcap = x
    if SOFTCAP:
        z1, dcap = _softcap(x, softcap)
    if T_SOFTCAP:
        y = _softcap_value(y, t_softcap)
    z = z1
    if TEMPERATURE:
        z = z1 * inv_t
        y = y * inv_t
    return z1, z, y, dcap


@first_launch
@triton.heuristics({"EVEN_N": lambda a: a["V"] % a["BLOCK_N"] == 0})
@triton.jit
def _distill_stats_kernel(
    # pointers
    Z, Y, TL, TILES, ZT,
    # shapes
    C, V, n_tiles, plane,
    # strides
    stride_zm, stride_ym,
    # options
    softcap, t_softcap, inv_t,
    # meta
    SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr, TEMPERATURE: tl.constexpr, KL: tl.constexpr,
    CE: tl.constexpr, CE_AT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):
    """``TILES [K, C, n_tiles]`` planes: student max, sum; teacher max, sum; [KL weighted sum (KL = 1: forward,
    2: reverse)]; [CE max, sum but the target's at ``CE_AT``]; ``ZT [C]``: the target's capped student logit."""
    rm, rn, row_ok, mask = _program_tile(C, V, BLOCK_M, BLOCK_N, EVEN_N)
    pid_n = tl.program_id(1)
    z1, z, y, _ = _distill_load(Z, Y, rm, rn, mask, stride_zm, stride_ym, softcap, t_softcap, inv_t,
                                SOFTCAP, T_SOFTCAP, TEMPERATURE)
    if not EVEN_N:  # padding columns: -inf in every head
        pad = tl.where(rn < V, 0.0, float("-inf"))[None, :]
        z1 = z1 + pad
        z = z + pad
        y = y + pad

    # -- each head's tile max and sum of exp --
    m_z, e_z = _max_exp(z)
    m_y, e_y = _max_exp(y)
    stat = rm.to(tl.int64) * n_tiles + pid_n
    tl.store(TILES + stat, m_z, mask=row_ok)
    tl.store(TILES + plane + stat, tl.sum(e_z, axis=1), mask=row_ok)
    tl.store(TILES + 2 * plane + stat, m_y, mask=row_ok)
    tl.store(TILES + 3 * plane + stat, tl.sum(e_y, axis=1), mask=row_ok)
    # -- the KL's softmax-weighted sum (a term with exp 0 is 0, even where the difference is infinite) --
    if KL == 1:
        tl.store(TILES + 4 * plane + stat, tl.sum(tl.where(e_y == 0.0, 0.0, e_y * (y - z)), axis=1), mask=row_ok)
    if KL == 2:
        tl.store(TILES + 4 * plane + stat, tl.sum(tl.where(e_z == 0.0, 0.0, e_z * (z - y)), axis=1), mask=row_ok)
    # -- the hard-label cross-entropy on the untempered student, the target's column kept apart --
    if CE:
        t = tl.load(TL + rm, mask=row_ok, other=-1)
        hit = rn[None, :] == t[:, None]
        m1 = m_z
        e1 = e_z
        if TEMPERATURE:
            m1, e1 = _max_exp(z1)
        tl.store(TILES + CE_AT * plane + stat, m1, mask=row_ok)
        tl.store(TILES + (CE_AT + 1) * plane + stat, tl.sum(tl.where(hit, 0.0, e1), axis=1), mask=row_ok)
        mine = row_ok & (t >= pid_n * BLOCK_N) & (t < pid_n * BLOCK_N + BLOCK_N)
        tl.store(ZT + rm, tl.sum(tl.where(hit, z1, 0.0), axis=1), mask=mine)


@triton.jit
def _tiles_softmax(TM, TS, TW, base, ok, T, HAS_W: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """One head's row statistics from its tiles: ``m = max m_t``, ``s = sum s_t e^{m_t - m}``, ``w = sum w_t
    e^{m_t - m}``. (Accumulated elementwise and reduced after each loop, as ``_reduce_tiles_kernel``.)"""
    m, safe = _tiles_max(TM, base, ok, T, BLOCK_C, BLOCK_T)
    s2 = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    w2 = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        cols = t0 + tl.arange(0, BLOCK_T)
        msk = ok[:, None] & (cols < T)[None, :]
        offs = base[:, None] + cols[None, :]
        r = tl.where(msk, _exp(tl.load(TM + offs, mask=msk, other=float("-inf")) - safe[:, None]), 0.0)
        s2 += tl.load(TS + offs, mask=msk, other=0.0) * r  # NaN in m_t or s_t stays NaN
        if HAS_W:
            w2 += tl.load(TW + offs, mask=msk, other=0.0) * r
    return m, tl.sum(s2, 1), tl.sum(w2, 1)


@triton.jit
def _tiles_sum(TS, base, ok, T, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    s2 = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    for t0 in range(0, T, BLOCK_T):
        cols = t0 + tl.arange(0, BLOCK_T)
        msk = ok[:, None] & (cols < T)[None, :]
        s2 += tl.load(TS + base[:, None] + cols[None, :], mask=msk, other=0.0)
    return tl.sum(s2, 1)


@first_launch
@triton.jit
def _distill_reduce_kernel(TILES, OUT, C, T, plane, SUMS: tl.constexpr, KL: tl.constexpr, CE: tl.constexpr,
                           CE_AT: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """``TILES [K, C, T]`` -> ``OUT [R, C]``, plane ``k`` into row ``k``: with ``SUMS`` each plane summed in tile
    order; else each head (student, teacher, CE) rescaled to its row max, the KL's sum with its head."""
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = rows < C
    base = rows.to(tl.int64) * T
    if SUMS:
        for k in tl.static_range(SUMS):
            tl.store(OUT + k * C + rows, _tiles_sum(TILES + k * plane, base, ok, T, BLOCK_C, BLOCK_T), mask=ok)
    else:
        m, s, w = _tiles_softmax(TILES, TILES + plane, TILES + 4 * plane, base, ok, T, KL == 2, BLOCK_C, BLOCK_T)
        tl.store(OUT + rows, m, mask=ok)
        tl.store(OUT + C + rows, s, mask=ok)
        if KL == 2:
            tl.store(OUT + 4 * C + rows, w, mask=ok)
        m, s, w = _tiles_softmax(TILES + 2 * plane, TILES + 3 * plane, TILES + 4 * plane, base, ok, T, KL == 1,
                                 BLOCK_C, BLOCK_T)
        tl.store(OUT + 2 * C + rows, m, mask=ok)
        tl.store(OUT + 3 * C + rows, s, mask=ok)
        if KL == 1:
            tl.store(OUT + 4 * C + rows, w, mask=ok)
        if CE:
            m, s, _ = _tiles_softmax(TILES + CE_AT * plane, TILES + (CE_AT + 1) * plane, TILES, base, ok, T, False,
                                     BLOCK_C, BLOCK_T)
            tl.store(OUT + CE_AT * C + rows, m, mask=ok)
            tl.store(OUT + (CE_AT + 1) * C + rows, s, mask=ok)


@first_launch
@triton.jit
def _combine_distill_kernel(EVERY, OUT, POISON, C, W, R, KL: tl.constexpr, HAS_POISON: tl.constexpr,
                            BLOCK_C: tl.constexpr):
    """``EVERY [W, R, C]`` (each rank's packed rows: student max, sum; teacher max, sum; [the KL's weighted sum])
    -> ``OUT [5, C]``: per head ``M = max_r m_r`` (plus the poison), ``log S`` with ``S = sum_r s_r e^{m_r - M}``,
    and for the KL's head (``KL`` 1: the teacher's, forward; 2: the student's, reverse) ``E = sum_r w_r e^{m_r - M}
    / S`` in row 4. Ranks in order; a rank with ``m_r = -inf`` adds 0; NaN propagates."""
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = rows < C
    for head in tl.static_range(2):
        m = tl.full([BLOCK_C], float("-inf"), tl.float32)
        for w in range(0, W):
            m = tl.maximum(m, tl.load(EVERY + (w * R + 2 * head) * C + rows, mask=ok, other=0.0),
                           propagate_nan=tl.PropagateNan.ALL)
        if HAS_POISON:
            m = m + tl.load(POISON)
        safe = tl.where(m == float("-inf"), 0.0, m)
        s = tl.zeros([BLOCK_C], tl.float32)
        e = tl.zeros([BLOCK_C], tl.float32)
        for w in range(0, W):
            r = _exp(tl.load(EVERY + (w * R + 2 * head) * C + rows, mask=ok, other=0.0) - safe)
            s += tl.load(EVERY + (w * R + 2 * head + 1) * C + rows, mask=ok, other=0.0) * r
            if KL == 2 - head:
                e += tl.load(EVERY + (w * R + 4) * C + rows, mask=ok, other=0.0) * r
        tl.store(OUT + 2 * head * C + rows, m, mask=ok)
        tl.store(OUT + (2 * head + 1) * C + rows, tl.log(s), mask=ok)
        if KL == 2 - head:
            tl.store(OUT + 4 * C + rows, e / s, mask=ok)


@first_launch
@triton.heuristics({"EVEN_N": lambda a: a["V"] % a["BLOCK_N"] == 0})
@triton.jit
def _distill_mixture_kernel(
    # pointers
    Z, Y, RM_Z, RLS_Z, RM_Y, RLS_Y, TILES,
    # shapes
    C, V, n_tiles, plane,
    # strides
    stride_zm, stride_ym,
    # options
    softcap, t_softcap, inv_t, beta,
    # meta
    SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr, TEMPERATURE: tl.constexpr, FAST_LOG: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr,
):
    """``TILES [2, C, n_tiles]``: per tile ``sum q (u - log m)`` and ``sum p (s - log m)`` with ``s = log p``,
    ``u = log q`` from the global statistics (``_jsd_terms``)."""
    rm, rn, row_ok, mask = _program_tile(C, V, BLOCK_M, BLOCK_N, EVEN_N)
    pid_n = tl.program_id(1)
    _, z, y, _ = _distill_load(Z, Y, rm, rn, mask, stride_zm, stride_ym, softcap, t_softcap, inv_t,
                               SOFTCAP, T_SOFTCAP, TEMPERATURE)
    s = _row_log2_probs(z, RM_Z, RLS_Z, rm, row_ok)
    u = _row_log2_probs(y, RM_Y, RLS_Y, rm, row_ok)
    if not EVEN_N:
        pad = tl.where(rn < V, 0.0, float("-inf"))[None, :]
        s = s + pad
        u = u + pad
    p, q, s_m, u_m = _jsd_terms(s, u, beta, FAST_LOG, True)  # no guards: the terms are 0 where p or q is
    stat = rm.to(tl.int64) * n_tiles + pid_n
    tl.store(TILES + stat, tl.sum(q * u_m, axis=1) * LN2, mask=row_ok)
    tl.store(TILES + plane + stat, tl.sum(p * s_m, axis=1) * LN2, mask=row_ok)


@first_launch
@triton.jit
def _distill_grad_kernel(
    # pointers
    Z, Y, G, TL, RM_Z, RLS_Z, RM_Y, RLS_Y, RE, RM1, RLS1, RQ1, KD, CEW,
    # shapes
    C, V,
    # strides
    stride_zm, stride_ym, stride_gm,
    # options
    softcap, t_softcap, inv_t, beta,
    # meta
    SOFTCAP: tl.constexpr, T_SOFTCAP: tl.constexpr, TEMPERATURE: tl.constexpr, KIND: tl.constexpr,
    CE: tl.constexpr, FAST_LOG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """``G = dL/dx`` (KIND 0: forward KL, 1: reverse KL, 2: JSD), ``G`` may alias ``Z``::

        g = KD (p - q | p ((z - y) - E) | (1 - beta) p ((s - log m) - K_p)) + CEW (p1 - [j = t])
        times the soft cap's derivative; the target's ``p1 - 1`` is ``-q1`` (exact for confident tokens)."""
    rm, rn, row_ok, mask = _program_tile(C, V, BLOCK_M, BLOCK_N, False)  # padding columns: computed, never stored
    z1, z, y, dcap = _distill_load(Z, Y, rm, rn, mask, stride_zm, stride_ym, softcap, t_softcap, inv_t,
                                   SOFTCAP, T_SOFTCAP, TEMPERATURE)
    # -- the divergence's gradient with respect to the tempered logits (p = 0: no 0 * inf) --
    s = _row_log2_probs(z, RM_Z, RLS_Z, rm, row_ok)
    if KIND == 0:
        g = tl.exp2(s) - tl.exp2(_row_log2_probs(y, RM_Y, RLS_Y, rm, row_ok))
    else:
        e = tl.load(RE + rm, mask=row_ok, other=0.0)[:, None]
        if KIND == 1:
            p = tl.exp2(s)
            g = tl.where(p == 0.0, 0.0, p * ((z - y) - e))
        else:
            p, _, s_m, _ = _jsd_terms(s, _row_log2_probs(y, RM_Y, RLS_Y, rm, row_ok), beta, FAST_LOG, False)
            g = tl.where(p == 0.0, 0.0, (1.0 - beta) * p * tl.fma(s_m, LN2, -e))
    g = g * tl.load(KD + rm, mask=row_ok, other=0.0)[:, None]
    # -- the cross-entropy's on the untempered logits --
    if CE:
        t = tl.load(TL + rm, mask=row_ok, other=-1)
        p1 = tl.exp2(_row_log2_probs(z1, RM1, RLS1, rm, row_ok))
        p1 = tl.where(rn[None, :] == t[:, None], -tl.load(RQ1 + rm, mask=row_ok, other=0.0)[:, None], p1)
        g = g + tl.load(CEW + rm, mask=row_ok, other=0.0)[:, None] * p1
    if SOFTCAP:
        g = g * dcap
    tl.store(G + rm.to(tl.int64)[:, None] * stride_gm + rn.to(tl.int64)[None, :], g.to(G.dtype.element_ty),
             mask=mask)


def _distill_blocks(x: torch.Tensor) -> tuple[int, int, int]:
    """``(BLOCK_M, BLOCK_N, num_warps)`` of the distillation's bandwidth kernels: one row by 2048 columns with 4
    warps on a GPU, a small tile under the interpreter: of the shapes timed from 16 x 256 to 1 x 4096, the fastest or
    nearly so for each of the statistics, mixture and gradient kernels on both bench vocabularies
    (docs/benchmarks.md)."""
    if INTERPRET or not x.is_cuda:
        return 32, 32, 4
    return 1, 2048, 4


def _fast_log(x: torch.Tensor) -> bool:
    """The JSD kernels' ``log`` through PTX's ``lg2.approx`` (``_log2``): compiled NVIDIA GPUs only."""
    return x.is_cuda and not INTERPRET and torch.version.hip is None


def distill_block_align(x: torch.Tensor) -> int:
    """The column multiple of the lean backward's vocab blocks for inputs like ``x``: 256 on a GPU (whole GEMM
    tiles; the gradient kernel masks any width), the interpreter's tile width there."""
    return 32 if INTERPRET or not x.is_cuda else 256


def _distill_options(student: Folded, teacher: Folded) -> dict:
    """The kernels' scalars and flags for both heads' logits (``vpce.options.DistillOptions``: one ``inv_t``)."""
    softcap, t_softcap, inv_t = student.softcap, teacher.softcap, student.inv_t
    return dict(softcap=float(softcap or 1.0), t_softcap=float(t_softcap or 1.0), inv_t=float(inv_t),
                SOFTCAP=softcap is not None, T_SOFTCAP=t_softcap is not None, TEMPERATURE=inv_t != 1.0)


def _check_pair(z: torch.Tensor, y: torch.Tensor):
    if z.shape != y.shape or z.stride(1) != 1 or y.stride(1) != 1:
        raise RuntimeError(f"vpce: distillation logits must be equal-shaped with unit column stride, got "
                           f"{tuple(z.shape)}/{z.stride()} and {tuple(y.shape)}/{y.stride()}")


def distill_stats(z, y, t_local, packed, *, kl: int, ce: bool, student: Folded, teacher: Folded):
    """This shard's packed statistics of a chunk into ``packed [R, C]`` (fp32, contiguous), rows as
    ``vpce.distill`` packs them: student max, sum of exp; teacher max, sum of exp; [the KL's weighted sum, ``kl``
    1: forward, 2: reverse]; [with ``ce``: the untempered student's max, sum of exp but the target's, target
    logit (``t_local``: int32 local column, -1 where the target is not in this shard)]. ``z``, ``y``: the
    student's and the teacher's logits ``[C, V]`` before the caps and the temperature (``student``,
    ``teacher``)."""
    _check_pair(z, y)
    c, v = z.shape
    ce_at = 4 + (kl != 0)
    if ce:
        packed[ce_at + 2].fill_(float("-inf"))  # the target's row: stored only by the tile that holds it
    if c == 0 or v == 0:
        return
    bm, bn, warps = _distill_blocks(z)
    n_tiles = triton.cdiv(v, bn)
    tiles = torch.empty(ce_at + 2 * ce, c, n_tiles, dtype=torch.float32, device=z.device)
    _distill_stats_kernel[(triton.cdiv(c, bm), n_tiles)](
        z, y, t_local, tiles, packed[ce_at + 2] if ce else packed, c, v, n_tiles, c * n_tiles, z.stride(0), y.stride(0),
        **_distill_options(student, teacher), KL=kl, CE=ce, CE_AT=ce_at, BLOCK_M=bm, BLOCK_N=bn,
        num_warps=warps)
    block_c = 16 if INTERPRET or not z.is_cuda else 64
    _distill_reduce_kernel[(triton.cdiv(c, block_c),)](tiles, packed, c, n_tiles, c * n_tiles, SUMS=0, KL=kl, CE=ce,
                                                        CE_AT=ce_at, BLOCK_C=block_c, BLOCK_T=32, num_warps=4)


def combine_distill_heads(every: torch.Tensor, *, kl: int, poison: torch.Tensor | None = None):
    """Every rank's packed distillation statistics ``[W, R, C]`` -> ``(m_z, log_s_z, m_y, log_s_y, e)`` ``[C]``
    each in one launch (``e`` None without a KL: ``kl`` 0 for the JSD, 1 forward, 2 reverse); the formulas of
    ``vpce.distill``'s torch combine."""
    w, r, c = every.shape
    out = torch.empty(5, c, dtype=torch.float32, device=every.device)
    if c:
        block_c = 16 if INTERPRET or not every.is_cuda else 256
        _combine_distill_kernel[(triton.cdiv(c, block_c),)](every.contiguous(), out, out if poison is None else poison,
                                                            c, w, r, KL=kl, HAS_POISON=poison is not None,
                                                            BLOCK_C=block_c, num_warps=4)
    return out[0], out[1], out[2], out[3], out[4] if kl else None


def distill_mixture(z, y, m_z, log_s_z, m_y, log_s_y, *, beta: float, student: Folded, teacher: Folded
                    ) -> torch.Tensor:
    """The JSD's second pass on this shard: ``[K_q, K_p]`` partial sums ``[2, C]`` fp32 from the chunk's logits
    and the global per-row statistics (each head's max and ``log S``)."""
    _check_pair(z, y)
    c, v = z.shape
    out = torch.zeros(2, c, dtype=torch.float32, device=z.device)
    if c == 0 or v == 0:
        return out
    bm, bn, warps = _distill_blocks(z)
    n_tiles = triton.cdiv(v, bn)
    tiles = torch.empty(2, c, n_tiles, dtype=torch.float32, device=z.device)
    _distill_mixture_kernel[(triton.cdiv(c, bm), n_tiles)](
        z, y, m_z, log_s_z, m_y, log_s_y, tiles, c, v, n_tiles, c * n_tiles, z.stride(0), y.stride(0),
        **_distill_options(student, teacher), beta=float(beta), FAST_LOG=_fast_log(z), BLOCK_M=bm,
        BLOCK_N=bn, num_warps=warps)
    block_c = 16 if INTERPRET or not z.is_cuda else 64
    _distill_reduce_kernel[(triton.cdiv(c, block_c),)](tiles, out, c, n_tiles, c * n_tiles, SUMS=2, KL=0, CE=False,
                                                        CE_AT=0, BLOCK_C=block_c, BLOCK_T=32, num_warps=4)
    return out


def distill_grad_(z, y, g, t_local, rows, kd, ce, *, kind: int, beta: float, student: Folded, teacher: Folded):
    """The student's ``dL/dx`` of a chunk (or a vocab block: ``t_local`` relative to its first column) into ``g``
    (may alias ``z``), in ``g``'s dtype. ``rows``: ``vpce.distill.DistillRows`` of the chunk's tokens (fp32);
    ``kd`` the divergence's per-row weight (the ``1/T`` folded in), ``ce`` the cross-entropy's or None; ``kind``
    0 forward KL, 1 reverse KL, 2 JSD."""
    _check_pair(z, y)
    c, v = z.shape
    if c == 0 or v == 0:
        return
    bm, bn, warps = _distill_blocks(z)
    pick = lambda t: kd if t is None else t  # noqa: E731
    _distill_grad_kernel[(triton.cdiv(c, bm), triton.cdiv(v, bn))](
        z, y, g, t_local, rows.m_z, rows.log_s_z, rows.m_y, rows.log_s_y, pick(rows.e), pick(rows.m1),
        pick(rows.log_s1), pick(rows.q1), kd, pick(ce), c, v, z.stride(0), y.stride(0), g.stride(0),
        **_distill_options(student, teacher), beta=float(beta), KIND=kind, CE=ce is not None,
        FAST_LOG=_fast_log(z), BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
