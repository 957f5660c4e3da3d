"""The softmax family (cross-entropy, log-probs): the lm_head GEMM with a softmax epilogue, the same epilogue over
logits cuBLAS already wrote, the exact target logit, the per-row reduction of the tile statistics, and the combine
of every rank's statistics.

``logits_tiles`` computes ``x = X @ W.T (+ b)`` one ``[BLOCK_M, BLOCK_N]`` tile at a time (fp32 accumulation over
D, TMA loads on Hopper, int64 addressing) and never writes it; ``stored_logits`` runs the same epilogue
(``_epilogue``) over a ``[rows, V]`` buffer of logits a GEMM already wrote (one bandwidth-bound pass). Per tile:

1. bias, the soft cap ``c * tanh(x / c)``, the temperature ``z = cap(x) / T``; columns past the valid vocab
   become ``-inf``;
2. stats mode: the tile's row max ``m_t`` (over every column) and ``x_t = sum exp(z - m_t)`` over every column but
   the target's go to ``[rows, n_tiles]`` buffers, optionally ``sum z`` over all columns (label smoothing; ``sum
   w_j z_j`` with per-class weights ``w``, loaded per tile, which also weight the gradient's ``d`` term) and
   ``sum exp(z - m_t) z`` but the target's (entropy) too; the target's ``z`` goes to ``ZT[row]``, stored by the one
   tile that holds it (no atomics). Keeping the target apart is what makes ``-log p_t`` and ``1 - p_t`` exact for
   confident tokens (``vpce.parallel`` has the combine); over stored 16-bit logits ``target_logits`` then
   recomputes ``ZT`` in fp32 from ``X`` and the target's row of ``W``;
3. grad mode: with the global statistics known it writes the gradient with respect to the pre-cap logit (in
   place over stored logits).

The gradient of every loss vpce offers has one form per row, with per-row coefficients ``a, b, c, d`` computed
on the host (``vpce.formulas.softmax``; they include the upstream gradient, the temperature and the token weight)::

    dL/dx_j = (p_j (a + b (z_j - M)) + d) * dcap_j,   dL/dx_t = ((a + c) - a q + b (z_t - M) p_t + d) * dcap_t

with ``p_j = exp(z_j - lse)``, ``q = 1 - p_t`` and ``dcap = sech^2(x / c)``. A tile whose logits are all ``-inf``
contributes 0 (``exp`` is taken against 0 there, not ``-inf``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..options import Folded
from ..rank_stats import RankStats
from .common import (INTERPRET, _exp, _log1p, _persistent, _program_tile, _softcap_quarter_slope, _softcap_value,
                     _tiles_max)
from .launch import first_launch

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

__all__ = ["logits_tiles", "stored_logits", "target_logits", "reduce_tiles", "combine_rank_stats", "tile_n"]


@triton.jit
def _dlogits(p, zc, hit, ca, cb, cc, cd, q, dcap, HAS_CB: tl.constexpr, HAS_CD: tl.constexpr,
             SOFTCAP: tl.constexpr, cw, HAS_CW: tl.constexpr, HIT: tl.constexpr):
    """The gradient of ``vpce.formulas.softmax`` for a tile: ``p (a + b zc) + d`` off the target, ``(a + c) - a q
    + b zc p + d`` at it (``zc = z - M``, ``q = 1 - p_t``), times ``dcap``; with class weights ``d`` is times the
    column's weight ``cw``. ``HIT`` False: the tile holds no row's target column (``hit`` is not read)."""
    if HAS_CB:
        bz = cb[:, None] * zc
        g = tl.where(p == 0.0, 0.0, p * (ca[:, None] + bz))  # p = 0 at z = -inf: no 0 * inf
        if HIT:
            g = tl.where(hit, (ca + cc - ca * q)[:, None] + tl.where(p == 0.0, 0.0, bz * p), g)
    elif HIT:
        g = tl.where(hit, (ca + cc - ca * q)[:, None], p * ca[:, None])
    else:
        g = p * ca[:, None]
    if HAS_CD:
        if HAS_CW:
            g = g + cd[:, None] * cw[None, :]
        else:
            g = g + cd[:, None]
    if SOFTCAP:
        g = g * dcap
    return g  # padding columns hold garbage here: every caller's store masks them


@triton.jit
def _max_before(acc, m_t, rm, rn, row_ok, TB, pid_n, BLOCK_N: tl.constexpr):
    """Per row of a tile, the max of the logits ``acc`` over the columns of a lower id than the target's (``TB``:
    how many of this shard's columns lie before it); ``m_t``: the tile's max over every column but the target's."""
    before = tl.load(TB + rm, mask=row_ok, other=0)
    start = pid_n * BLOCK_N
    # a tile wholly before the target's column holds neither the target nor padding: its max is m_t
    mb = tl.where(before >= start + BLOCK_N, m_t, float("-inf"))
    cut = (before > start) & (before < start + BLOCK_N)
    if tl.max(cut.to(tl.int32), axis=0) > 0:  # only a tile the target's column splits needs the masked max
        mb = tl.where(cut, tl.max(tl.where(rn[None, :] < before[:, None], acc, float("-inf")), axis=1), mb)
    return mb


