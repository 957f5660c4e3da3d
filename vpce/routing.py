"""The plan of one call, decided once, in one place, from the validated options and facts that every rank of the
group shares (and checks, through ``vpce.parallel.agree``): the backend, the route, where dX is summed, and the
chunk and buffer sizes the backends read (they size nothing themselves).

* ``backend``: ``"triton"`` (fused kernels; CUDA, or the CPU interpreter) or ``"torch"`` (chunked PyTorch).
* ``route``: ``"fast"`` (6NDV: the gradients are formed in forward while each chunk's logits are live; the
  cross-entropy with ``mean``/``sum``), ``"lean"`` (8NDV: statistics in forward, logits recomputed in backward;
  ``reduction="none"``, ``memory_budget="lean"``, ``linear_log_probs``), or ``"forward"`` (no gradient needed).
  With ``memory_budget="auto"`` on CUDA (Triton backend) the fast route is taken only where its buffers fit in
  the free device memory with ``FAST_HEADROOM`` to spare, else the lean route (``settle_by_memory``). Under a group
  that is weighed only for long calls (fp32 dX of at least ``AUTO_CHECK_BYTES``): every rank sends whether the
  fast route fits in the agreement's fingerprint, the agreement is then read on the host (one sync), and every rank
  takes the fast route only if it fits on all of them. Shorter calls take the fast route with no reading.
  Where free memory allows more, the fast route (the cross-entropy's, ``linear_log_prob_loss``'s) takes every
  token in one chunk (``Plan.whole``, ``settle_by_memory``): no fp32 dW accumulator is read and rewritten chunk
  after chunk. Where the fast route does not fit, its compact form (``Plan.compact``: smaller ``P`` chunks, each
  freed in forward) before the lean route.
  Under a group that too is decided only where the agreement is read, as the smallest of every rank's fit
  (``vpce.parallel.agree``). In one process the fast route writes dX in the hidden's dtype chunk by chunk
  (``Plan.dx_in_forward``).
  Under a group a rank may also keep every token's gradient in one ``P`` and finish dW in one GEMM while its
  chunks, their exchanges and their dX sums stay those of ``Sizes.chunk`` (``one_weight_grad_gemm``): a choice
  of this rank's alone, since it changes no collective.
  ``"speculative"`` (Triton, one process; ``reduction="none"`` and ``linear_log_probs``, whose per-token outputs
  the caller reduces): the fast route's forward at unit upstream scale, exact in backward for any upstream gradient,
  as cheap as the fast route when that gradient is uniform over the non-ignored tokens. The plan asks
  ``vpce.speculation.decide`` once per call for the entry's call site (``Site``; ``Plan.history``); with
  ``memory_budget="auto"`` it is weighed against free memory as the fast route is, and falls back to lean where it
  does not fit.
* ``dx_reduce``: where the hidden states' gradient is summed over the group: ``"none"`` (not sharded),
  ``"region"`` (``vpce.parallel.enter_vocab_parallel`` around the backend: all-reduce or reduce-scatter in
  backward) or ``"forward"`` (the Triton fast route sums each chunk's ``dX`` in forward, overlapped with its dW
  GEMM; under sequence parallelism it gathers the hidden states itself).
* ``sizes`` (``Sizes``; ``size_cross_entropy``, ``size_log_probs``, ``size_distillation`` once the shard is
  agreed): tokens per forward chunk, tokens per recompute block, the lean backward's buffer budget; all from
  ``SIZING`` (``Sizing``: the defaults) and values equal on every rank, so every rank runs the same chunks and
  collectives.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from . import speculation
from .options import (BACKENDS, DEFAULT_CHUNK_GIB, DistillOptions, Folded, LogProbLossOptions, LogProbOptions,
                      LossOptions)
from .parallel import VocabShard

__all__ = ["Plan", "Sizes", "Call", "resolve_backend", "plan_cross_entropy", "plan_log_probs", "plan_distillation",
           "settle_by_memory", "settle", "FIT_LEAN", "FIT_COMPACT", "FIT_FAST", "FIT_WHOLE", "size_cross_entropy",
           "size_log_probs", "size_log_prob_loss", "size_distillation", "fast_route_bytes", "one_weight_grad_gemm",
           "SIZING", "Sizing", "Extra", "extra_facts", "Finish", "finish_fast", "plan_finish", "plan_log_prob_loss",
           "plan_compiled_cross_entropy", "plan_compiled_distillation", "Site"]

ROW_ALIGN = 128      # chunk and sub-chunk boundaries are multiples of the kernel's largest BLOCK_M
FAST_HEADROOM = 0.9      # the fast route's buffers may take at most this share of the free device memory
AUTO_CHECK_BYTES = 2**30  # under a group, "auto" weighs memory only when the fp32 dX alone is at least this
# what fits in free memory (``settle_by_memory``; the smallest over the group): only the lean route, the compact fast
# route (``Plan.compact``), the fast route, or the fast route with every token in one chunk
FIT_LEAN, FIT_COMPACT, FIT_FAST, FIT_WHOLE = 0, 1, 2, 3
WHOLE_CHUNK = 2**62  # ``Sizes.chunk`` of one chunk of every token (the backends clamp it to the tokens there are)


@dataclass(frozen=True, kw_only=True)
class Sizing:
    """The defaults the sizes of a call are computed from (``SIZING``; tests replace it through a fixture)."""

    fast_p_gib: float = 2.0
    """The Triton fast route's ``P`` chunk, ..."""
    compact_p_gib: float = 1.0
    """... on the compact fast route (``Plan.compact``: ``P`` freed in forward) at most this, and at most the
    16-bit dW's size (half the fp32 accumulator: a smaller ``P`` no longer lowers the peak, which is then the
    accumulator beside the 16-bit dW in backward), ..."""
    min_p_gib: float = 0.25
    """... and its floor when the fp32 dW accumulator (less the weight's 16-bit copy under autocast) is smaller
    than ``fast_p_gib``."""
    lean_block_gib: float = 0.2
    """The Triton lean backward's ``[N_b, V_b]`` block (softmax losses)."""
    lean_token_block: int = 4096
    """Tokens per block of the Triton lean backward's token-major order (``N > V_local``)."""
    stats_tokens: int = 8192
    """Tokens per Triton stats-only launch (bounds the per-tile statistics buffers)."""
    distill_fast_gib: float = 1.5
    """Both logits buffers of the distillation's Triton fast route together, ..."""
    distill_dw_share: float = 1.5
    """... at most this times the fp32 dW accumulator's size (every chunk's dW GEMM reads and writes that
    accumulator; larger chunks measured faster: docs/benchmarks.md), ..."""
    distill_min_gib: float = 0.25
    """... and their floor when that accumulator is small."""
    distill_lean_gib: float = 0.4
    """Both buffers of the distillation's Triton lean route (forward chunks and backward blocks)."""


