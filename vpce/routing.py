"""The route of one call, decided once, in one place, from the validated options and facts that every rank of the
group shares (and checks, through ``vpce.parallel.agree``).

* ``backend``: ``"triton"`` (fused kernels; CUDA, or the CPU interpreter) or ``"torch"`` (chunked PyTorch).
* ``route``: ``"fast"`` (6NDV: the gradients are formed in forward while each chunk's logits are live; the
  cross-entropy with ``mean``/``sum``), ``"lean"`` (8NDV: statistics in forward, logits recomputed in backward;
  ``reduction="none"``, ``memory_budget="lean"``, ``linear_log_probs``), or ``"forward"`` (no gradient needed).
  With ``memory_budget="auto"`` on CUDA (Triton backend) the fast route is taken only where its buffers fit in
  the free device memory with ``FAST_HEADROOM`` to spare, else the lean route (``settle_by_memory``). Under a group
  that is weighed only for long calls (fp32 dX of at least ``AUTO_CHECK_BYTES``): every rank sends whether the
  fast route fits in the agreement's fingerprint, the agreement is then read on the host (one sync), and every rank
  takes the fast route only if it fits on all of them. Shorter calls take the fast route with no reading.
  ``"speculative"`` (Triton, one process; ``reduction="none"`` and ``linear_log_probs``, whose per-token outputs
  the caller reduces): the fast route's forward at unit upstream scale, exact in backward for any upstream gradient,
  as cheap as the fast route when that gradient is uniform over the non-ignored tokens. The API asks
  ``vpce.speculation.decide`` per call; with ``memory_budget="auto"`` it is weighed against free memory as the fast
  route is, and falls back to lean where it does not fit.
* ``dx_reduce``: where the hidden states' gradient is summed over the group: ``"none"`` (not sharded),
  ``"region"`` (``vpce.parallel.enter_vocab_parallel`` around the backend: all-reduce or reduce-scatter in
  backward) or ``"forward"`` (the Triton fast route sums each chunk's ``dX`` in forward, overlapped with its dW
  GEMM; under sequence parallelism it gathers the hidden states itself).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from .options import BACKENDS, LossOptions
from .parallel import VocabShard

__all__ = ["Plan", "Call", "resolve_backend", "plan_cross_entropy", "plan_log_probs", "settle_by_memory",
           "settle", "fast_chunk", "fast_route_bytes"]

FAST_P_GIB = 1.5     # default size of the fast route's P chunk (freed before backward's peak)
MIN_P_GIB = 0.25     # ... and its floor when the fp32 dW accumulator is smaller than FAST_P_GIB
ROW_ALIGN = 128      # chunk and sub-chunk boundaries are multiples of the kernel's largest BLOCK_M
FAST_HEADROOM = 0.9      # the fast route's buffers may take at most this share of the free device memory
AUTO_CHECK_BYTES = 2**30  # under a group, "auto" weighs memory only when the fp32 dX alone is at least this


@dataclass(frozen=True)
class Plan:
    backend: str
    """``"triton"`` or ``"torch"``."""
    route: str
    """``"fast"``, ``"lean"``, ``"speculative"`` or ``"forward"``; ``"auto"`` until ``settle_by_memory`` /
    ``settle`` decide."""
    dx_reduce: str
    """``"none"``, ``"region"`` or ``"forward"``."""
    sequence_parallel: bool
    """``hidden`` is this rank's slice along dim 0 (Megatron SP)."""


@dataclass(frozen=True)
class Call:
    """Everything a backend needs besides the tensors and the loss options."""

    shard: VocabShard
    plan: Plan
    needs_grad: tuple[bool, bool, bool]
    """Whether hidden, weight and bias need gradients."""
    main_grad: bool = False
    """Add the weight gradient in fp32 into ``weight.main_grad`` instead of returning it."""
    poison: Any = None
    """The agreement's device scalar (0, or NaN where the ranks disagreed), or None."""
    history: Any = None
    """``vpce.speculation.Record`` of a call eligible for the speculative route (whichever route it took): its
    backward reports there whether the upstream gradient was uniform. None otherwise."""