@triton.jit
def _grad_tile(stored, t, rm, rn, row_ok, pid_n, P, stride_pm, stride_pn, lse_row, q_row, m_row, ca, cb, cc, cd, cw,
               softcap, inv_t, TILE_EZ, TILE_M, TILE_MB, TB, V, n_tiles, SOFTCAP: tl.constexpr,
               TEMPERATURE: tl.constexpr, HAS_CB: tl.constexpr, HAS_CD: tl.constexpr, HAS_CW: tl.constexpr,
               EVEN_N: tl.constexpr, SUM_EZ: tl.constexpr, TOP1: tl.constexpr, BLOCK_N: tl.constexpr,
               HIT: tl.constexpr):
    """The gradient pass over one tile of the logits as stored (``stored``): the gradient into ``P``, and with the
    metrics their per-tile terms. ``HIT`` False (never with the metrics): no row's target column and no padding
    lies in the tile. Every tile-sized value is made here, after the caller's branch on ``HIT``: made before it, it
    would stay live across the branch and take its registers."""
    acc = stored
    dcap = stored
    if SOFTCAP:  # the cap and a quarter of its slope; the 4 is in the row's coefficients
        acc, dcap = _softcap_quarter_slope(stored, softcap)
    if TEMPERATURE:
        acc = acc * inv_t
    hit = rn[None, :] == t[:, None]  # read where HIT only
    # off the target p needs no more than z's own precision; the target's entry comes from q (_dlogits)
    p = _exp(acc - lse_row[:, None])
    zc = acc  # read with the smoothing term (HAS_CB) only
    if HAS_CB:
        zc = acc - m_row[:, None]
    g = _dlogits(p, zc, hit, ca, cb, cc, cd, q_row, dcap, HAS_CB, HAS_CD, SOFTCAP, cw, HAS_CW, HIT)
    p_offs = rm.to(tl.int64)[:, None] * stride_pm + rn.to(tl.int64)[None, :] * stride_pn
    if EVEN_N:  # every column is a vocab entry: no column mask anywhere (each 2-D op costs in this epilogue)
        p_mask = row_ok[:, None]
    else:  # padding columns are computed like the others and never stored
        p_mask = row_ok[:, None] & (rn < V)[None, :]
    tl.store(P + p_offs, g.to(P.dtype.element_ty), mask=p_mask)
    if SUM_EZ or TOP1:  # the metrics, where the logits GEMM's epilogue took the statistics (no statistics
        # pass): per tile sum_j p_j z_j and the maxima, every column but the target's (``grad_metrics``). The
        # maxima of the logits as stored: the cap and the scale keep their order and add no ties of rounding.
        # (Always with HIT: the metrics take no branch, ``_epilogue``.)
        stat = rm.to(tl.int64) * n_tiles + pid_n
        off = hit
        if not EVEN_N:
            off = off | (rn >= V)[None, :]
        if SUM_EZ:
            tl.store(TILE_EZ + stat, tl.sum(tl.where(off, 0.0, p * acc), axis=1), mask=row_ok)
        if TOP1:
            m_t = tl.max(tl.where(off, float("-inf"), stored), axis=1)
            tl.store(TILE_M + stat, m_t, mask=row_ok)
            tl.store(TILE_MB + stat, _max_before(stored, m_t, rm, rn, row_ok, TB, pid_n, BLOCK_N), mask=row_ok)


@triton.jit
def _epilogue(
    acc, rm, rn, pid_n,
    # pointers
    BIAS, TL, TILE_M, TILE_S, TILE_Z, TILE_EZ, ZT, P, RM, RLSE, RQ, CA, CB, CC, CD, CW, TILE_SQ, TILE_MB, TB,
    # shapes, strides, options
    M, V, n_tiles, stride_pm, stride_pn, softcap, inv_t,
    # meta
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, TEMPERATURE: tl.constexpr, GRAD: tl.constexpr,
    SUM_Z: tl.constexpr, SUM_EZ: tl.constexpr, HAS_CB: tl.constexpr,
    HAS_CD: tl.constexpr, HAS_CW: tl.constexpr, EVEN_N: tl.constexpr, SUM_SQ: tl.constexpr, TOP1: tl.constexpr,
    BLOCK_N: tl.constexpr, TARGET_APART: tl.constexpr, ROUND: tl.constexpr, SPLIT: tl.constexpr,
):
    """The softmax epilogue of one fp32 logits tile ``acc`` (rows ``rm``, columns ``rn``, stats tile ``pid_n``),
    whether the tile comes from the GEMM or from logits already in memory."""
    # -- bias, soft cap, temperature --
    row_ok = rm < M
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < V, other=0.0).to(tl.float32)[None, :]
    if ROUND:  # the logit as cuBLAS writes it: fp32 accumulation, the bias, one rounding to the inputs' dtype
        acc = acc.to(P.dtype.element_ty).to(tl.float32)
    t = tl.load(TL + rm, mask=row_ok, other=-1)
    cw = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_CW:  # per-class weights: the label-smoothing sum and gradient term weight each column
        cw = tl.load(CW + rn, mask=rn < V, other=0.0)
    if GRAD:
        lse_row = tl.load(RLSE + rm, mask=row_ok, other=0.0)
        q_row = tl.load(RQ + rm, mask=row_ok, other=0.0)
        ca = tl.load(CA + rm, mask=row_ok, other=0.0)
        cc = tl.load(CC + rm, mask=row_ok, other=0.0)
        cb = ca
        cd = ca
        m_row = ca
        if HAS_CB:
            cb = tl.load(CB + rm, mask=row_ok, other=0.0)
            m_row = tl.load(RM + rm, mask=row_ok, other=0.0)
        if HAS_CD:
            cd = tl.load(CD + rm, mask=row_ok, other=0.0)
        if SOFTCAP:  # the pass takes a quarter of the cap's slope: four times every coefficient (exact: a power of 2)
            ca, cb, cc, cd = 4.0 * ca, 4.0 * cb, 4.0 * cc, 4.0 * cd
        # ``SPLIT`` (over logits in memory, ``stored_logits``): most tiles hold none of their rows' target columns
        # and no padding, and take a version of the tile's code with no per-element compare with the target (a
        # branch uniform over the program). Not with the metrics: there the two versions' registers cost more than
        # the selects save (measured slower on both bench heads; docs/benchmarks.md); nor in the fused GEMM's
        # epilogue (``logits_tiles``), whose accumulator already holds most of the registers
        clear = False
        if SPLIT and not (SUM_EZ or TOP1):
            start = pid_n * BLOCK_N
            clear = tl.max((row_ok & (t >= start) & (t < start + BLOCK_N)).to(tl.int32), axis=0) == 0
            if not EVEN_N:
                clear = clear & (pid_n < n_tiles - 1)
        if clear:
            _grad_tile(acc, t, rm, rn, row_ok, pid_n, P, stride_pm, stride_pn, lse_row, q_row, m_row, ca, cb, cc, cd,
                       cw, softcap, inv_t, TILE_EZ, TILE_M, TILE_MB, TB, V, n_tiles, SOFTCAP, TEMPERATURE, HAS_CB,
                       HAS_CD, HAS_CW, EVEN_N, SUM_EZ, TOP1, BLOCK_N, False)
        else:
            _grad_tile(acc, t, rm, rn, row_ok, pid_n, P, stride_pm, stride_pn, lse_row, q_row, m_row, ca, cb, cc, cd,
                       cw, softcap, inv_t, TILE_EZ, TILE_M, TILE_MB, TB, V, n_tiles, SOFTCAP, TEMPERATURE, HAS_CB,
                       HAS_CD, HAS_CW, EVEN_N, SUM_EZ, TOP1, BLOCK_N, True)
    else:
        if SOFTCAP:  # the statistics need the value alone: its shortest form
            acc = _softcap_value(acc, softcap)
        if TEMPERATURE:
            acc = acc * inv_t
        hit = rn[None, :] == t[:, None]
        # -- online-softmax statistics of this tile: the max over every column, the sum of exp over every column
        # but the target's (its logit is kept apart in ZT) --
        z = acc
        if not EVEN_N:
            z = acc + tl.where(rn < V, 0.0, float("-inf"))[None, :]  # padding columns: -inf
        if TARGET_APART:  # ZT comes from target_logits: the rounded target logit takes no part, not even the max
            z = tl.where(hit, float("-inf"), z)
        m_t = tl.max(z, axis=1)
        e = _exp(z - tl.where(m_t == float("-inf"), 0.0, m_t)[:, None])  # an all -inf row gives 0, not NaN
        stat = rm.to(tl.int64) * n_tiles + pid_n
        tl.store(TILE_M + stat, m_t, mask=row_ok)
        if TARGET_APART:
            tl.store(TILE_S + stat, tl.sum(e, axis=1), mask=row_ok)
        else:
            tl.store(TILE_S + stat, tl.sum(tl.where(hit, 0.0, e), axis=1), mask=row_ok)
        if SUM_Z:
            zw = acc
            if HAS_CW:
                zw = acc * cw[None, :]
            tl.store(TILE_Z + stat, tl.sum(tl.where(rn[None, :] < V, zw, 0.0), axis=1), mask=row_ok)
        off_t = e == 0.0  # with TARGET_APART e is 0 at the target (and at -inf logits: no 0 * inf below)
        if not TARGET_APART:
            off_t = off_t | hit
        if SUM_EZ:
            tl.store(TILE_EZ + stat, tl.sum(tl.where(off_t, 0.0, e * acc), axis=1), mask=row_ok)
        if SUM_SQ:  # sum of exp(2 (z - m_t)) but the target's (log sum p^2)
            tl.store(TILE_SQ + stat, tl.sum(tl.where(off_t, 0.0, e * e), axis=1), mask=row_ok)
        if TOP1:  # max over the columns of a lower id than the target's (TB: how many of this shard's columns)
            tl.store(TILE_MB + stat, _max_before(acc, m_t, rm, rn, row_ok, TB, pid_n, BLOCK_N), mask=row_ok)
        if not TARGET_APART:
            zt = tl.sum(tl.where(hit, acc, 0.0), axis=1)
            mine = row_ok & (t >= pid_n * BLOCK_N) & (t < pid_n * BLOCK_N + BLOCK_N)
            tl.store(ZT + rm, zt, mask=mine)