SIZING = Sizing()


@dataclass(frozen=True)
class Sizes:
    """The token and vocab block sizes of one call, decided with its route, equal on every rank of the group
    (they depend only on agreed values: ``columns_per_rank``, the hidden size, the dtype and the options)."""

    chunk: int
    """Tokens per forward chunk: the Triton fast and speculative routes' ``P`` (the speculative backward's token
    blocks too), Triton's stats-only launches, the distillation's two logits buffers, or the torch backend's
    chunk. The backends clamp it to the tokens there are."""
    block_tokens: int
    """Tokens per block of the recompute: the Triton lean backward's token-major blocks, or the torch backend's
    recompute chunk."""
    block_gib: float
    """GiB of the Triton lean backward's logits buffers, all of them together."""


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
    sizes: Sizes | None = None
    """Chunk and buffer sizes; None until the shard is agreed (``size_cross_entropy`` and its kin)."""
    folded: Folded | None = None
    """The logits every kernel of the call computes from ``h @ W.T + b``: the soft cap, the logit scale and the
    temperature folded together (``options.Folded``), from the call's options; the backends read it here. None for
    the distillation, whose two heads keep theirs in ``DistillOptions`` (each head its own)."""
    history: Any = dataclasses.field(default=None, compare=False)
    """``vpce.speculation.Record`` of a call site eligible for the speculative route (whichever route it takes): its
    backward reports there whether the upstream gradient was uniform (``Call.history``). None otherwise."""
    whole: bool = False
    """The fast route in one chunk of every token (``FIT_WHOLE``; the cross-entropy's, ``linear_log_prob_loss``'s):
    ``memory_budget="auto"`` where free memory allows (``settle_by_memory``)."""
    compact: bool = False
    """The compact fast route (``FIT_COMPACT``: ``memory_budget="auto"`` where the fast route does not fit, and a
    numeric ``memory_budget``): smaller ``P`` chunks (``Sizing.compact_p_gib``), each freed in forward
    (``keep_p`` False)."""
    dx_in_forward: bool = False
    """The fast route in one process writes each chunk's dX in the hidden's dtype in forward (no fp32 ``[N, D]``;
    one chunk with the ``hopper`` extra leaves dX's GEMM to backward instead). The cross-entropy's ``mean`` then
    folds ``1/count`` into ``P`` (``FastGrads.mean_folded``), so that backward scales dX (and dW, db) by the upstream
    gradient alone, in fp32: no second rounding of dX where that gradient is 1. Not for float16 (its range), nor
    where the caller scales the held gradients itself (``vpce.library``)."""

    @property
    def keep_p(self) -> bool:
        """Whether the fast route's last ``P`` chunk stays live into backward beside the fp32 dW accumulator, its dW
        GEMM left there (with the ``hopper`` extra one quack GEMM reads the accumulator and writes dW scaled in its
        16-bit dtype, sparing a pass over the accumulator). Not on the compact route: the last chunk's dW goes into
        the accumulator in forward and ``P`` is freed there, so the peak is the accumulator with one ``P`` chunk, or
        with the 16-bit dW in backward, never all three. A call of one chunk holds no accumulator and leaves both
        GEMMs to backward either way."""
        return not self.compact


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


