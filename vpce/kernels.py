"""Triton kernels: the lm_head GEMM with a softmax epilogue, the same epilogue over logits cuBLAS already wrote,
the exact target logit, the per-row reduction of the tile statistics, the combine of every rank's statistics, and
a one-pass scale-and-cast.

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
on the host (``vpce.formulas``; they include the upstream gradient, the temperature and the token weight)::

    dL/dx_j = (p_j (a + b (z_j - M)) + d) * dcap_j,   dL/dx_t = ((a + c) - a q + b (z_t - M) p_t + d) * dcap_t

with ``p_j = exp(z_j - lse)``, ``q = 1 - p_t`` and ``dcap = sech^2(x / c)``. A tile whose logits are all ``-inf``
contributes 0 (``exp`` is taken against 0 there, not ``-inf``).

For the speculative route (``vpce.speculation``): ``row_scale_cast`` scales each row of an fp32 ``[N, D]`` by its
token's upstream gradient and casts it; ``gated_weight_grad_`` is a small GEMM ``dW += P^T X`` (and ``db``) that,
like ``logits_tiles`` given a ``flag``, first reads a device flag and does nothing when it is 0, so that a
recompute the host cannot know is needed costs only its launches when it is not.

Everything is deterministic (plain stores, no atomics) and runs under ``TRITON_INTERPRET=1`` on the CPU.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .parallel import RankStats

try:  # host-side TMA descriptors (Triton >= 3.3)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: pointer loads only
    TensorDescriptor = None

__all__ = ["logits_tiles", "stored_logits", "target_logits", "reduce_tiles", "combine_rank_stats", "scale_cast",
           "row_scale_cast", "gated_weight_grad_", "gated_scale_", "tile_n", "INTERPRET"]

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # log2(e)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)    # ln(2)


@triton.jit
def _exp(x):
    """``e^x`` as one multiply and the hardware ``ex2`` (results below 2^-126 flush to 0): ``tl.exp`` adds a range
    test and two predicated multiplies per element to keep such denormals, five instructions instead of two on
    sm_90, in kernels that are short of issue slots (the JSD's mixture pass, the statistics passes)."""
    return tl.exp2(x * LOG2E)


@triton.jit
def _softcap(x, softcap):
    """``softcap * tanh(x / softcap)`` and its derivative ``sech^2``, both from ``e = exp(-2|u|)``: no
    cancellation in the derivative where the cap saturates (``1 - tanh^2`` would lose it all). One division,
    ``1 / (1 + e)``, serves both (Triton's fp32 ``/`` is the two-ulp ``div.full``), and ``x / softcap`` is a
    multiply: three divisions per element made the soft cap the slowest option of the bandwidth passes."""
    u = x * (1.0 / softcap)
    e = _exp(-2.0 * tl.abs(u))
    r = 1.0 / (1.0 + e)
    th = (1.0 - e) * r
    return softcap * tl.where(u >= 0, th, -th), 4.0 * e * (r * r)


@triton.jit
def _log1p(u):
    """``log(1 + u)`` for ``u >= 0`` without losing a small ``u`` (Goldberg's correction)."""
    v = 1.0 + u
    return tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))


@triton.jit
def _dlogits(p, zc, hit, ca, cb, cc, cd, q, dcap, HAS_CB: tl.constexpr, HAS_CD: tl.constexpr,
             SOFTCAP: tl.constexpr, cw, HAS_CW: tl.constexpr):
    """The gradient of ``vpce.formulas`` for a tile: ``p (a + b zc) + d`` off the target, ``(a + c) - a q
    + b zc p + d`` at it (``zc = z - M``, ``q = 1 - p_t``), times ``dcap``; with class weights ``d`` is times the
    column's weight ``cw``."""
    at_t = ca + cc - ca * q
    if HAS_CB:
        bz = cb[:, None] * zc
        g = tl.where(p == 0.0, 0.0, p * (ca[:, None] + bz))  # p = 0 at z = -inf: no 0 * inf
        g = tl.where(hit, at_t[:, None] + tl.where(p == 0.0, 0.0, bz * p), g)
    else:
        g = tl.where(hit, at_t[:, None], p * ca[:, None])
    if HAS_CD:
        if HAS_CW:
            g = g + cd[:, None] * cw[None, :]
        else:
            g = g + cd[:, None]
    if SOFTCAP:
        g = g * dcap
    return g  # padding columns hold garbage here: every caller's store masks them