@first_launch
@triton.heuristics({"EVEN_K": lambda a: a["D"] % a["BLOCK_K"] == 0,
                    "EVEN_N": lambda a: a["V"] % a["BLOCK_N"] == 0})
@triton.jit
def _logits_tiles_kernel(
    # pointers
    X, W, BIAS, TL, TILE_M, TILE_S, TILE_Z, TILE_EZ, ZT, P, RM, RLSE, RQ, CA, CB, CC, CD, CW, TILE_SQ, TILE_MB, TB,
    FLAG,
    # shapes
    M, V, D, n_tiles,
    # strides
    stride_xm, stride_xk, stride_wv, stride_wk, stride_pm, stride_pn,
    # options
    softcap, inv_t,
    # meta
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, TEMPERATURE: tl.constexpr, GRAD: tl.constexpr,
    SUM_Z: tl.constexpr, SUM_EZ: tl.constexpr, HAS_CB: tl.constexpr,
    HAS_CD: tl.constexpr, IEEE: tl.constexpr, TMA: tl.constexpr, HAS_CW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_N: tl.constexpr, SUM_SQ: tl.constexpr, TOP1: tl.constexpr,
    HAS_FLAG: tl.constexpr, ROUND: tl.constexpr,
):
    """Per ``[BLOCK_M, BLOCK_N]`` tile: the GEMM over D, then ``_epilogue``. ``HAS_FLAG`` (the speculative route's
    gated recompute, ``vpce.speculation``): a persistent grid whose programs first read ``FLAG[0]`` (int32) and
    return when it is 0, else walk the tiles ``pid, pid + grid, ...``; ``ROUND`` (with it only) rounds each logit to
    ``P``'s dtype before the epilogue, as cuBLAS wrote the logits whose statistics that route's forward took.
    Without them, one tile per program (the same loop, one trip): the kernel every other path compiles."""
    # -- grouped tile order: GROUP_M row blocks share each W tile while it sits in L2 --
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(V, BLOCK_N)
    width = GROUP_M * num_n
    last, step = tl.program_id(0) + 1, 1  # one tile per program
    if HAS_FLAG:  # persistent: tiles pid, pid + grid, ...; none while the flag is 0
        last = tl.where(tl.load(FLAG) != 0, num_m * num_n, 0)
        step = tl.num_programs(0)
    for pid in range(tl.program_id(0), last, step):
        first_m = (pid // width) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        pid_m = first_m + (pid % width) % size_m
        pid_n = (pid % width) // size_m
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)

        # -- logits tile: fp32 accumulation over D --
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if TMA:
            # X and W are tensor descriptors (Hopper's bulk copy engine); out-of-bounds reads come back as 0
            for k in range(0, tl.cdiv(D, BLOCK_K)):
                a = X.load([pid_m * BLOCK_M, k * BLOCK_K])
                b = W.load([pid_n * BLOCK_N, k * BLOCK_K])
                acc = tl.dot(a, b.T, acc)
        else:
            rk = tl.arange(0, BLOCK_K)
            # rows past the end read a valid row (wrapped) and are never stored: no masks in the K loop
            rm_load = (rm % M).to(tl.int64)
            rn_load = (rn % V).to(tl.int64)
            x_ptrs = X + rm_load[:, None] * stride_xm + rk[None, :] * stride_xk
            w_ptrs = W + rn_load[None, :] * stride_wv + rk[:, None] * stride_wk
            for k in range(0, tl.cdiv(D, BLOCK_K)):
                if EVEN_K:
                    a = tl.load(x_ptrs)
                    b = tl.load(w_ptrs)
                else:
                    a = tl.load(x_ptrs, mask=rk[None, :] < D - k * BLOCK_K, other=0.0)
                    b = tl.load(w_ptrs, mask=rk[:, None] < D - k * BLOCK_K, other=0.0)
                if IEEE:
                    acc = tl.dot(a, b, acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, b, acc)
                x_ptrs += BLOCK_K * stride_xk
                w_ptrs += BLOCK_K * stride_wk

        _epilogue(acc, rm, rn, pid_n, BIAS, TL, TILE_M, TILE_S, TILE_Z, TILE_EZ, ZT, P, RM, RLSE, RQ, CA, CB, CC, CD,
                  CW, TILE_SQ, TILE_MB, TB, M, V, n_tiles, stride_pm, stride_pn, softcap, inv_t, HAS_BIAS, SOFTCAP,
                  TEMPERATURE, GRAD, SUM_Z, SUM_EZ, HAS_CB, HAS_CD, HAS_CW, EVEN_N, SUM_SQ, TOP1, BLOCK_N, False, ROUND,
                  False)