def _triton_importable() -> bool:
    try:
        from . import kernels  # noqa: F401 - Triton and vpce's kernels (all the Triton backend needs beyond torch)
    except ImportError:
        return False
    return True


def resolve_backend(backend: str, hidden: torch.Tensor) -> str:
    """``"auto"``: Triton on CUDA where it imports, else torch. (Whatever a rank picks goes into the group's
    agreement, so ranks that would pick differently fail together.)"""
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if hidden.is_cuda and _triton_importable() else "torch"
    if backend == "triton":
        if not _triton_importable():
            raise ValueError("backend: 'triton' needs the Triton package and vpce's Triton kernels, which could "
                             "not be imported here; use backend='torch' or 'auto'")
        if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(f"backend: 'triton' expects CUDA tensors (or TRITON_INTERPRET=1 for the CPU "
                             f"interpreter), got hidden on {hidden.device}")
    return backend


def _dx_reduce(backend: str, route: str, sharded: bool) -> str:
    if not sharded:
        return "none"
    return "forward" if backend == "triton" and route == "fast" else "region"


def plan_cross_entropy(opts: LossOptions, needs_grad: tuple[bool, bool, bool], backend: str,
                       sharded: bool, sequence_parallel: bool, speculate: bool = False) -> Plan:
    """``speculate``: ``vpce.speculation.decide``'s verdict for ``reduction="none"`` (which alone weighs whether a
    call is eligible)."""
    if not any(needs_grad):
        route = "forward"
    elif opts.reduction == "none" and speculate:
        route = "speculative"
    elif opts.reduction == "none" or opts.lean:
        route = "lean"
    elif opts.memory_budget == "auto" and backend == "triton":
        route = "auto"  # fast where its buffers fit: settle_by_memory
    else:
        route = "fast"
    return Plan(backend, route, _dx_reduce(backend, route, sharded), sequence_parallel)


def settle(plan: Plan, fast: bool) -> Plan:
    """A plan whose route was left to memory, decided."""
    if plan.route != "auto":
        return plan
    route = "fast" if fast else "lean"
    return Plan(plan.backend, route, _dx_reduce(plan.backend, route, plan.dx_reduce != "none"),
                plan.sequence_parallel)