@dataclass(frozen=True)
class Extra:
    """What this rank's ``hopper`` extra (quack-kernels' CuTe GEMMs) can run on one call's operands, asked once per
    call (``extra_facts``). Rank-local facts: ``finish_fast`` makes nothing of them that changes a collective."""

    gemms: bool = False
    """quack's GEMMs run on these operands: an sm_90 GPU, the extra installed, 16-bit row-major hidden states and
    weight of one dtype, 16-byte aligned for TMA (``backends.gemm.hopper_dw_ready``)."""
    epilogue: bool = False
    """quack's logits GEMM with the statistics in its epilogue runs on them: ``gemms`` and bf16 operands (the
    epilogue rounds each logit as a bf16 ``P`` stores it)."""


def extra_facts(hidden: torch.Tensor, weight: torch.Tensor) -> Extra:
    """The ``hopper`` extra's facts for a call whose fast route multiplies ``hidden`` (contiguous, every token the
    route sees) by this rank's valid weight rows ``weight``: asked once per call, here only (the tests stand in for
    an sm_90 GPU by replacing this function)."""
    from .backends import gemm  # the CUDA-side helpers: loaded only where a fast route runs

    ready = gemm.hopper_dw_ready(hidden, weight)
    return Extra(ready, ready and hidden.dtype == torch.bfloat16)


@dataclass(frozen=True)
class Finish:
    """How one call's fast (or speculative) route forms and hands back its gradients (``finish_fast``), decided once
    per call from the plan and this rank's ``Extra``. None of it changes a collective, so each rank may decide it
    alone. The defaults: everything by cuBLAS in forward, as the distillation's fast route always finishes (its two
    logits buffers already take what a ``P`` kept into backward would, and its statistics are the two heads')."""

    epilogue: bool = False
    """The statistics in the logits GEMM's epilogue (``backends.gemm.logits_with_stats``)."""
    defer_dw: bool = False
    """The last chunk's dW GEMM left to backward, where one quack GEMM reads the fp32 accumulator (none with one
    chunk) and writes dW scaled in its 16-bit dtype: only where ``Plan.keep_p`` or there is one chunk."""
    defer_dx: bool = False
    """One chunk, no group: dX's GEMM left to backward too (one quack GEMM writes it scaled)."""
    one_dw: bool = False
    """Under a group, every token's gradient in one ``P`` and this rank's dW in one GEMM (``one_weight_grad_gemm``)."""
    fold_mean: bool = False
    """The cross-entropy's ``mean`` ``1/count`` folded into ``P`` (``Plan.dx_in_forward`` where dX's GEMM runs in
    forward): backward scales by the upstream gradient alone."""


def finish_fast(plan: Plan, opts: LossOptions, tokens: int, d: int, dtype: torch.dtype, needs: tuple[bool, bool, bool],
                valid_rows: int, sharded: bool, main_grad: bool, extra: Extra, bias: bool,
                stats_only: bool = True) -> Finish:
    """The fast route's ``Finish`` for ``tokens`` tokens (all of them under sequence parallelism) and this rank's
    ``valid_rows``: the cross-entropy's, and ``linear_log_prob_loss``'s from its ``finish_options()`` (the logits:
    ``Plan.folded``). quack finishes dX and dW where ``extra.gemms`` and ``P``'s rows (``valid_rows`` apart) are
    16-byte aligned. The
    statistics come from the logits GEMM's epilogue where ``extra.epilogue``, with no ``bias``, ``P``'s rows 16-byte
    aligned in bf16, the options needing of the statistics only the log-sum-exp, the target logit and (smoothing)
    the sum of the logits (``stats_only``: False where the loss needs more before its gradient pass), a logit scale
    only beside a soft cap, and under a group no argmax test (``token_accuracy``: its maxima are over the ranks;
    the entropy, an output only, comes from the gradient pass on every rank there). Deferred GEMMs on the fast
    route only (the speculative route's backward adds to the accumulator) and not into ``main_grad``."""
    formed = plan.route in ("fast", "speculative")
    if not formed or valid_rows == 0:
        return Finish()
    folded = plan.folded
    quack = extra.gemms and (valid_rows * dtype.itemsize) % 16 == 0
    epilogue = (extra.epilogue and stats_only and not bias and valid_rows % 8 == 0
                and (folded.softcap is not None or folded.inv_t == 1.0)
                and not (sharded and "token_accuracy" in opts.metrics))
    defer = plan.route == "fast" and not main_grad and quack
    one_dw = one_weight_grad_gemm(plan, opts, tokens, d, dtype, quack,
                                  plan.route == "fast" and not main_grad and needs[1])
    one_chunk = 0 < tokens <= plan.sizes.chunk
    defer_dw = defer and needs[1] and (plan.keep_p or one_chunk)
    defer_dx = defer and needs[0] and not sharded and one_chunk
    fold = plan.route == "fast" and plan.dx_in_forward and opts.reduction == "mean" and not defer_dx
    return Finish(epilogue, defer_dw, defer_dx, one_dw, fold)