@triton.jit
def _logits_tile(
    pid_m, pid_n,
    # pointers
    X, W, BIAS, TL, TILE_M, TILE_S, TILE_Z, TILE_EZ, ZT, P, RM, RLSE, RQ, CA, CB, CC, CD, CW, TILE_SQ, TILE_MB, TB,
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
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr, SUM_SQ: tl.constexpr, TOP1: tl.constexpr, ROUND: tl.constexpr,
):
    """One [BLOCK_M, BLOCK_N] tile: the GEMM over D, then the epilogue."""
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

    _epilogue(acc, rm, rn, pid_n, BIAS, TL, TILE_M, TILE_S, TILE_Z, TILE_EZ, ZT, P, RM, RLSE, RQ, CA, CB, CC, CD, CW,
              TILE_SQ, TILE_MB, TB, M, V, n_tiles, stride_pm, stride_pn, softcap, inv_t, HAS_BIAS, SOFTCAP,
              TEMPERATURE, GRAD, SUM_Z, SUM_EZ, HAS_CB, HAS_CD, HAS_CW, EVEN_N, SUM_SQ, TOP1, BLOCK_N, False, ROUND)


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
    BLOCK_N: tl.constexpr, TARGET_APART: tl.constexpr, ROUND: tl.constexpr,
):
    """The softmax epilogue of one fp32 logits tile ``acc`` (rows ``rm``, columns ``rn``, stats tile ``pid_n``),
    whether the tile comes from the GEMM or from logits already in memory."""
    # -- bias, soft cap, temperature --
    row_ok = rm < M
    if HAS_BIAS:
        acc += tl.load(BIAS + rn, mask=rn < V, other=0.0).to(tl.float32)[None, :]
    if ROUND:  # the logit as cuBLAS writes it: fp32 accumulation, the bias, one rounding to the inputs' dtype
        acc = acc.to(P.dtype.element_ty).to(tl.float32)
    dcap = acc
    if SOFTCAP:
        acc, dcap = _softcap(acc, softcap)
    if TEMPERATURE:
        acc = acc * inv_t
    t = tl.load(TL + rm, mask=row_ok, other=-1)
    hit = rn[None, :] == t[:, None]
    cw = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_CW:  # per-class weights: the label-smoothing sum and gradient term weight each column
        cw = tl.load(CW + rn, mask=rn < V, other=0.0)
    if GRAD:
        p_offs = rm.to(tl.int64)[:, None] * stride_pm + rn.to(tl.int64)[None, :] * stride_pn
        if EVEN_N:  # every column is a vocab entry: no column mask anywhere (each 2-D op costs in this epilogue)
            p_mask = row_ok[:, None]
        else:
            p_mask = row_ok[:, None] & (rn < V)[None, :]
        # padding columns are computed like the others and never stored
        lse_row = tl.load(RLSE + rm, mask=row_ok, other=0.0)
        q_row = tl.load(RQ + rm, mask=row_ok, other=0.0)
        ca = tl.load(CA + rm, mask=row_ok, other=0.0)
        cc = tl.load(CC + rm, mask=row_ok, other=0.0)
        cb = ca
        cd = ca
        if HAS_CB:
            cb = tl.load(CB + rm, mask=row_ok, other=0.0)
        if HAS_CD:
            cd = tl.load(CD + rm, mask=row_ok, other=0.0)
        # off the target p needs no more than z's own precision; the target's entry comes from q (_dlogits)
        p = _exp(acc - lse_row[:, None])
        zc = p
        if HAS_CB:
            zc = acc - tl.load(RM + rm, mask=row_ok, other=0.0)[:, None]
        g = _dlogits(p, zc, hit, ca, cb, cc, cd, q_row, dcap, HAS_CB, HAS_CD, SOFTCAP, cw, HAS_CW)
        tl.store(P + p_offs, g.to(P.dtype.element_ty), mask=p_mask)
    else:
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
            before = tl.load(TB + rm, mask=row_ok, other=0)
            start = pid_n * BLOCK_N
            # a tile wholly before the target's column holds neither the target nor padding: its max is m_t
            mb = tl.where(before >= start + BLOCK_N, m_t, float("-inf"))
            cut = (before > start) & (before < start + BLOCK_N)
            if tl.max(cut.to(tl.int32), axis=0) > 0:  # only a tile the target's column splits needs the masked max
                mb = tl.where(cut, tl.max(tl.where(rn[None, :] < before[:, None], acc, float("-inf")), axis=1), mb)
            tl.store(TILE_MB + stat, mb, mask=row_ok)
        if not TARGET_APART or TOP1:  # TARGET_APART: the target logit as stored, for the argmax test
            zt = tl.sum(tl.where(hit, acc, 0.0), axis=1)
            mine = row_ok & (t >= pid_n * BLOCK_N) & (t < pid_n * BLOCK_N + BLOCK_N)
            tl.store(ZT + rm, zt, mask=mine)



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
    """``HAS_FLAG`` (the speculative route's gated recompute, ``vpce.speculation``): a persistent grid whose
    programs first read ``FLAG[0]`` (int32) and return when it is 0, else walk the tiles ``pid, pid + grid, ...``;
    ``ROUND`` (with it only) rounds each logit to ``P``'s dtype before the epilogue, as cuBLAS wrote the logits
    whose statistics that route's forward took. Without them, one tile per program: the kernel every other path
    compiles."""
    # -- grouped tile order: GROUP_M row blocks share each W tile while it sits in L2 --
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(V, BLOCK_N)
    width = GROUP_M * num_n
    if HAS_FLAG:
        if tl.load(FLAG) != 0:
            for pid in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
                first_m = (pid // width) * GROUP_M
                size_m = min(num_m - first_m, GROUP_M)
                _logits_tile(first_m + (pid % width) % size_m, (pid % width) // size_m,
                             X, W, BIAS, TL, TILE_M, TILE_S, TILE_Z, TILE_EZ, ZT, P, RM, RLSE, RQ, CA, CB, CC, CD,
                             CW, TILE_SQ, TILE_MB, TB,
                             M, V, D, n_tiles, stride_xm, stride_xk, stride_wv, stride_wk, stride_pm, stride_pn,
                             softcap, inv_t, HAS_BIAS, SOFTCAP, TEMPERATURE, GRAD, SUM_Z, SUM_EZ, HAS_CB, HAS_CD,
                             IEEE, TMA, HAS_CW, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, SUM_SQ, TOP1, ROUND)
    else:
        pid = tl.program_id(0)
        first_m = (pid // width) * GROUP_M
        size_m = min(num_m - first_m, GROUP_M)
        _logits_tile(first_m + (pid % width) % size_m, (pid % width) // size_m,
                     X, W, BIAS, TL, TILE_M, TILE_S, TILE_Z, TILE_EZ, ZT, P, RM, RLSE, RQ, CA, CB, CC, CD, CW,
                     TILE_SQ, TILE_MB, TB,
                     M, V, D, n_tiles, stride_xm, stride_xk, stride_wv, stride_wk, stride_pm, stride_pn,
                     softcap, inv_t, HAS_BIAS, SOFTCAP, TEMPERATURE, GRAD, SUM_Z, SUM_EZ, HAS_CB, HAS_CD,
                     IEEE, TMA, HAS_CW, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, EVEN_N, SUM_SQ, TOP1, False)


@triton.jit
def _program_tile(C, V, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """This program's rows ``rm`` and columns ``rn`` of a ``[C, V]`` buffer (2-D grid), the row mask, and the tile's
    load/store mask (no column mask where every tile is whole)."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rm < C
    if EVEN_N:
        mask = row_ok[:, None]
    else:
        mask = row_ok[:, None] & (rn < V)[None, :]
    return rm, rn, row_ok, mask


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
              TEMPERATURE, GRAD, SUM_Z, SUM_EZ, HAS_CB, HAS_CD, HAS_CW, EVEN_N, SUM_SQ, TOP1, BLOCK_N, True, False)


@triton.jit
def _target_logits_kernel(X, W, BIAS, TL, ZT, M, D, stride_xm, stride_xk, stride_wv, stride_wk, softcap, inv_t,
                          HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, TEMPERATURE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``ZT[row] = z`` of the row's target column from ``X[row] . W[t]`` in fp32 (``-inf`` where ``t < 0``): the
    target logit never goes through the 16-bit logits buffer."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rm < M
    t = tl.load(TL + rm, mask=row_ok, other=-1)
    mine = row_ok & (t >= 0)
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
        z, _ = _softcap(z, softcap)
    if TEMPERATURE:
        z = z * inv_t
    tl.store(ZT + rm, tl.where(mine, z, float("-inf")), mask=row_ok)


@triton.jit
def _scale_cast_kernel(SRC, DST, G, numel, BLOCK: tl.constexpr):
    """``DST = (SRC * G[0]).to(DST.dtype)``: one pass over an fp32 accumulator."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    g = tl.load(G)
    x = tl.load(SRC + offs, mask=mask, other=0.0)
    tl.store(DST + offs, (x * g).to(DST.dtype.element_ty), mask=mask)


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
    # Accumulated elementwise over [BLOCK_C, BLOCK_T] and reduced once after each loop: a row reduction inside
    # the loop whose result is used again (the max) trips an assertion in Triton 3.6's thread-locality pass on
    # sm_90 when T is a multiple of 16.
    m2 = tl.full([BLOCK_C, BLOCK_T], float("-inf"), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        cols = t0 + tl.arange(0, BLOCK_T)
        msk = ok[:, None] & (cols < T)[None, :]
        m2 = tl.maximum(m2, tl.load(TM + base[:, None] + cols[None, :], mask=msk, other=float("-inf")))
    m = tl.max(m2, 1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # every tile -inf: sums stay 0, not NaN
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
    ok = lambda t: t.stride(1) == 1 and (t.stride(0) * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0  # noqa: E731
    return ok(x) and ok(w)


def tile_n(x: torch.Tensor) -> int:
    """Columns per stats tile for inputs like ``x``."""
    return _config(x)["BLOCK_N"]


def logits_tiles(x, w, b, t_local, *, softcap=None, inv_t=1.0, tile_m=None, tile_s=None, tile_z=None,
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
    writes the gradient into ``p``.
    ``class_weight`` (fp32 ``[V]``, per column): ``tile_z`` becomes the weighted sum ``sum w_j z_j`` and grad
    mode's ``d`` term ``d w_j``. ``config`` overrides the block shapes (for ``launch/tune_kernels.py``).
    ``flag`` (int32, one element on the device): the launch does nothing where it holds 0 (no host read); with it,
    ``round_logits`` rounds each logit to ``p``'s dtype first (grad mode after statistics of cuBLAS logits).
    """
    m, d = x.shape
    v = w.shape[0]
    if m == 0 or v == 0:
        return
    cfg = dict(config or _config(x))
    tma = cfg.pop("TMA", _use_tma(x, w))
    bn = cfg["BLOCK_N"]
    n_tiles = triton.cdiv(v, bn)
    grad = rows is not None
    dummy = x.new_empty(0, dtype=torch.float32)
    ca, cb, cc, cd = coef if grad else (None,) * 4
    rm, rls, rq = rows if grad else (None,) * 3
    pick = lambda t: dummy if t is None else t  # noqa: E731
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


def stored_logits(logits, b, t_local, *, softcap=None, inv_t=1.0, tile_m=None, tile_s=None, tile_z=None,
                  tile_ez=None, zt=None, rows=None, coef=None, class_weight=None, tile_sq=None, tile_mb=None,
                  before=None, block_n=None, block_m=None, num_warps=None):
    """``logits_tiles``'s epilogue over ``logits [M, V]`` that a GEMM already wrote (the inputs' dtype; ``b`` is
    added here, None if the GEMM added it): stats mode fills the same buffers as ``logits_tiles`` but ``zt``, and
    leaves the target column out of the tile max too (``target_logits`` gives its exact logit; with ``tile_mb``,
    ``zt`` gets the target's logit as stored, for the argmax test), grad mode
    (``rows``, ``coef``) overwrites ``logits`` with the gradient. One bandwidth-bound pass; ``block_n`` is the stats
    tile width (``tile_n``); ``block_m`` / ``num_warps`` override the launch shape (``launch/tune_kernels.py``)."""
    m, v = logits.shape
    if m == 0 or v == 0:
        return
    bn = block_n or tile_n(logits)
    n_tiles = triton.cdiv(v, bn)
    grad = rows is not None
    dummy = logits.new_empty(0, dtype=torch.float32)
    ca, cb, cc, cd = coef if grad else (None,) * 4
    rm, rls, rq = rows if grad else (None,) * 3
    pick = lambda t: dummy if t is None else t  # noqa: E731
    gpu = logits.is_cuda and not INTERPRET
    # 16 rows x 256 columns per program, 4 warps: 2.6 TB/s (stats) and 3.8 TB/s (gradient, read + write) on an H200
    # (launch/tune_kernels.py, 2026-11-23); 8 warps or 8-64 rows were slower
    block_m = block_m or (16 if gpu else 32)  # the interpreter: fewer, larger programs
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


def target_logits(x, w, b, t_local, zt, *, softcap=None, inv_t=1.0):
    """``zt [M] = cap(x . w[t] + b[t]) / T`` in fp32 for each row's local target column ``t_local`` (``-inf``
    where it is -1): the exact target logit beside ``stored_logits``' 16-bit logits."""
    m, d = x.shape
    if m == 0:
        return
    gpu = x.is_cuda and not INTERPRET
    block_m, block_k = (16, 256) if gpu else (32, 32)
    _target_logits_kernel[(triton.cdiv(m, block_m),)](
        x, w, x if b is None else b, t_local, zt, m, d, x.stride(0), x.stride(1), w.stride(0), w.stride(1),
        float(softcap or 1.0), float(inv_t), HAS_BIAS=b is not None, SOFTCAP=softcap is not None,
        TEMPERATURE=inv_t != 1.0, BLOCK_M=block_m, BLOCK_K=block_k, num_warps=4)


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
    """Every rank's packed statistics ``[W, R, C]`` -> ``vpce.parallel.RankStats`` in one launch (the same
    formulas as ``vpce.parallel.combine_rank_stats``)."""
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


def scale_cast(src: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``(src * g).to(dtype)`` for a contiguous fp32 ``src`` and a one-element fp32 ``g``, in one pass."""
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    n = src.numel()
    if n:
        block = 4096 if src.is_cuda and not INTERPRET else 1024
        _scale_cast_kernel[(triton.cdiv(n, block),)](src, out, g.reshape(1), n, BLOCK=block, num_warps=4)
    return out


def _persistent(x: torch.Tensor, tiles: int) -> int:
    """Programs of a gated persistent grid: a few per SM on a GPU (so a skipped launch is one short wave), a few
    under the interpreter."""
    if INTERPRET or not x.is_cuda:
        return max(1, min(tiles, 4))
    return max(1, min(tiles, 4 * _sm_count(x.device.index)))


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(torch.device("cuda", index)).multi_processor_count


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


# ============================================================================================================
# Distillation (``vpce.distill_triton``): bandwidth-bound passes over a token chunk's student and teacher logits
# ============================================================================================================
#
# cuBLAS writes both heads' chunk logits ``[C, V]`` in the inputs' dtype (biases included). These kernels read
# them once per pass, apply each head's soft cap and the temperature on load in fp32, and work on one
# ``[BLOCK_M, BLOCK_N]`` tile per program (int64 offsets, no atomics):
#
# * ``_distill_stats_kernel``: per (row, tile) each head's tile max and sum of ``exp`` relative to it, the KL's
#   softmax-weighted sum (``sum e^{y - m} (y - z)`` or ``sum e^{z - m} (z - y)``), and with the cross-entropy the
#   untempered student's max and sum of ``exp`` but the target's; the target's logit is stored by the one tile
#   that holds it;
# * ``_distill_reduce_kernel``: per row over its tiles, the packed ``[R, C]`` statistics of ``vpce.distill``
#   (each head rescaled to its row max; plain sums for the JSD's mixture partials);
# * ``_combine_distill_kernel``: every rank's packed statistics ``[W, R, C]`` combined into both heads' global
#   max, ``log S`` and the KL's softmax expectation (``vpce.distill``'s ``_combine_head``, in one launch);
# * ``_distill_mixture_kernel``: the JSD's second pass, per tile ``sum q (u - log m)`` and ``sum p (s - log m)``
#   from the global log-softmax statistics;
# * ``_distill_grad_kernel``: the student's ``dL/dx`` (``vpce.distill``'s formulas, per-row weights folded in),
#   written in the logits' dtype over the student's logits in place.

__all__ += ["distill_stats", "combine_distill_heads", "distill_mixture", "distill_grad_", "distill_block_align"]


@triton.jit
def _log2(x, FAST_LOG: tl.constexpr):
    """``log2 x``. ``FAST_LOG`` (compiled for NVIDIA GPUs): PTX's hardware ``lg2.approx.ftz.f32``, the same class
    of approximation as the ``ex2.approx.ftz`` that ``tl.exp2`` compiles to, instead of libdevice's (about 40
    instructions per element on sm_90), which held the JSD's mixture pass to 1.3 TB/s against the statistics pass's
    3 TB/s (one H200, run 88d8c1a). ``ftz``: the callers' arguments are never denormal, and the non-ftz form adds a
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
    scale of ``L``, not of ``log m``: on one H200, a bf16 chunk of 4096 x 64128 logits, the JSD's error against
    float64 was torch eager fp32's (2.4e-7 / 2.2e-7), against 1.5e-6 with ``log m`` taken directly. A NaN in
    either head gives NaN terms; ``-inf`` in both (padding) gives ``p = q = 0``, whose terms the callers drop.

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
        y, _ = _softcap(y, t_softcap)
    z = z1
    if TEMPERATURE:
        z = z1 * inv_t
        y = y * inv_t
    return z1, z, y, dcap


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
    m2 = tl.full([BLOCK_C, BLOCK_T], float("-inf"), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        cols = t0 + tl.arange(0, BLOCK_T)
        msk = ok[:, None] & (cols < T)[None, :]
        m2 = tl.maximum(m2, tl.load(TM + base[:, None] + cols[None, :], mask=msk, other=float("-inf")))
    m = tl.max(m2, 1)
    safe = tl.where(m == float("-inf"), 0.0, m)  # every tile -inf: the sums stay 0
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
    warps on a GPU, a small tile under the interpreter. (One H200, a bf16 chunk of 2048 tokens, V = 128256 and
    256000, against 11 other shapes from 16 x 256 to 1 x 4096: the fastest or within 2 % for each of the statistics,
    mixture and gradient kernels; the statistics kernel 17 % faster than at 16 x 256 with 8 warps.)"""
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


def _distill_options(softcap, t_softcap, inv_t) -> dict:
    return dict(softcap=float(softcap or 1.0), t_softcap=float(t_softcap or 1.0), inv_t=float(inv_t),
                SOFTCAP=softcap is not None, T_SOFTCAP=t_softcap is not None, TEMPERATURE=inv_t != 1.0)


def _check_pair(z: torch.Tensor, y: torch.Tensor):
    if z.shape != y.shape or z.stride(1) != 1 or y.stride(1) != 1:
        raise RuntimeError(f"vpce: distillation logits must be equal-shaped with unit column stride, got "
                           f"{tuple(z.shape)}/{z.stride()} and {tuple(y.shape)}/{y.stride()}")


def distill_stats(z, y, t_local, packed, *, kl: int, ce: bool, softcap, t_softcap, inv_t):
    """This shard's packed statistics of a chunk into ``packed [R, C]`` (fp32, contiguous), rows as
    ``vpce.distill`` packs them: student max, sum of exp; teacher max, sum of exp; [the KL's weighted sum, ``kl``
    1: forward, 2: reverse]; [with ``ce``: the untempered student's max, sum of exp but the target's, target
    logit (``t_local``: int32 local column, -1 where the target is not in this shard)]. ``z``, ``y``: the
    student's and the teacher's logits ``[C, V]`` before the caps and the temperature."""
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
        **_distill_options(softcap, t_softcap, inv_t), KL=kl, CE=ce, CE_AT=ce_at, BLOCK_M=bm, BLOCK_N=bn,
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


def distill_mixture(z, y, m_z, log_s_z, m_y, log_s_y, *, beta: float, softcap, t_softcap, inv_t) -> torch.Tensor:
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
        **_distill_options(softcap, t_softcap, inv_t), beta=float(beta), FAST_LOG=_fast_log(z), BLOCK_M=bm,
        BLOCK_N=bn, num_warps=warps)
    block_c = 16 if INTERPRET or not z.is_cuda else 64
    _distill_reduce_kernel[(triton.cdiv(c, block_c),)](tiles, out, c, n_tiles, c * n_tiles, SUMS=2, KL=0, CE=False,
                                                        CE_AT=0, BLOCK_C=block_c, BLOCK_T=32, num_warps=4)
    return out


def distill_grad_(z, y, g, t_local, rows, kd, ce, *, kind: int, beta: float, softcap, t_softcap, inv_t):
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
        **_distill_options(softcap, t_softcap, inv_t), beta=float(beta), KIND=kind, CE=ce is not None,
        FAST_LOG=_fast_log(z), BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)
