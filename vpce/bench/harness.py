"""Measurement primitives: inputs, timing, peak memory and relative error (the float64 references themselves are
``vpce.reference.chunked_reference`` and, under ``--distill``, ``chunked_reference_distillation``).

Nothing here knows about any particular loss implementation; ``vpce.bench.runner`` combines these into rows.
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from ..memory import PeakMemory
from ..reference import Result, chunked_reference, chunked_reference_distillation, distillation_per_token

__all__ = ["GiB", "Env", "Shape", "Settings", "Problem", "Timing", "make_problem", "reference_of", "gemm_logits_loss",
           "sq_err",
           "err_from_sq", "measure", "peak_extra_bytes", "free_memory", "synchronize"]

GiB = 2**30


@dataclass(frozen=True, kw_only=True)
class Env:
    """Where and how the rows run. Under ``--tp`` (torchrun) every rank has its own ``Env``."""

    device: torch.device
    """The device every tensor lives on."""
    dtype: torch.dtype
    """Dtype of the hidden states and the weight (the GEMMs of the floor run in it too)."""
    group: Any = None
    """Process group the vocab is sharded over; None: one GPU, the whole vocab."""
    tp: int = 1
    """Ranks in ``group``."""
    rank: int = 0
    """This rank's index in ``group``."""
    sequence_parallel: bool = False
    """Under ``--tp --sp``: each rank's hidden input is its slice of the tokens along dim 0 (Megatron SP); the
    targets stay full."""
    vocab_start: int | None = None
    """Under ``--tp``, per shape: the global id of this rank's first vocab row."""
    vocab_size: int | None = None
    """Under ``--tp``, per shape: the vocab size. vpce's rows pass both, as the Megatron and DTensor paths do, so
    that a call reads nothing back on the host (see docs/api.md, "Across the ranks of a group")."""

    def vpce_layout(self) -> dict:
        """The ``group``, ``vocab_start``, ``vocab_size`` and ``sequence_parallel`` keywords of vpce's rows."""
        return dict(group=self.group, vocab_start=self.vocab_start, vocab_size=self.vocab_size,
                    sequence_parallel=self.sequence_parallel)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass(frozen=True, kw_only=True)
class Shape:
    """One problem size: ``N`` tokens, hidden size ``D``, vocab ``V`` (and, for distillation, the teacher's hidden
    size ``D_T``)."""

    name: str
    n: int
    d: int
    v: int
    sweeps: tuple[str, ...] = ()
    """Sweep axes ("N", "D", "V") this point belongs to; empty for a named shape."""
    d_teacher: int | None = None
    """The teacher head's hidden size under ``--distill`` (its weight is ``[V, D_T]``); None: the cross-entropy
    problem, one head."""

    @property
    def distill(self) -> bool:
        return self.d_teacher is not None

    def describe(self) -> str:
        teacher = f" D_T={self.d_teacher}" if self.distill else ""
        return f"{self.name} (N={self.n} D={self.d}{teacher} V={self.v})"


@dataclass(frozen=True, kw_only=True)
class Settings:
    """How hard each row is measured."""

    warmup: int = 3
    """Calls after the first (which compiles/autotunes and is used for accuracy) before timing starts."""
    min_reps: int = 10
    """Fewest timed calls per row."""
    max_reps: int = 200
    """Most timed calls per row."""
    rep_time_s: float = 1.5
    """Timed calls per row are chosen so that they take about this long (within min_reps..max_reps)."""
    settle_s: float = 0.0
    """Seconds of untimed calls, back to back, between the warm-up estimate and the timed calls (``--settle``): a
    GPU at its power limit (an H100 or H200 SXM at 700 W under these GEMMs) holds its top clock for a fraction of a
    second after idling, then settles lower; with ``settle_s`` about 1 every row, the floor's GEMMs included, is
    timed in that settled state instead of partly in the boost that follows the row's own set-up
    (docs/benchmarks.md). 0 (the default): none."""
    logit_scale: float = 1.0
    """Standard deviation of the logits: ``w ~ N(0, logit_scale**2 / D)`` against ``x ~ N(0, 1)``."""
    seed: int = 0
    """Seed of the inputs; each shape draws fresh inputs from ``(seed, N, D, V)``."""
    ref_chunk_gib: float = 1.0
    """Size of one chunk of float64 logits in the reference (``vpce.reference.chunked_reference``)."""
    row_timeout_s: float | None = 300.0
    """Longest a row may run (every phase together) before it is abandoned as ``failed: timeout``
    (``vpce.bench.runner.run_row``); None or 0: no limit."""