@first_launch
@triton.heuristics({"EVEN_N": lambda a: a["V"] % a["BLOCK_N"] == 0})
@triton.jit
def _stored_logits_kernel(
    # pointers
    L, BIAS, TL, TILE_M, TILE_S, TILE_Z, TILE_EZ, ZT, RM, RLSE, RQ, CA, CB, CC, CD, CW, TILE_SQ, TILE_MB, TB,
    # shapes
    M, V, n_tiles,
    # strides
    stride_lm, stride_ln,
    # options
    softcap, inv_t,
    # meta
    HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, TEMPERATURE: tl.constexpr, GRAD: tl.constexpr,
    SUM_Z: tl.constexpr, SUM_EZ: tl.constexpr, HAS_CB: tl.constexpr, HAS_CD: tl.constexpr, HAS_CW: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr, SUM_SQ: tl.constexpr, TOP1: tl.constexpr,
):
    """The epilogue over logits a GEMM already wrote to ``L`` (one stats tile per program): stats mode reads the
    tile, grad mode overwrites it with the gradient."""
    rm, rn, _, mask = _program_tile(M, V, BLOCK_M, BLOCK_N, EVEN_N)
    offs = rm.to(tl.int64)[:, None] * stride_lm + rn.to(tl.int64)[None, :] * stride_ln
    acc = tl.load(L + offs, mask=mask, other=0.0).to(tl.float32)
    _epilogue(acc, rm, rn, tl.program_id(1), BIAS, TL, TILE_M, TILE_S, TILE_Z, TILE_EZ, ZT, L, RM, RLSE, RQ, CA, CB,
              CC, CD, CW, TILE_SQ, TILE_MB, TB, M, V, n_tiles, stride_lm, stride_ln, softcap, inv_t, HAS_BIAS, SOFTCAP,
              TEMPERATURE, GRAD, SUM_Z, SUM_EZ, HAS_CB, HAS_CD, HAS_CW, EVEN_N, SUM_SQ, TOP1, BLOCK_N, True, False,
              True)


