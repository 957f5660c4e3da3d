"""What the kernel families share: the interpreter switch, the ``exp``/``log`` constants, the fast ``exp``, the soft
cap and its derivative, ``log1p``, a program's tile of a ``[C, V]`` buffer, the row max over a row's tile maxima,
and the persistent grid of the gated kernels."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HW_MATH: tl.constexpr = tl.constexpr(not INTERPRET)  # compiled for an NVIDIA GPU: PTX's approximate instructions

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # log2(e)
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)    # ln(2)


@triton.jit
def _exp(x):
    """``e^x`` as one multiply and the hardware ``ex2`` (results below 2^-126 flush to 0): ``tl.exp`` adds a range
    test and two predicated multiplies per element to keep such denormals, five instructions instead of two on
    sm_90, in kernels that are short of issue slots (the JSD's mixture pass, the statistics passes)."""
    return tl.exp2(x * LOG2E)


@triton.jit
def _softcap_value(x, softcap):
    """``softcap * tanh(x / softcap)``: ``tanh(u) = 2 r - 1`` with ``r = 1 / (1 + exp(-2u))``, one multiply into the
    hardware ``exp2``, the hardware reciprocal (``_rcp``) and one FMA, no sign select. ``exp(-2u)`` overflows to inf
    for ``x < -44 softcap``, where the reciprocal gives 0 and the cap its limit ``-softcap``. It loses ``tanh``'s
    relative precision for tiny ``u`` (the softmax sees the absolute error, a few ulps of ``softcap``), as any form
    from ``exp(-2|u|)`` does. Every pass caps with this formula (the GEMM's statistics epilogue too), so the
    gradient pass's ``exp(z - lse)`` is the softmax of the logits the LSE summed."""
    r = _rcp(1.0 + tl.exp2(x * (-2.0 * LOG2E / softcap)))
    return r * (2.0 * softcap) - softcap


@triton.jit
def _softcap_quarter_slope(x, softcap):
    """``_softcap_value(x)`` and a quarter of its derivative, ``sech^2(u) / 4 = (E r) r`` with ``E = exp(-2u)``,
    ``r = 1 / (1 + E)``: ``E r = 1 - r``, so there is no cancellation where the cap saturates, on either side, and
    no underflow of ``r^2`` before the slope's own. ``E`` is clamped at ``2^126`` (not inf, whose ``inf * 0``
    would be NaN): below ``x = -44 softcap`` the quarter slope stays ``2^-126`` instead of falling further, an
    absolute error under ``1.2e-38``. A NaN ``x`` stays NaN. Eight instructions per element on sm_90 (the gradient
    pass takes the factor 4 into its per-row coefficients), where the earlier form from ``exp(-2|u|)`` with a sign
    select took sixteen."""
    E = tl.exp2(tl.minimum(x * (-2.0 * LOG2E / softcap), 126.0, propagate_nan=tl.PropagateNan.ALL))
    r = _rcp(1.0 + E)
    return r * (2.0 * softcap) - softcap, (E * r) * r


@triton.jit
def _softcap(x, softcap):
    """``_softcap_value(x)`` and its derivative ``sech^2(x / softcap)`` (``_softcap_quarter_slope``)."""
    v, q = _softcap_quarter_slope(x, softcap)
    return v, 4.0 * q


@triton.jit
def _rcp(y):
    """``1 / y`` as PTX's one-instruction ``rcp.approx.ftz.f32`` (within an ulp; 0 for inf, denormals flushed) where
    compiled for a GPU: Triton's ``/`` is ``div.full``, a range test, a select and two multiplies around the same
    reciprocal. The interpreter divides."""
    if HW_MATH:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [y], dtype=tl.float32, is_pure=True,
                                         pack=1)
    return 1.0 / y


@triton.jit
def _log1p(u):
    """``log(1 + u)`` for ``u >= 0`` without losing a small ``u`` (Goldberg's correction)."""
    v = 1.0 + u
    return tl.where(v == 1.0, u, tl.log(v) * (u / (v - 1.0)))


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


@triton.jit
def _tiles_max(TM, base, ok, T, BLOCK_C: tl.constexpr, BLOCK_T: tl.constexpr):
    """Each row's max over its ``T`` tile maxima (the rows' tiles at ``TM + base``; ``ok``: real rows), and that max
    with ``-inf`` taken as 0 (every tile ``-inf``: sums against it stay 0, not NaN). Accumulated elementwise over
    ``[BLOCK_C, BLOCK_T]`` and reduced once after the loop: a row reduction inside the loop whose result is used
    again (the max) trips an assertion in Triton 3.6's thread-locality pass on sm_90 when ``T`` is a multiple of
    16."""
    m2 = tl.full([BLOCK_C, BLOCK_T], float("-inf"), tl.float32)
    for t0 in range(0, T, BLOCK_T):
        cols = t0 + tl.arange(0, BLOCK_T)
        msk = ok[:, None] & (cols < T)[None, :]
        m2 = tl.maximum(m2, tl.load(TM + base[:, None] + cols[None, :], mask=msk, other=float("-inf")))
    m = tl.max(m2, 1)
    return m, tl.where(m == float("-inf"), 0.0, m)


def _persistent(x: torch.Tensor, tiles: int) -> int:
    """Programs of a gated persistent grid: a few per SM on a GPU (so a skipped launch is one short wave), a few
    under the interpreter."""
    if INTERPRET or not x.is_cuda:
        return max(1, min(tiles, 4))
    return max(1, min(tiles, 4 * _sm_count(x.device.index)))


@functools.cache
def _sm_count(index: int | None) -> int:
    return torch.cuda.get_device_properties(torch.device("cuda", index)).multi_processor_count