@dataclass
class Problem:
    """Inputs of one shape, allocated once and shared by every row (rows clone what they differentiate)."""

    x: torch.Tensor
    """Hidden states ``[N, D]``."""
    w: torch.Tensor
    """lm_head weight ``[V, D]``."""
    y: torch.Tensor
    """Targets ``[N]`` int64, uniform over the vocab, none ignored."""
    xt: torch.Tensor | None = None
    """Distillation: the teacher's hidden states ``[N, D_T]`` (None for the cross-entropy)."""
    wt: torch.Tensor | None = None
    """Distillation: the teacher's lm_head weight ``[V, D_T]`` (None for the cross-entropy)."""

    @property
    def extra(self) -> tuple[torch.Tensor, ...]:
        """The loss function's arguments after ``(x, w, y)``: ``(xt, wt)`` for distillation, none for the
        cross-entropy."""
        return () if self.xt is None else (self.xt, self.wt)


@dataclass
class Timing:
    """Times of the timed calls, in milliseconds."""

    samples: list[float] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)


def ready_extra(env: Env) -> bool:
    """Build the ``hopper`` extra's kernels for the bench's dtype and wait for them (``vpce.build_hopper_kernels``),
    so that vpce's rows time the route they run in a steady state: a process's first calls run without them while
    they build. False where there is no sm_90 GPU or no extra."""
    if env.device.type != "cuda" or env.dtype not in (torch.bfloat16, torch.float16):
        return False
    import vpce

    return vpce.build_hopper_kernels(env.device, env.dtype)


def synchronize(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device):
    """Return everything unreferenced to the system, so that one row's leftovers don't show in the next.

    On CUDA the allocator's counters see every live block, so unreachable cycles are collected first. On a CPU
    ``PeakMemory`` counts only the storages a call creates, so leftovers cannot show; the full collection (0.1-0.3 s
    with transformers, TRL and megatron-core imported, several times a row) is skipped there.
    """
    if device.type == "cuda":
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def make_problem(shape: Shape, env: Env, settings: Settings) -> Problem:
    """Fresh random inputs for ``shape``: ``x ~ N(0, 1)``, ``w ~ N(0, s**2 / D)``, so logits ~ N(0, s**2).

    ``s = settings.logit_scale`` (default 1, the distribution of the project's anchor measurements of the peers,
    quoted in docs/benchmarks.md). Not zeros: GEMM
    speed depends on the data, and flat or constant logits would hide softmax numerics.

    A distillation shape (``shape.d_teacher``) also gets a teacher head drawn the same way from its own generator,
    ``(seed, N, D_T, V, 1)``: ``xt ~ N(0, 1)`` ``[N, D_T]`` and ``wt ~ N(0, s**2 / D_T)`` ``[V, D_T]``, independent
    of the student's. The student's ``x``, ``w`` and ``y`` are those of the cross-entropy problem of ``(N, D, V)``.
    """
    seed = hash((settings.seed, shape.n, shape.d, shape.v)) % 2**63  # int tuples hash the same in every process
    gen = torch.Generator(device=env.device).manual_seed(seed)
    x = torch.randn(shape.n, shape.d, device=env.device, generator=gen).to(env.dtype)
    w = torch.randn(shape.v, shape.d, device=env.device, generator=gen)
    w = w.mul_(settings.logit_scale / math.sqrt(shape.d)).to(env.dtype)
    y = torch.randint(0, shape.v, (shape.n,), device=env.device, generator=gen)
    if not shape.distill:
        return Problem(x=x, w=w, y=y)
    seed = hash((settings.seed, shape.n, shape.d_teacher, shape.v, 1)) % 2**63
    gen = torch.Generator(device=env.device).manual_seed(seed)
    xt = torch.randn(shape.n, shape.d_teacher, device=env.device, generator=gen).to(env.dtype)
    wt = torch.randn(shape.v, shape.d_teacher, device=env.device, generator=gen)
    wt = wt.mul_(settings.logit_scale / math.sqrt(shape.d_teacher)).to(env.dtype)
    return Problem(x=x, w=w, y=y, xt=xt, wt=wt)


def reference_of(prob: Problem, settings: Settings, *, group=None, vocab_start: int = 0,
                 max_rows: int | None = None, shard_rows: list[int] | None = None,
                 distill: tuple[str, float | None] | None = None) -> tuple[Result, float]:
    """The float64 reference of ``prob`` (under ``group``, of this rank's shard ``prob.w``) and the seconds it took:
    ``vpce.reference.chunked_reference`` of the cross-entropy, or with ``distill = (divergence, beta)``
    ``vpce.reference.chunked_reference_distillation`` of that divergence between the student ``(x, w)`` and the
    teacher ``(xt, wt)`` (under ``group`` it needs ``shard_rows``, every rank's rows)."""
    t0 = time.perf_counter()
    if distill is None:
        ref = chunked_reference(prob.x, prob.w, prob.y, chunk_gib=settings.ref_chunk_gib, group=group,
                                vocab_start=vocab_start, max_rows=max_rows)
    else:
        ref = chunked_reference_distillation(prob.x, prob.w, prob.xt, prob.wt, divergence=distill[0],
                                             beta=distill[1], chunk_gib=settings.ref_chunk_gib, group=group,
                                             shard_rows=shard_rows)
    synchronize(prob.x.device)
    return ref, time.perf_counter() - t0