def plan_finish(call: Call, opts: LossOptions, hidden: torch.Tensor, weight: torch.Tensor, bias: bool,
                stats_only: bool = True) -> Finish:
    """``finish_fast`` for one call of the fast (or speculative) route, the ``hopper`` extra asked once
    (``extra_facts``) where that route runs on this rank's rows: ``hidden`` every token the route sees
    (contiguous), ``weight`` this rank's valid rows."""
    plan, shard = call.plan, call.shard
    v = shard.valid_rows
    formed = plan.route in ("fast", "speculative") and v > 0
    extra = extra_facts(hidden, weight) if formed else Extra()
    n, d = hidden.shape
    return finish_fast(plan, opts, n, d, hidden.dtype, call.needs_grad, v, shard.sharded, call.main_grad, extra,
                       bias, stats_only)


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
        if not hidden.is_cuda and hidden.dtype == torch.bfloat16:
            # the interpreter's numpy emulation has no bfloat16: its tl.dot returns garbage, silently
            raise TypeError("hidden: backend='triton' on the CPU interpreter (TRITON_INTERPRET=1) computes bfloat16 "
                            "wrongly; expected float16, float32 or float64 there, got bfloat16 (use backend='torch' "
                            "or 'auto' for bfloat16 on a CPU)")
    return backend


def _dx_reduce(backend: str, route: str, sharded: bool) -> str:
    if not sharded:
        return "none"
    return "forward" if backend == "triton" and route == "fast" else "region"


@dataclass(frozen=True)
class Site:
    """The call site of per-token outputs the caller reduces (``vpce.speculation``): the entry's name, the caller's
    weight (before any autocast cast) and a hashable summary of the call's options."""

    entry: str
    weight: Any
    key: Any


def _speculate(site: Site | None, backend: str, sharded: bool, needs_grad: tuple[bool, bool, bool]):
    """``(speculate, history)``: ``vpce.speculation.decide`` for ``site`` (which alone weighs whether a call is
    eligible), or ``(False, None)`` without one."""
    if site is None:
        return False, None
    return speculation.decide(site.entry, site.weight, site.key, backend, sharded, needs_grad)


def plan_cross_entropy(opts: LossOptions, needs_grad: tuple[bool, bool, bool], backend: str,
                       sharded: bool, sequence_parallel: bool, site: Site | None = None) -> Plan:
    """``site``: the call site where ``reduction="none"`` may take the speculative route (``memory_budget`` not
    ``"lean"``), asked here (``vpce.speculation.decide``)."""
    speculate, history = (False, None)
    if opts.reduction == "none" and not opts.lean:
        speculate, history = _speculate(site, backend, sharded, needs_grad)
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
    return Plan(backend, route, _dx_reduce(backend, route, sharded), sequence_parallel, history=history,
                folded=opts.folded)


def settle(plan: Plan, fit: int) -> Plan:
    """A plan whose route was left to memory, decided by what fits (``FIT_LEAN``, ``FIT_COMPACT``, ``FIT_FAST``,
    ``FIT_WHOLE``)."""
    if plan.route != "auto":
        return plan
    route = "fast" if fit >= FIT_COMPACT else "lean"
    return dataclasses.replace(plan, route=route, dx_reduce=_dx_reduce(plan.backend, route, plan.dx_reduce != "none"),
                               whole=fit >= FIT_WHOLE, compact=fit == FIT_COMPACT)