@first_launch
@triton.jit
def _target_logits_kernel(X, W, BIAS, TL, ZT, L, ZS, M, D, stride_xm, stride_xk, stride_wv, stride_wk, stride_lm,
                          stride_ln, softcap, inv_t, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
                          TEMPERATURE: tl.constexpr, STORED: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """``ZT[row] = z`` of the row's target column from ``X[row] . W[t]`` in fp32 (``-inf`` where ``t < 0``): the
    target logit never goes through the 16-bit logits buffer. ``STORED``: also ``ZS[row]``, the target logit as
    the logits buffer ``L`` holds it (through the epilogue's soft cap and temperature), for the argmax test."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rm < M
    t = tl.load(TL + rm, mask=row_ok, other=-1)
    mine = row_ok & (t >= 0)
    if STORED:  # one element per row, read before the K loop
        zs = tl.load(L + rm.to(tl.int64) * stride_lm + tl.where(mine, t, 0).to(tl.int64) * stride_ln, mask=mine,
                     other=0.0).to(tl.float32)
        if SOFTCAP:
            zs = _softcap_value(zs, softcap)  # as the statistics pass caps the stored logits
        if TEMPERATURE:
            zs = zs * inv_t
        tl.store(ZS + rm, tl.where(mine, zs, float("-inf")), mask=row_ok)
    rk = tl.arange(0, BLOCK_K)
    x_ptrs = X + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :] * stride_xk
    w_ptrs = W + tl.where(mine, t, 0).to(tl.int64)[:, None] * stride_wv + rk[None, :] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_K], tl.float32)
    for k in range(0, tl.cdiv(D, BLOCK_K)):
        msk = mine[:, None] & (rk[None, :] < D - k * BLOCK_K)
        a = tl.load(x_ptrs, mask=msk, other=0.0).to(tl.float32)
        b = tl.load(w_ptrs, mask=msk, other=0.0).to(tl.float32)
        acc += a * b
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    z = tl.sum(acc, axis=1)
    if HAS_BIAS:
        z += tl.load(BIAS + t, mask=mine, other=0.0).to(tl.float32)
    if SOFTCAP:
        z = _softcap_value(z, softcap)
    if TEMPERATURE:
        z = z * inv_t
    tl.store(ZT + rm, tl.where(mine, z, float("-inf")), mask=row_ok)


@first_launch
@triton.jit
def _target_out_of_lse_kernel(LSE, ZT, S, ZS, C, softcap, inv_t, SOFTCAP: tl.constexpr, TEMPERATURE: tl.constexpr,
                              ROUND: tl.constexpr, STORED: tl.constexpr, BLOCK: tl.constexpr):
    """Per row: ``S = 1 - e^(zs - LSE)``, the share of the row's softmax mass (``LSE`` over every column as the
    logits buffer holds them) outside the target column, whose logit as stored is ``zs`` (``ZT`` rounded to the
    buffer's dtype, ``ROUND``: 1 bf16, 2 fp16, 0 none; capped and scaled as the statistics pass takes it); then
    ``ZT`` becomes the exact (capped and scaled) fp32 target logit; ``STORED``: ``ZS`` the target logit as stored,
    before the cap and scale (``-inf`` where none), for the gradient pass's argmax test. ``-inf`` in ``ZT``
    (no target here) gives ``S = 1``; a NaN stays NaN; a share rounded above 1 gives 0 (the empty rest)."""
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = rows < C
    m = tl.load(LSE + rows, mask=ok, other=0.0)
    z = tl.load(ZT + rows, mask=ok, other=float("-inf"))
    here = z != float("-inf")
    if ROUND == 1:
        zs = z.to(tl.bfloat16).to(tl.float32)
    elif ROUND == 2:
        zs = z.to(tl.float16).to(tl.float32)
    else:
        zs = z
    if STORED:
        tl.store(ZS + rows, tl.where(here, zs, float("-inf")), mask=ok)
    if SOFTCAP:
        z = _softcap_value(z, softcap)
        zs = _softcap_value(zs, softcap)
    if TEMPERATURE:
        z = z * inv_t
        zs = zs * inv_t
    share = tl.where(here, _exp(zs - m), 0.0)
    tl.store(S + rows, tl.where(share > 1.0, 0.0, 1.0 - share), mask=ok)
    tl.store(ZT + rows, tl.where(here, z, float("-inf")), mask=ok)


@first_launch
@triton.jit
def _grad_metrics_kernel(TEZ, TM, TMB, LSE, ZT, ZS, ENT, TOP, C, T, ENTROPY: tl.constexpr, TOP1: tl.constexpr,
                         PARTIAL: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """Per row, over the gradient pass's ``T`` tiles: ``ENT = lse - sum_j p_j z_j`` (the tiles' sums, every column
    but the target's, plus the target's exact term ``p_t zt``; with ``PARTIAL`` that sum alone), and ``TOP`` 1.0
    where the target's logit as stored is the argmax with ties to the lowest id (``>=`` every other column's max,
    ``>`` the max before it), else 0.0, all of them the logits as stored (before the cap and scale, which keep the
    order): the formulas of ``combine_rank_stats`` for one process."""
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = rows < C
    base = rows.to(tl.int64) * T
    ez = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    mx = tl.full([BLOCK_C, BLOCK_T], float("-inf"), tl.float32)
    mb = tl.full([BLOCK_C, BLOCK_T], float("-inf"), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        cols = t0 + tl.arange(0, BLOCK_T)
        msk = ok[:, None] & (cols < T)[None, :]
        offs = base[:, None] + cols[None, :]
        if ENTROPY:
            ez += tl.load(TEZ + offs, mask=msk, other=0.0)
        if TOP1:
            mx = tl.maximum(mx, tl.load(TM + offs, mask=msk, other=float("-inf")))
            mb = tl.maximum(mb, tl.load(TMB + offs, mask=msk, other=float("-inf")))
    lse = tl.load(LSE + rows, mask=ok, other=0.0)
    if ENTROPY:
        zt = tl.load(ZT + rows, mask=ok, other=float("-inf"))
        e_t = _exp(zt - lse)
        pz = tl.sum(ez, 1) + tl.where(e_t == 0.0, 0.0, e_t * zt)
        if PARTIAL:
            tl.store(ENT + rows, pz, mask=ok)
        else:
            tl.store(ENT + rows, lse - pz, mask=ok)
    if TOP1:  # a NaN LSE (the agreement's poison) gives 0, as the combine's compare with a poisoned max does
        zs = tl.load(ZS + rows, mask=ok, other=float("-inf"))
        hit = (zs >= tl.max(mx, 1)) & (zs > tl.max(mb, 1)) & (lse == lse)
        tl.store(TOP + rows, tl.where(hit, 1.0, 0.0), mask=ok)


@first_launch
@triton.jit
def _reduce_tiles_kernel(TM, TS, TZ, TEZ, ZT, OUT, C, T, SUM_Z: tl.constexpr, SUM_EZ: tl.constexpr,
                         BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr, TSQ, TMB, SUM_SQ: tl.constexpr,
                         TOP1: tl.constexpr, ROW_SQ: tl.constexpr, ROW_MB: tl.constexpr, TTS):
    """Per row, over its ``T`` tiles: ``m = max m_t``, ``s = sum s_t exp(m_t - m)``, ``sum z``, ``sum ez_t exp(m_t
    - m)``, ``sum sq_t exp(2 (m_t - m))``, ``max mb_t``; packed with the target logit into ``OUT [k, C]`` as (m, s,
    zt[, sum z][, sum ez][, sum sq][, max before, target logit as stored (``TTS``)])."""
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = rows < C
    base = rows.to(tl.int64) * T
    # accumulated elementwise over [BLOCK_C, BLOCK_T] and reduced once after each loop (_tiles_max says why)
    m, m_safe = _tiles_max(TM, base, ok, T, BLOCK_C, BLOCK_T)
    s2 = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    z2 = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    ez2 = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    sq2 = tl.zeros([BLOCK_C, BLOCK_T], tl.float32)
    mb2 = tl.full([BLOCK_C, BLOCK_T], float("-inf"), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        cols = t0 + tl.arange(0, BLOCK_T)
        msk = ok[:, None] & (cols < T)[None, :]
        offs = base[:, None] + cols[None, :]
        mt = tl.load(TM + offs, mask=msk, other=float("-inf"))
        r = tl.where(msk, _exp(mt - m_safe[:, None]), 0.0)  # NaN in m_t (or s_t) stays NaN
        s2 += tl.load(TS + offs, mask=msk, other=0.0) * r
        if SUM_Z:
            z2 += tl.load(TZ + offs, mask=msk, other=0.0)
        if SUM_EZ:
            ez2 += tl.load(TEZ + offs, mask=msk, other=0.0) * r
        if SUM_SQ:
            sq2 += tl.load(TSQ + offs, mask=msk, other=0.0) * (r * r)
        if TOP1:
            mb2 = tl.maximum(mb2, tl.load(TMB + offs, mask=msk, other=float("-inf")))
    s = tl.sum(s2, 1)
    z = tl.sum(z2, 1)
    ez = tl.sum(ez2, 1)
    tl.store(OUT + rows, m, mask=ok)
    tl.store(OUT + C + rows, s, mask=ok)
    tl.store(OUT + 2 * C + rows, tl.load(ZT + rows, mask=ok, other=0.0), mask=ok)
    if SUM_Z:
        tl.store(OUT + 3 * C + rows, z, mask=ok)
        if SUM_EZ:
            tl.store(OUT + 4 * C + rows, ez, mask=ok)
    elif SUM_EZ:
        tl.store(OUT + 3 * C + rows, ez, mask=ok)
    if SUM_SQ:
        tl.store(OUT + ROW_SQ * C + rows, tl.sum(sq2, 1), mask=ok)
    if TOP1:
        tl.store(OUT + ROW_MB * C + rows, tl.max(mb2, 1), mask=ok)
        tl.store(OUT + (ROW_MB + 1) * C + rows, tl.load(TTS + rows, mask=ok, other=0.0), mask=ok)


@first_launch
@triton.jit
def _combine_rank_stats_kernel(EVERY, OUT, POISON, C, W, R, N_SUMS: tl.constexpr, N_W: tl.constexpr,
                               HAS_POISON: tl.constexpr, BLOCK_C: tl.constexpr, SUM_SQ: tl.constexpr,
                               TOP1: tl.constexpr):
    """``EVERY [W, R, C]`` (each rank's packed statistics: max, sum of exp but the target's, target logit, sums,
    weighted sums, sum of squares, max before the target, the target logit as the statistics' logits hold it) ->
    ``OUT [R + 1 - TOP1, C]``: ``M``, ``log S``, ``-log p_t``,
    ``1 - p_t``, the summed additive statistics, the softmax expectations, ``log sum p^2``, the argmax indicator
    (the formulas of ``vpce.parallel``)."""
    rows = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = rows < C
    m = tl.full([BLOCK_C], float("-inf"), tl.float32)
    t = tl.full([BLOCK_C], float("-inf"), tl.float32)
    for w in range(0, W):
        m = tl.maximum(m, tl.load(EVERY + w * R * C + rows, mask=ok, other=0.0))
        t = tl.maximum(t, tl.load(EVERY + (w * R + 2) * C + rows, mask=ok, other=0.0))
    mo = m  # the max over every column but the target's (a rank's max may leave the target out)
    m = tl.maximum(m, t)
    if HAS_POISON:
        m = m + tl.load(POISON)
        mo = mo + tl.load(POISON)
    safe = tl.where(m == float("-inf"), 0.0, m)
    x = tl.zeros([BLOCK_C], tl.float32)
    for w in range(0, W):
        r = _exp(tl.load(EVERY + w * R * C + rows, mask=ok, other=0.0) - safe)
        x += tl.load(EVERY + (w * R + 1) * C + rows, mask=ok, other=0.0) * r
    e_t = _exp(t - safe)
    s = x + e_t
    log_s = tl.log(s)
    d = m - t
    nll = tl.where(d <= 20.0, _log1p(x * _exp(tl.minimum(d, 20.0))), d + log_s)
    tl.store(OUT + rows, m, mask=ok)
    tl.store(OUT + C + rows, log_s, mask=ok)
    tl.store(OUT + 2 * C + rows, nll, mask=ok)
    tl.store(OUT + 3 * C + rows, x / s, mask=ok)
    for i in tl.static_range(N_SUMS):
        acc = tl.zeros([BLOCK_C], tl.float32)
        for w in range(0, W):
            acc += tl.load(EVERY + (w * R + 3 + i) * C + rows, mask=ok, other=0.0)
        tl.store(OUT + (4 + i) * C + rows, acc, mask=ok)
    for j in tl.static_range(N_W):
        acc = tl.zeros([BLOCK_C], tl.float32)
        for w in range(0, W):
            r = _exp(tl.load(EVERY + w * R * C + rows, mask=ok, other=0.0) - safe)
            acc += tl.load(EVERY + (w * R + 3 + N_SUMS + j) * C + rows, mask=ok, other=0.0) * r
        acc += tl.where(e_t == 0.0, 0.0, e_t * t)  # the target's term of sum_j exp(z_j - M) z_j
        tl.store(OUT + (4 + N_SUMS + j) * C + rows, acc / s, mask=ok)
    row = 3 + N_SUMS + N_W
    if SUM_SQ:
        acc = e_t * e_t
        for w in range(0, W):
            r = _exp(tl.load(EVERY + w * R * C + rows, mask=ok, other=0.0) - safe)
            acc += tl.load(EVERY + (w * R + row) * C + rows, mask=ok, other=0.0) * (r * r)
        tl.store(OUT + (row + 1) * C + rows, tl.log(acc) - 2.0 * log_s, mask=ok)
        row += 1
    if TOP1:  # judged on the logits the statistics came from: the target's as they hold it (row + 1)
        mb = tl.full([BLOCK_C], float("-inf"), tl.float32)
        ts = tl.full([BLOCK_C], float("-inf"), tl.float32)
        for w in range(0, W):
            mb = tl.maximum(mb, tl.load(EVERY + (w * R + row) * C + rows, mask=ok, other=0.0))
            ts = tl.maximum(ts, tl.load(EVERY + (w * R + row + 1) * C + rows, mask=ok, other=0.0))
        tl.store(OUT + (row + 1) * C + rows, tl.where((ts >= mo) & (ts > mb), 1.0, 0.0), mask=ok)


# ------------------------------------------------------------------------------------------------------------
# launchers


def _config(x: torch.Tensor) -> dict:
    """Block shapes per device class; a fixed small config under the interpreter (no autotuning on CPU)."""
    if INTERPRET or not x.is_cuda:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=16, GROUP_M=4, num_warps=4, num_stages=1)
    if x.dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)


def _use_tma(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Tensor descriptors need Hopper or newer, 16-bit operands, and 16-byte aligned rows and bases."""
    if INTERPRET or not x.is_cuda or TensorDescriptor is None or x.dtype == torch.float32:
        return False
    if torch.cuda.get_device_capability(x.device)[0] < 9:
        return False
    def ok(t):
        return t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0
    return ok(x) and ok(w)


def tile_n(x: torch.Tensor) -> int:
    """Columns per stats tile for inputs like ``x``."""
    return _config(x)["BLOCK_N"]


def logits_tiles(x, w, b, t_local, *, folded=Folded(), tile_m=None, tile_s=None, tile_z=None,
                 tile_ez=None, zt=None, p=None, rows=None, coef=None, config=None, class_weight=None, tile_sq=None,
                 tile_mb=None, before=None, flag=None, round_logits=False):
    """Launch the GEMM + epilogue over ``x [M, D]`` and ``w [V, D]`` (``t_local``: int32 local target column,
    -1 where the target is not in this shard).

    Stats mode (``rows is None``) fills ``tile_m``, ``tile_s`` (the max over every column, the sum of exp over
    every column but the target's; ``tile_z``: sum of every logit, ``tile_ez``: sum of exp * logit but the
    target's) ``[M, n_tiles]`` and ``zt [M]`` (callers fill it with ``-inf``). Metrics: ``tile_sq`` gets the sum
    of ``exp(2 (z - m_t))`` but the target's, ``tile_mb`` the max over the columns below ``before`` (int32 ``[M]``:
    how many of this shard's columns have a lower global id than the target). Grad mode (``rows``: the global
    ``(M, lse, 1 - p_t)`` per row, and ``coef = (a, b, c, d)``, per-row fp32 vectors, ``b``/``d`` may be None)
    writes the gradient into ``p``. ``folded``: the soft cap and the multiplier after it (``vpce.options.Folded``).
    ``class_weight`` (fp32 ``[V]``, per column): ``tile_z`` becomes the weighted sum ``sum w_j z_j`` and grad
    mode's ``d`` term ``d w_j``. ``config`` overrides the block shapes (for ``launch/tune_kernels.py``).
    ``flag`` (int32, one element on the device): the launch does nothing where it holds 0 (no host read); with it,
    ``round_logits`` rounds each logit to ``p``'s dtype first (grad mode after statistics of cuBLAS logits).
    """
    m, d = x.shape
    v = w.shape[0]
    if m == 0 or v == 0:
        return
    softcap, inv_t = folded.softcap, folded.inv_t
    cfg = dict(config or _config(x))
    tma = cfg.pop("TMA", _use_tma(x, w))
    bn = cfg["BLOCK_N"]
    n_tiles = triton.cdiv(v, bn)
    grad = rows is not None
    pick, (rm, rls, rq), (ca, cb, cc, cd) = _epilogue_operands(x, rows, coef)
    out = p if p is not None else x.new_empty(0)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * n_tiles,)
    if flag is not None:
        grid = (_persistent(x, grid[0]),)
    xa, wa = x, w
    if tma:
        xa = TensorDescriptor.from_tensor(x, [cfg["BLOCK_M"], cfg["BLOCK_K"]])
        wa = TensorDescriptor.from_tensor(w, [bn, cfg["BLOCK_K"]])
    _logits_tiles_kernel[grid](
        xa, wa, pick(b), t_local, pick(tile_m), pick(tile_s), pick(tile_z), pick(tile_ez), pick(zt), out,
        pick(rm), pick(rls), pick(rq), pick(ca), pick(cb), pick(cc), pick(cd), pick(class_weight), pick(tile_sq),
        pick(tile_mb), t_local if before is None else before, t_local if flag is None else flag,
        m, v, d, n_tiles,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        out.stride(0) if p is not None else 0, out.stride(1) if p is not None else 0,
        float(softcap or 1.0), float(inv_t),
        HAS_BIAS=b is not None, SOFTCAP=softcap is not None, TEMPERATURE=inv_t != 1.0, GRAD=grad,
        SUM_Z=tile_z is not None, SUM_EZ=tile_ez is not None,
        HAS_CB=cb is not None, HAS_CD=cd is not None, IEEE=x.dtype == torch.float32, TMA=tma,
        HAS_CW=class_weight is not None and (tile_z is not None or (grad and cd is not None)),
        SUM_SQ=tile_sq is not None, TOP1=tile_mb is not None, HAS_FLAG=flag is not None,
        ROUND=flag is not None and round_logits, **cfg,
    )