def gemm_logits_loss(prob: Problem, distill: tuple[str, float | None], settings: Settings) -> float:
    """The mean divergence ``distill = (divergence, beta)`` of ``prob`` (one device, the whole vocab), in float64
    from both heads' logits as the GEMM writes them in the inputs' dtype (``F.linear``, token chunks whose float64
    ``[C, V]`` takes ``settings.ref_chunk_gib``). Plain torch and vpce's Triton backend both start from such
    logits, so its distance from the float64 reference is the loss error they inherit before any arithmetic of
    their own: on an H200 mostly the tensor cores' accumulation, which shrinks cuBLAS's logits as a whole by about
    1e-9 of their size per K element (docs/benchmarks.md, run 2b1e21c)."""
    n, v = prob.x.shape[0], prob.w.shape[0]
    rows = max(1, int(settings.ref_chunk_gib * GiB) // (8 * max(v, 1)))
    total = torch.zeros((), dtype=torch.float64, device=prob.x.device)
    for c0 in range(0, n, rows):
        sl = slice(c0, c0 + rows)
        s = torch.log_softmax(torch.nn.functional.linear(prob.x[sl], prob.w).double(), dim=-1)
        u = torch.log_softmax(torch.nn.functional.linear(prob.xt[sl], prob.wt).double(), dim=-1)
        total += distillation_per_token(s, u, distill[0], distill[1]).sum()
        del s, u
    return float(total) / max(n, 1)


def sq_err(a: torch.Tensor | None, b: torch.Tensor, rows: int = 4096) -> tuple[float, float] | None:
    """``(||a - b||^2, ||b||^2)`` in float64, a block of rows at a time (no float64 copy of a whole ``[V, D]``);
    sums of these combine over ranks."""
    if a is None:
        return None
    if a.shape != b.shape:
        raise ValueError(f"gradient: expected shape {tuple(b.shape)}, got {tuple(a.shape)}")
    num = torch.zeros((), dtype=torch.float64, device=b.device)
    den = torch.zeros((), dtype=torch.float64, device=b.device)
    for r0 in range(0, b.shape[0], rows):
        bb = b[r0:r0 + rows].double()
        num += (a[r0:r0 + rows].double() - bb).square().sum()
        den += bb.square().sum()
    return num.item(), den.item()


def err_from_sq(sq: tuple[float, float] | None) -> float | None:
    """``||a - b|| / ||b||`` from ``sq_err``'s ``(||a - b||^2, ||b||^2)`` (or from their sums over ranks)."""
    if sq is None:
        return None
    return math.sqrt(sq[0] / sq[1]) if sq[1] > 0 else math.inf


def measure(fn: Callable[[], Any], device: torch.device, settings: Settings,
            agree: Callable[[float], float] | None = None) -> Timing:
    """Median-of-many timing of ``fn`` (already called once by the caller).

    ``settings.warmup`` synchronized calls estimate the cost of one call; then ``reps`` calls run back to back,
    each bracketed by CUDA events (``time.perf_counter`` on CPU), with a single synchronization at the end, as
    ``triton.testing.do_bench`` does (without its L2 flush: every operand here is far larger than L2).

    ``agree`` (under ``--tp``) maps this rank's estimate to the one every rank uses, so that all ranks run the
    same number of calls; it is a collective, so the timed calls also start together. ``settings.settle_s``
    seconds of untimed calls (their number from that agreed estimate, so equal on every rank) run before the timed
    ones, back to back with them.
    """
    est = math.inf
    for _ in range(max(1, settings.warmup)):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        est = min(est, time.perf_counter() - t0)
    if agree is not None:
        est = agree(est)
    reps = int(min(settings.max_reps, max(settings.min_reps, settings.rep_time_s / max(est, 1e-6))))
    for _ in range(math.ceil(settings.settle_s / max(est, 1e-6))):  # settle_s 0: none
        fn()
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return Timing([s.elapsed_time(e) for s, e in events])
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return Timing(samples)


def peak_extra_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    """Peak bytes allocated by one call of ``fn`` above what was live before it (``vpce.memory.PeakMemory``).

    The caller allocates the inputs and drops the previous gradients first, so the peak covers everything the
    call creates, the gradients it leaves behind included.
    """
    gc.collect()
    with PeakMemory(device) as pm:
        fn()
    return pm.peak