def round_to(x: int, m: int) -> int:
    return max(m, (x // m) * m)


def fast_chunk(opts: LossOptions, cols: int, dtype: torch.dtype, d: int) -> int:
    """Tokens per fast-route chunk for ``cols`` vocab columns per rank; equal on every rank (``cols`` is
    ``vocab_size / world``, not V_local).

    By default ``P`` gets ``FAST_P_GIB``, but never more than the fp32 dW accumulator (at least
    ``MIN_P_GIB``): under tensor parallelism the shard's accumulator shrinks with the group and so does ``P``.
    """
    if isinstance(opts.memory_budget, float):
        gib = opts.memory_budget
    else:
        gib = min(FAST_P_GIB, max(MIN_P_GIB, cols * d * 4 / 2**30))
    per_tok = cols * torch.empty((), dtype=dtype).element_size()
    return round_to(int(gib * 2**30) // per_tok, ROW_ALIGN)


def fast_route_bytes(tokens: int, d: int, rows: int, dtype: torch.dtype, needs: tuple[bool, bool, bool],
                     opts: LossOptions) -> int:
    """What the fast route holds beyond its inputs and outputs for ``tokens`` tokens (all of them under sequence
    parallelism) and ``rows`` vocab rows: the ``P`` chunk, its tile statistics, fp32 dX and the fp32 dW
    accumulator (``vpce.routing`` weighs it against free memory)."""
    chunk = min(max(tokens, 1), fast_chunk(opts, max(rows, 1), dtype, d))
    p = chunk * rows * torch.empty((), dtype=dtype).element_size()
    tiles = chunk * 2 * math.ceil(rows / 128) * 4
    return p + tiles + (tokens * d * 4 if needs[0] else 0) + (rows * d * 4 if needs[1] else 0)


def _fits(need: int, device: torch.device) -> bool:
    """Whether ``need`` bytes fit, with ``FAST_HEADROOM``, in the device's free memory: the driver's, plus what
    PyTorch's caching allocator holds unused. The allocator's counters (a slow host call, ~1 ms) are read only when
    the driver's free memory alone is not enough."""
    free, _ = torch.cuda.mem_get_info(device)
    if need <= FAST_HEADROOM * free:
        return True
    stats = torch.cuda.memory_stats(device)
    unused = stats.get("reserved_bytes.all.current", 0) - stats.get("allocated_bytes.all.current", 0)
    return need <= FAST_HEADROOM * (free + unused)


def _fast_route_fits(hidden: torch.Tensor, tokens: int, rows: int, needs: tuple[bool, bool, bool],
                     opts: LossOptions, extra: int = 0) -> bool:
    """Whether the fast route's buffers for ``tokens`` tokens (plus ``extra`` bytes) fit on ``hidden``'s device."""
    need = fast_route_bytes(tokens, hidden.shape[-1], rows, hidden.dtype, needs, opts) + extra
    return _fits(need, hidden.device)


def settle_by_memory(plan: Plan, hidden: torch.Tensor, rows: int, needs: tuple[bool, bool, bool],
                     opts: LossOptions, world: int) -> tuple[Plan, bool | None]:
    """Decide a route left to memory where this rank can: ``(plan, None)``; or, under a group on a long call,
    ``(plan still "auto", whether the fast route fits here)`` for the agreement to AND over the ranks. The
    speculative route (one process) holds what the fast route holds, plus three fp32 statistics per token: with
    ``memory_budget="auto"`` it becomes the lean route where that does not fit."""
    # nothing to weigh (CPU interpreter), or no host calls wanted (compiling, or capturing a CUDA graph)
    weigh = not (torch.compiler.is_compiling() or not hidden.is_cuda or torch.cuda.is_current_stream_capturing())
    tokens, d = hidden.numel() // hidden.shape[-1], hidden.shape[-1]
    if plan.route == "speculative":
        if opts.memory_budget != "auto" or not weigh or _fast_route_fits(hidden, tokens, rows, needs, opts,
                                                                         12 * tokens):
            return plan, None
        return Plan(plan.backend, "lean", plan.dx_reduce, plan.sequence_parallel), None
    if plan.route != "auto":
        return plan, None
    if not weigh:
        return settle(plan, True), None
    if plan.sequence_parallel:
        tokens *= world  # the fast route gathers the sequence
    if world > 1 and tokens * d * 4 < AUTO_CHECK_BYTES:
        return settle(plan, True), None
    fits = _fast_route_fits(hidden, tokens, rows, needs, opts)
    if world == 1:
        return settle(plan, fits), None
    return plan, fits


def plan_log_probs(needs_grad: tuple[bool, bool, bool], backend: str, sharded: bool,
                   sequence_parallel: bool, speculate: bool = False) -> Plan:
    """``speculate``: ``vpce.speculation.decide``'s verdict (which alone weighs whether a call is eligible)."""
    if not any(needs_grad):
        route = "forward"
    else:
        route = "speculative" if speculate else "lean"
    return Plan(backend, route, _dx_reduce(backend, route, sharded), sequence_parallel)


def plan_distillation(reduction: str, lean: bool, needs_grad: tuple[bool, bool, bool], backend: str, sharded: bool,
                      sequence_parallel: bool) -> Plan:
    """``linear_distillation_loss``: the gradient formed in forward for ``mean``/``sum`` (fast), recomputed in
    backward for ``reduction="none"`` or ``memory_budget="lean"``."""
    if not any(needs_grad):
        route = "forward"
    elif reduction == "none" or lean:
        route = "lean"
    else:
        route = "fast"
    return Plan(backend, route, _dx_reduce(backend, route, sharded), sequence_parallel)