def _epilogue_operands(like: torch.Tensor, rows, coef):
    """The softmax epilogue's per-row operands for one launch (``logits_tiles``, ``stored_logits``): ``(pick,
    (m, lse, 1 - p_t), (a, b, c, d))``, the tuples of Nones in stats mode (``rows`` None); ``pick`` stands an empty
    fp32 tensor on ``like``'s device in for a None (a pointer argument the kernel's flags leave unread)."""
    dummy = like.new_empty(0, dtype=torch.float32)
    grad = rows is not None
    return (lambda t: dummy if t is None else t), (rows if grad else (None,) * 3), (coef if grad else (None,) * 4)


def stored_logits(logits, b, t_local, *, folded=Folded(), tile_m=None, tile_s=None, tile_z=None,
                  tile_ez=None, zt=None, rows=None, coef=None, class_weight=None, tile_sq=None, tile_mb=None,
                  before=None, block_n=None, block_m=None, num_warps=None):
    """``logits_tiles``'s epilogue over ``logits [M, V]`` that a GEMM already wrote (the inputs' dtype; ``b`` is
    added here, None if the GEMM added it): stats mode fills the same buffers as ``logits_tiles`` but ``zt``, and
    leaves the target column out of the tile max too (``target_logits`` gives its exact logit, and the logit as
    stored for the argmax test), grad mode
    (``rows``, ``coef``) overwrites ``logits`` with the gradient. One bandwidth-bound pass; ``block_n`` is the stats
    tile width (``tile_n``); ``block_m`` / ``num_warps`` override the launch shape (``launch/tune_kernels.py``)."""
    m, v = logits.shape
    if m == 0 or v == 0:
        return
    softcap, inv_t = folded.softcap, folded.inv_t
    bn = block_n or tile_n(logits)
    n_tiles = triton.cdiv(v, bn)
    grad = rows is not None
    pick, (rm, rls, rq), (ca, cb, cc, cd) = _epilogue_operands(logits, rows, coef)
    gpu = logits.is_cuda and not INTERPRET
    # 256 columns per program, 4 warps (launch/tune_kernels.py picked them; 8 warps were slower). Stats: 16 rows,
    # near the memory's bandwidth. Gradient: 8 rows, as fast as 16 on the plain pass and faster with the soft cap and
    # the other options, whose registers 16 rows would raise past the plain pass's (docs/benchmarks.md)
    block_m = block_m or ((8 if grad else 16) if gpu else 32)  # the interpreter: fewer, larger programs
    _stored_logits_kernel[(triton.cdiv(m, block_m), n_tiles)](
        logits, pick(b), t_local, pick(tile_m), pick(tile_s), pick(tile_z), pick(tile_ez), pick(zt),
        pick(rm), pick(rls), pick(rq), pick(ca), pick(cb), pick(cc), pick(cd), pick(class_weight), pick(tile_sq),
        pick(tile_mb), t_local if before is None else before,
        m, v, n_tiles, logits.stride(0), logits.stride(1), float(softcap or 1.0), float(inv_t),
        HAS_BIAS=b is not None, SOFTCAP=softcap is not None, TEMPERATURE=inv_t != 1.0, GRAD=grad,
        SUM_Z=tile_z is not None, SUM_EZ=tile_ez is not None, HAS_CB=cb is not None, HAS_CD=cd is not None,
        HAS_CW=class_weight is not None and (tile_z is not None or (grad and cd is not None)),
        SUM_SQ=tile_sq is not None, TOP1=tile_mb is not None, BLOCK_M=block_m, BLOCK_N=bn,
        num_warps=num_warps or 4,
    )