def round_to(x: int, m: int) -> int:
    return max(m, (x // m) * m)


def _fast_chunk(opts: LossOptions, cols: int, dtype: torch.dtype, d: int, weight_cast: bool = False,
                compact: bool = False) -> int:
    """Tokens per fast-route chunk for ``cols`` vocab columns per rank; equal on every rank (``cols`` is
    ``vocab_size / world``, not V_local; ``weight_cast`` is in the agreement).

    By default ``P`` gets ``Sizing.fast_p_gib``, but never more than the fp32 dW accumulator (at least
    ``Sizing.min_p_gib``): under tensor parallelism the shard's accumulator shrinks with the group and so does
    ``P``. Where the Function casts an fp32 weight (``weight_cast``, autocast), ``P`` and that 16-bit copy together
    stay within the accumulator's size. In a training step the loss's forward is the step's peak (every activation
    is live), and there ``P`` with the copy inside the accumulator's size keeps the step's peak at Liger's. Each
    chunk's dW GEMM reads and writes the accumulator, so fewer chunks are faster, up to the 2 GiB cap. The compact
    route (``compact``) takes at most ``Sizing.compact_p_gib`` and the 16-bit dW's size (docs/benchmarks.md has the
    measurements).
    """
    elem = torch.empty((), dtype=dtype).element_size()
    if isinstance(opts.memory_budget, float):
        gib = opts.memory_budget
    else:
        room = cols * d * (4 - (elem if weight_cast else 0))
        if compact:
            room = min(room, cols * d * elem)
        cap = SIZING.compact_p_gib if compact else SIZING.fast_p_gib
        gib = min(cap, max(SIZING.min_p_gib, room / 2**30))
    return round_to(int(gib * 2**30) // (cols * elem), ROW_ALIGN)


def fast_route_bytes(tokens: int, d: int, rows: int, dtype: torch.dtype, needs: tuple[bool, bool, bool],
                     opts: LossOptions, weight_cast: bool = False, whole: bool = False, compact: bool = False,
                     single: bool = False) -> int:
    """What the fast route holds beyond its inputs and outputs for ``tokens`` tokens (all of them under sequence
    parallelism) and ``rows`` vocab rows: the ``P`` chunk (``whole``: of every token; ``compact``: the compact
    route's), its tile statistics, the fp32 dW accumulator, fp32 dX (none in one process, ``single``:
    ``Plan.dx_in_forward``), and with ``weight_cast`` the weight's copy in the compute dtype that the autograd
    Function makes under autocast (``vpce.prepare.compute_operands``; a bias's copy, ``rows`` 16-bit values, is left
    out). ``settle_by_memory`` weighs it against free memory."""
    elem = torch.empty((), dtype=dtype).element_size()
    chunk = max(tokens, 1) if whole else min(max(tokens, 1), _fast_chunk(opts, max(rows, 1), dtype, d, weight_cast,
                                                                        compact))
    tiles = chunk * 2 * math.ceil(rows / 128) * 4
    dx = tokens * d * 4 if needs[0] and not (single and dtype != torch.float16) else 0
    return (chunk * rows * elem + tiles + dx + (rows * d * 4 if needs[1] else 0)
            + (rows * d * elem if weight_cast else 0))


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
                     opts: LossOptions, extra: int = 0, weight_cast: bool = False, whole: bool = False,
                     compact: bool = False, single: bool = False) -> bool:
    """Whether the fast route's buffers for ``tokens`` tokens (plus ``extra`` bytes; ``whole``: in one chunk;
    ``compact``: the compact route's chunks; ``single``: one process) fit on ``hidden``'s device."""
    need = fast_route_bytes(tokens, hidden.shape[-1], rows, hidden.dtype, needs, opts, weight_cast, whole, compact,
                            single) + extra
    return _fits(need, hidden.device)


def _fit(hidden: torch.Tensor, tokens: int, rows: int, needs: tuple[bool, bool, bool], opts: LossOptions,
         weight_cast: bool, whole_ok: bool, single: bool = False) -> int:
    """What fits in this device's free memory, the fastest first: ``FIT_WHOLE``, ``FIT_FAST``, ``FIT_COMPACT`` or
    ``FIT_LEAN``. ``whole_ok``: a fast route whose chunk may hold every token (the cross-entropy's,
    ``linear_log_prob_loss``'s); the compact route only with dW needed (else the chunks hold no accumulator and
    gain nothing from freeing ``P``). One chunk is weighed only where it replaces chunks that each read and rewrite
    the fp32 dW accumulator (dW needed, more tokens than the default chunk) and its ``P`` holds at most the default
    ``P`` plus that accumulator: at most about two default chunks. Where the ``hopper`` extra finishes dW
    (``backends.gemm``) one chunk allocates no fp32 accumulator, but ``P`` then stays live into backward beside the
    16-bit dW. Not under ``torch.use_deterministic_algorithms(True)``: the chunking (dW's summation order) must not
    depend on free memory there. One chunk is faster where it saves the accumulator's traffic, for the memory of
    the larger ``P``; the compact route is slower than the fast one by that traffic, and faster than the lean
    route's recompute (docs/benchmarks.md)."""
    d = hidden.shape[-1]
    if not _fast_route_fits(hidden, tokens, rows, needs, opts, 0, weight_cast, single=single):
        if needs[1] and _fast_route_fits(hidden, tokens, rows, needs, opts, 0, weight_cast,
                                                      compact=True, single=single):
            return FIT_COMPACT
        return FIT_LEAN
    if not whole_ok or not needs[1] or torch.are_deterministic_algorithms_enabled():
        return FIT_FAST
    elem = torch.empty((), dtype=hidden.dtype).element_size()
    chunk = _fast_chunk(opts, max(rows, 1), hidden.dtype, d, weight_cast)
    if tokens <= chunk or (tokens - chunk) * elem > 4 * d:  # one chunk's P: more than the default's + fp32 dW
        return FIT_FAST
    whole = _fast_route_fits(hidden, tokens, rows, needs, opts, 0, weight_cast, whole=True, single=single)
    return FIT_WHOLE if whole else FIT_FAST


def settle_by_memory(plan: Plan, hidden: torch.Tensor, rows: int, needs: tuple[bool, bool, bool],
                     opts: LossOptions, world: int, weight_cast: bool = False,
                     whole_ok: bool = False) -> tuple[Plan, int | None]:
    """Decide a route left to memory where this rank can: ``(plan, None)``; or, under a group on a long call,
    ``(plan still "auto", what fits here: FIT_LEAN, FIT_COMPACT, FIT_FAST or FIT_WHOLE)`` for the agreement to take
    the smallest
    over the ranks. The speculative route (one process) holds what the fast route holds, plus three fp32 statistics
    per token: with ``memory_budget="auto"`` it becomes the lean route where that does not fit. ``weight_cast``:
    the Function casts the weight under autocast (``fast_route_bytes`` counts that copy; ``_fast_chunk``).
    ``whole_ok``: a fast route that may take every token in one chunk (``_fit``)."""
    # nothing to weigh (CPU interpreter), or no host calls wanted (compiling, or capturing a CUDA graph)
    weigh = not (torch.compiler.is_compiling() or not hidden.is_cuda or torch.cuda.is_current_stream_capturing())
    tokens, d = hidden.numel() // hidden.shape[-1], hidden.shape[-1]
    if plan.route == "speculative":
        if opts.memory_budget != "auto" or not weigh or _fast_route_fits(hidden, tokens, rows, needs, opts,
                                                                         12 * tokens, weight_cast):
            return plan, None
        return dataclasses.replace(plan, route="lean"), None
    if plan.route != "auto":
        return plan, None
    if not weigh:
        return settle(plan, FIT_FAST), None
    if plan.sequence_parallel:
        tokens *= world  # the fast route gathers the sequence
    if world > 1 and tokens * d * 4 < AUTO_CHECK_BYTES:
        return settle(plan, FIT_FAST), None
    fit = _fit(hidden, tokens, rows, needs, opts, weight_cast, whole_ok, single=world == 1)
    if world == 1:
        return settle(plan, fit), None
    return plan, fit


def plan_log_probs(needs_grad: tuple[bool, bool, bool], backend: str, sharded: bool,
                   sequence_parallel: bool, site: Site | None = None, folded: Folded | None = None) -> Plan:
    """``site``: the call site, where the speculative route may be taken (``memory_budget`` not ``"lean"``), asked
    here (``vpce.speculation.decide``); ``folded``: the options' logits (``Plan.folded``; the caller's
    ``LogProbOptions.folded``)."""
    speculate, history = _speculate(site, backend, sharded, needs_grad)
    if not any(needs_grad):
        route = "forward"
    else:
        route = "speculative" if speculate else "lean"
    return Plan(backend, route, _dx_reduce(backend, route, sharded), sequence_parallel, history=history,
                folded=folded)


def plan_log_prob_loss(o: LogProbLossOptions, needs_grad: tuple[bool, bool, bool], backend: str, sharded: bool,
                       sequence_parallel: bool) -> Plan:
    """``linear_log_prob_loss``: the cross-entropy's fast route (``loss_fn`` evaluated per chunk while its logits are
    live; ``"auto"`` weighed against free memory as the cross-entropy's) on the Triton backend for scopes
    ``"token"`` and ``"sequence"``; else the two-pass form (statistics of every token, ``loss_fn``, the recompute),
    as ``linear_log_probs``' lean route: scope ``"batch"`` (it needs every token's statistics first),
    ``memory_budget="lean"``, the torch backend, or no gradient."""
    if backend == "triton" and o.scope != "batch" and o.memory_budget != "lean" and any(needs_grad):
        plan = plan_cross_entropy(o.chunk_options(), needs_grad, backend, sharded, sequence_parallel)
        return dataclasses.replace(plan, folded=o.folded)
    return plan_log_probs(needs_grad, backend, sharded, sequence_parallel, folded=o.folded)


def plan_compiled_cross_entropy(opts: LossOptions, needs_grad: tuple[bool, bool, bool], backend: str,
                                shard: VocabShard, d: int, dtype: torch.dtype, weight_cast: bool) -> Plan:
    """The cross-entropy's plan inside a compiled graph (``vpce.library``'s op; one process), with its sizes: the
    graph's outputs must not depend on free memory, so ``"auto"`` is the fast route in default chunks
    (``FIT_FAST``), never one chunk nor the compact form; and the op scales the held gradients itself, so they
    stay fp32 (``held_fp32``: no dX in the hidden's dtype, no mean folded into ``P``)."""
    plan = settle(plan_cross_entropy(opts, needs_grad, backend, False, False), FIT_FAST)
    return size_cross_entropy(plan, opts, shard, d, dtype, weight_cast, held_fp32=True)


def plan_compiled_distillation(o: DistillOptions, needs_grad: tuple[bool, bool, bool], backend: str,
                               shard: VocabShard, d: int, dtype: torch.dtype) -> Plan:
    """The distillation's plan inside a compiled graph (``vpce.library``'s op; one process), with its sizes: as
    outside (``plan_distillation``; it weighs no memory)."""
    plan = plan_distillation(o.reduction, o.memory_budget == "lean", needs_grad, backend, False, False)
    return size_distillation(plan, o, shard, d, dtype)


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


# -- sizes, once the shard is agreed -----------------------------------------------------------------------------


def _torch_chunk(budget_gib: float, cols: int, dtype: torch.dtype, per_acc: int) -> int:
    """The torch backend's tokens per chunk: ``[C, cols]`` logits in the input dtype and ``per_acc`` fp32 (fp64)
    tensors of that shape fit ``budget_gib``."""
    acc = 8 if dtype == torch.float64 else 4
    per_logit = 2 * torch.finfo(dtype).bits // 8 + per_acc * acc
    return max(1, int(budget_gib * 2**30) // (cols * per_logit))


def _finish(plan: Plan, opts: LossOptions, shard: VocabShard, dtype: torch.dtype, held_fp32: bool) -> dict:
    """How the fast route finishes (``Plan.compact``, ``Plan.keep_p``, ``Plan.dx_in_forward``): a numeric
    ``memory_budget`` is the compact route's; dX in the hidden's dtype in one process."""
    fast = plan.backend == "triton" and plan.route == "fast"
    compact = fast and (plan.compact or isinstance(opts.memory_budget, float))
    single = fast and not shard.sharded
    return dict(compact=compact, dx_in_forward=single and not held_fp32 and dtype != torch.float16)


def size_cross_entropy(plan: Plan, opts: LossOptions, shard: VocabShard, d: int, dtype: torch.dtype,
                       weight_cast: bool = False, held_fp32: bool = False) -> Plan:
    """The cross-entropy's plan with its sizes. Torch: chunks of live logits, their fp32 copy, the probabilities
    and their cast within the budget (the recompute at the default budget). Triton: the fast and speculative
    routes' ``P`` chunk (``_fast_chunk``), else stats-only launches; how the fast route finishes (``_finish``; not
    with ``held_fp32``: ``vpce.library`` scales the held fp32 gradients itself)."""
    cols = shard.columns_per_rank
    if plan.backend == "torch":
        per_acc = 3 if opts.softcap is not None else 2
        sizes = Sizes(_torch_chunk(opts.chunk_gib(), cols, dtype, per_acc),
                      _torch_chunk(DEFAULT_CHUNK_GIB, cols, dtype, per_acc), SIZING.lean_block_gib)
        return dataclasses.replace(plan, sizes=sizes)
    formed = plan.route in ("fast", "speculative")
    finish = _finish(plan, opts, shard, dtype, held_fp32)
    chunk = _fast_chunk(opts, cols, dtype, d, weight_cast, finish["compact"]) if formed else SIZING.stats_tokens
    if plan.whole and plan.route == "fast":
        chunk = WHOLE_CHUNK
    return dataclasses.replace(plan, sizes=Sizes(chunk, SIZING.lean_token_block, SIZING.lean_block_gib), **finish)


def one_weight_grad_gemm(plan: Plan, opts: LossOptions, tokens: int, d: int, dtype: torch.dtype,
                         hopper_dw: bool, defer: bool) -> bool:
    """Whether the cross-entropy's fast route under a group keeps every token's gradient in one ``P`` (``tokens``
    rows) and computes this rank's dW in one GEMM over it, where it would otherwise take ``Sizes.chunk`` tokens per
    ``P`` and one dW GEMM per chunk into an fp32 accumulator. The chunks stay as they are: each chunk's statistics
    are exchanged, its gradient written (in its rows of the larger ``P``) and its dX summed over the group in the
    same order, so this changes no collective and each rank may decide it alone, from its own facts.

    Taken with ``memory_budget="auto"`` where the ``hopper`` extra finishes dW (``hopper_dw``:
    ``backends.gemm.hopper_dw_ready``; ``defer``: dW needed, not into ``main_grad``), so that one quack GEMM writes the
    weight's dtype and no fp32 accumulator is allocated, and where that ``P`` holds no more than the default ``P``
    and the accumulator it replaces (so the peak stays the default's: ``P`` lives into backward either way). In
    default chunks the first chunk's dW GEMM writes that fp32 accumulator and each later one reads and rewrites it
    (the last as quack's C); one GEMM over every token moves none of it (docs/benchmarks.md has the tp=2 reading).
    Under a group with one chunk already (``Plan.whole``, or few tokens) there is nothing to merge; on the compact
    route ``P`` is freed in forward."""
    if not (plan.backend == "triton" and plan.route == "fast" and plan.dx_reduce == "forward" and not plan.whole
            and not plan.compact and opts.memory_budget == "auto" and hopper_dw and defer):
        return False
    chunk = plan.sizes.chunk
    return chunk < tokens and (tokens - chunk) * dtype.itemsize <= 4 * d  # P: at most the default's + the fp32 dW rows


def size_log_probs(plan: Plan, lp: LogProbOptions, shard: VocabShard, d: int, dtype: torch.dtype,
                   weight_cast: bool = False) -> Plan:
    """``linear_log_probs``' plan with its sizes: as the cross-entropy's, at the default budget on the torch
    backend; the speculative route's ``P`` from ``memory_budget`` on the Triton one."""
    cols = shard.columns_per_rank
    if plan.backend == "torch":
        chunk = _torch_chunk(DEFAULT_CHUNK_GIB, cols, dtype, 3 if lp.folded.softcap is not None else 2)
        sizes = Sizes(chunk, chunk, SIZING.lean_block_gib)
    else:
        chunk = _fast_chunk(lp.chunk_options(), cols, dtype, d, weight_cast) \
            if plan.route == "speculative" else SIZING.stats_tokens
        sizes = Sizes(chunk, SIZING.lean_token_block, SIZING.lean_block_gib)
    return dataclasses.replace(plan, sizes=sizes)


def size_log_prob_loss(plan: Plan, o: LogProbLossOptions, shard: VocabShard, d: int, dtype: torch.dtype,
                       weight_cast: bool = False) -> Plan:
    """``linear_log_prob_loss``'s plan with its sizes: the fast route's ``P`` (every token with ``Plan.whole``) and
    finish as the cross-entropy's (scope ``"sequence"``: whole rows, at least one), else the two-pass form's
    statistics launches and recompute blocks, as ``linear_log_probs``' lean route."""
    if plan.backend == "triton" and plan.route == "fast":
        finish = _finish(plan, o.chunk_options(), shard, dtype, False)
        chunk = _fast_chunk(o.chunk_options(), shard.columns_per_rank, dtype, d, weight_cast, finish["compact"])
        if plan.whole:
            chunk = WHOLE_CHUNK
        if o.scope == "sequence":
            chunk = max(o.row, (chunk // o.row) * o.row)
        return dataclasses.replace(plan, sizes=Sizes(chunk, SIZING.lean_token_block, SIZING.lean_block_gib),
                                   **finish)
    return size_log_probs(plan, o.stats_options(), shard, d, dtype, weight_cast)


def size_distillation(plan: Plan, o: DistillOptions, shard: VocabShard, d: int, dtype: torch.dtype) -> Plan:
    """The distillation's plan with its sizes. Torch: about eight fp32 (fp64) ``[C, V_local]`` tensors live (both
    heads' logits, their exps and the gradient's temporaries). Triton: both heads' ``[C, V_local]`` logits buffers
    fit the budget (by default on the fast route ``distill_fast_gib``, at most ``distill_dw_share`` times the fp32
    dW accumulator, at least ``distill_min_gib``; ``distill_lean_gib`` on the lean route), ``C`` a multiple of
    ``ROW_ALIGN`` where it can be; the lean backward's blocks fit the same budget."""
    cols = shard.columns_per_rank
    if plan.backend == "torch":
        chunk = _torch_chunk(o.chunk_gib(), cols, dtype, 8)
        return dataclasses.replace(plan, sizes=Sizes(chunk, chunk, SIZING.lean_block_gib))
    lean_gib = o.memory_budget if isinstance(o.memory_budget, float) else SIZING.distill_lean_gib
    gib = lean_gib
    if plan.route == "fast" and not isinstance(o.memory_budget, float):
        gib = min(SIZING.distill_fast_gib, max(SIZING.distill_min_gib, SIZING.distill_dw_share * cols * d * 4 / 2**30))
    c = max(1, int(gib * 2**30) // (2 * cols * torch.empty((), dtype=dtype).element_size()))
    chunk = c - c % ROW_ALIGN if c >= ROW_ALIGN else c
    return dataclasses.replace(plan, sizes=Sizes(chunk, SIZING.lean_token_block, lean_gib))