def target_logits(x, w, b, t_local, zt, *, folded=Folded(), logits=None, zs=None):
    """``zt [M] = cap(x . w[t] + b[t]) / T`` in fp32 for each row's local target column ``t_local`` (``-inf``
    where it is -1): the exact target logit beside ``stored_logits``' 16-bit logits. With ``zs`` (and the
    ``logits`` buffer) also the target logit as ``logits`` holds it, through the same soft cap and temperature as
    ``stored_logits``' epilogue: the argmax test compares it with the other stored logits on equal terms."""
    m, d = x.shape
    if m == 0:
        return
    softcap, inv_t = folded.softcap, folded.inv_t
    gpu = x.is_cuda and not INTERPRET
    block_m, block_k = (16, 256) if gpu else (32, 32)
    stored = zs is not None
    ls = logits if stored else x
    _target_logits_kernel[(triton.cdiv(m, block_m),)](
        x, w, x if b is None else b, t_local, zt, ls, zs if stored else zt, m, d, x.stride(0), x.stride(1),
        w.stride(0), w.stride(1), ls.stride(0), ls.stride(1), float(softcap or 1.0), float(inv_t),
        HAS_BIAS=b is not None, SOFTCAP=softcap is not None, TEMPERATURE=inv_t != 1.0, STORED=stored,
        BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4)


def target_out_of_lse(lse, zt, s, stored_dtype, *, folded=Folded(), zs=None):
    """For the statistics a logits GEMM's epilogue took (``vpce.backends.gemm.logits_with_stats``): ``lse [C]``, the
    log-sum-exp of every column's logit as the buffer holds them (``stored_dtype``), and ``zt [C]``, the target
    column's raw fp32 logit (``-inf`` where the target is elsewhere). Writes ``s [C]``, the share of the row's
    mass outside the target column, and caps and scales ``zt`` in place: ``(lse, s)`` is then one tile of the
    statistics pass (the target column left out) and ``zt`` what ``target_logits`` gives, for ``reduce_tiles``.
    One launch. Where the target holds nearly all of the row's mass, ``s`` keeps an absolute error of the LSE's
    own rounding (about 1e-7 of the row's sum), not of the rest alone; far below the rounding of the bf16 logits.
    ``zs``: also the target logit as stored, before the cap and scale, for ``grad_metrics``' argmax test."""
    c = lse.shape[0]
    if c == 0:
        return
    softcap, inv_t = folded.softcap, folded.inv_t
    block = 256 if lse.is_cuda and not INTERPRET else 64
    rnd = {torch.bfloat16: 1, torch.float16: 2}.get(stored_dtype, 0)
    _target_out_of_lse_kernel[(triton.cdiv(c, block),)](
        lse, zt, s, s if zs is None else zs, c, float(softcap or 1.0), float(inv_t), SOFTCAP=softcap is not None,
        TEMPERATURE=inv_t != 1.0, ROUND=rnd, STORED=zs is not None, BLOCK=block, num_warps=4)


def grad_metrics(lse, zt, *, tile_ez=None, tile_m=None, tile_mb=None, zs=None, partial=False):
    """The entropy ``[C]`` (with ``tile_ez``) and the argmax indicator ``[C]`` (with ``tile_m``, ``tile_mb``,
    ``zs``) of rows whose metrics the gradient pass took, from the tiles ``stored_logits``' gradient pass filled
    (its ``tile_ez``, ``tile_m``, ``tile_mb``, ``before``), the final ``lse`` and the exact target logit ``zt``;
    None for what is not asked. One launch; the sums are this rank's: under a group ``partial`` gives, in place of
    the entropy, this rank's share of ``sum_j p_j z_j``, which the caller sums over the ranks (the argmax test is
    one process's only)."""
    c = lse.shape[0]
    ent = torch.empty(c, dtype=torch.float32, device=lse.device) if tile_ez is not None else None
    top = torch.empty(c, dtype=torch.float32, device=lse.device) if tile_mb is not None else None
    some = tile_ez if tile_ez is not None else tile_m
    if c and some is not None:
        block_c = 16 if INTERPRET or not lse.is_cuda else 64
        pick = lambda x: some if x is None else x  # noqa: E731
        _grad_metrics_kernel[(triton.cdiv(c, block_c),)](
            pick(tile_ez), pick(tile_m), pick(tile_mb), lse, zt, pick(zs), pick(ent), pick(top), c, some.shape[1],
            ENTROPY=tile_ez is not None, TOP1=tile_mb is not None, PARTIAL=partial, BLOCK_C=block_c, BLOCK_T=32,
            num_warps=4)
    return ent, top


def reduce_tiles(tile_m, tile_s, tile_z, tile_ez, zt, tile_sq=None, tile_mb=None, zt_stored=None) -> torch.Tensor:
    """One chunk's per-tile statistics ``[C, n_tiles]`` (and ``zt [C]``) -> this rank's packed ``[k, C]`` fp32
    (m, s, zt[, sum z][, sum ez][, sum sq][, max before, target logit]): one launch instead of a dozen small torch
    ops. With ``tile_mb`` the last row is the target logit as the tiles' logits hold it, for the argmax test:
    ``zt_stored`` where ``zt`` was computed apart (the fast route's fp32 target logit beside rounded logits), else
    ``zt`` itself."""
    c, t = tile_m.shape
    row_sq = 3 + (tile_z is not None) + (tile_ez is not None)
    row_mb = row_sq + (tile_sq is not None)
    k = row_mb + 2 * (tile_mb is not None)
    out = torch.empty(k, c, dtype=torch.float32, device=tile_m.device)
    if c:
        block_c = 16 if INTERPRET or not tile_m.is_cuda else 64
        pick = lambda x: tile_s if x is None else x  # noqa: E731
        _reduce_tiles_kernel[(triton.cdiv(c, block_c),)](
            tile_m, tile_s, pick(tile_z), pick(tile_ez), zt, out,
            c, t, SUM_Z=tile_z is not None, SUM_EZ=tile_ez is not None, BLOCK_C=block_c, BLOCK_T=32,
            TSQ=pick(tile_sq), TMB=pick(tile_mb), SUM_SQ=tile_sq is not None, TOP1=tile_mb is not None,
            ROW_SQ=row_sq, ROW_MB=row_mb, TTS=zt if zt_stored is None else zt_stored, num_warps=4)
    return out


def combine_rank_stats(every: torch.Tensor, n_sums: int, poison: torch.Tensor | None = None, sum_sq: bool = False,
                       max_before: bool = False) -> RankStats:
    """Every rank's packed statistics ``[W, R, C]`` -> ``vpce.rank_stats.RankStats`` in one launch (the same
    formulas as ``vpce.rank_stats.combine_rank_stats``)."""
    w, r, c = every.shape
    n_w = r - 3 - n_sums - sum_sq - 2 * max_before
    out = torch.empty(r + 1 - max_before, c, dtype=torch.float32, device=every.device)
    if c:
        block_c = 16 if INTERPRET or not every.is_cuda else 256
        _combine_rank_stats_kernel[(triton.cdiv(c, block_c),)](
            every.contiguous(), out, out if poison is None else poison, c, w, r, N_SUMS=n_sums,
            N_W=n_w, HAS_POISON=poison is not None, BLOCK_C=block_c, SUM_SQ=sum_sq, TOP1=max_before,
            num_warps=4)
    row = 4 + n_sums + n_w
    return RankStats(out[0], out[1], out[2], out[3], [out[4 + i] for i in range(n_sums)],
                     [out[4 + n_sums + j] for j in range(n_w)], out[row] if sum_sq else None,
                     out[row + sum_sq] if max_before else None)
