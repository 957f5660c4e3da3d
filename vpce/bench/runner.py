"""One shape, every selected row: the floor, each method's fwd+bwd (frozen-weight rows too), and the no-grad
forwards.

A row is a flat dict (the JSON schema is in ``vpce.bench``'s docstring), measured in phases: can it run here,
build, the first step (checked against the float64 reference), the timed steps, the peak memory of one more step.
Each phase fills the row; the first one that raises ends it (``Unavailable``: ``missing: ...``; anything else:
``failed: ...`` with its traceback). Under ``--tp`` (``vpce.bench.tp``) every rank runs the same phases and the
status is agreed between ranks after each one. Each row is self-contained: it clones the inputs it
differentiates, and everything it allocated is released before the next row starts.

Each row is divided by the floor that fits its mode (``FLOOR_OF_MODE``, the JSON's ``floor_gemms``): a fwd+bwd row
by the three GEMMs, a frozen-weight row (``Method.frozen``) by the logits and dX GEMMs, a no-grad forward by the
logits GEMM alone. All three come from the one ``measure_floor`` of the shape.

**Time limit** (``--row-timeout``, default 300 s): a stalled row must not hang the run, and a kernel stalled on
the GPU cannot be interrupted from inside the process. So each row's phases run in a worker thread; the main
thread waits for it at most ``Settings.row_timeout_s``. A row that does not finish by then is abandoned: it is
reported ``failed: timeout after <s> s (in <phase>)``, the worker thread (a daemon) is left behind, and the run
goes on. Then the device is asked to run one tiny op within ``DEVICE_PROBE_S``: if it cannot (the stalled kernel
still holds the GPU), or if freeing memory between rows fails later (``_free_after``), every remaining row is
reported ``failed: not run: ...`` instead of queueing behind it, the tables and the JSON are written, and ``python
-m vpce.bench`` exits with status 3 through ``os._exit`` (a thread stuck in a CUDA call can block a normal
interpreter exit). Rows measured after an abandoned row that is still computing share the machine with it; the
JSON marks them ``after_timeout``, and they compile their quack kernels in their own thread
(``_compile_in_process``: an abandoned quack autotuner leaves its compile pool on for the process). A subprocess per
row would isolate better but repeats the inputs, the float64 reference and the CUDA context for every row, and
cannot share the device tensors cheaply; under ``--tp`` a hung collective is ended by the process group's
``--timeout`` instead.

A distillation shape (``--distill``, ``Shape.d_teacher``) has a floor row and fwd+bwd rows only; the floor adds the
teacher's logits GEMM to the student's three (``DISTILL_FLOOR_GEMMS``), and each row is checked against the
float64 reference of its own divergence (``References``), computed in the row's first phase after ``can_run``.
"""

from __future__ import annotations

import contextlib
import threading
import time
import traceback
from types import SimpleNamespace
from typing import Callable

import torch

from ..reference import Result
from .harness import (GiB, Env, Problem, Settings, Shape, Timing, err_from_sq, free_memory, gemm_logits_loss,
                      make_problem, measure, peak_extra_bytes, reference_of, sq_err, synchronize)
from .methods import FLOOR, METHODS, Method, divergence_label
from .peers import Unavailable
from .report import Progress

__all__ = ["run_shape", "run_row", "DeviceStalled", "measure_floor", "make_step", "new_row", "public", "reason",
           "run_phases", "floor_phase", "first_reference",
           "fwd_bwd_phases", "FLOOR_OF_MODE", "DISTILL_FLOOR_GEMMS", "References", "floor_label", "shape_record"]

Phase = Callable[[], None]

#: mode of a row: (the GEMMs its floor is made of, the key of that floor in ``measure_floor``'s result).
FLOOR_OF_MODE = {"floor": ("logits+dX+dW", "total_ms"), "fwd+bwd": ("logits+dX+dW", "total_ms"),
                 "frozen": ("logits+dX", "frozen_ms"), "no-grad": ("logits", "logits_ms")}
#: ``floor_gemms`` of the floor and the rows of a distillation shape (the floor's ``total_ms``).
DISTILL_FLOOR_GEMMS = "teacher logits+logits+dX+dW"


def reason(e: BaseException) -> str:
    """One line saying why a row failed."""
    if isinstance(e, torch.OutOfMemoryError):
        return "out of memory"
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0] if lines else ''}".strip()
    return text if len(text) <= 160 else text[:157] + "..."


def new_row(shape: Shape, env: Env, method: str, label: str, mode: str) -> dict:
    """A row with every JSON field, nothing measured yet (a distillation shape's rows also have ``d_teacher``,
    ``divergence`` and ``beta``, and ``ref_loss``: the float64 loss of their divergence)."""
    row = dict(shape=shape.name, n=shape.n, d=shape.d, v=shape.v, tp=env.tp, rank=env.rank, method=method,
               label=label, mode=mode, status="ok", ms=None, ms_min=None, reps=0,
               floor_gemms=FLOOR_OF_MODE[mode][0], floor_ms=None, x_floor=None, extra_gib=None, loss=None,
               loss_err=None, dx_err=None, dw_err=None)
    if shape.distill:
        distill = METHODS[method].distill if method in METHODS else None
        row.update(d_teacher=shape.d_teacher, floor_gemms=DISTILL_FLOOR_GEMMS,
                   divergence=distill and distill[0], beta=distill and distill[1], ref_loss=None)
    return row


def floor_label(shape: Shape, suffix: str = "") -> str:
    """The floor row's label: its GEMMs."""
    return ("floor: teacher logits + 3 GEMMs" if shape.distill else "floor: 3 GEMMs") + suffix


def public(row: dict) -> dict:
    """``row`` without its working fields (keys starting with ``_``)."""
    return {k: v for k, v in row.items() if not k.startswith("_")}


def run_phases(row: dict, phases: list[Phase], agree: Callable[[str], str] | None = None):
    """Run ``phases`` in order and set ``row["status"]``: "ok", or the first ``missing``/``failed`` one.

    ``agree`` (under ``--tp``) maps this rank's status after each phase to the one every rank uses, so that all
    ranks stop at the same phase and their collectives stay in step.
    """
    status = "ok"
    for phase in phases:
        row["_phase"] = phase.__name__
        try:
            phase()
        except Unavailable as e:
            status = f"missing: {e}"
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a peer's failure is a row, not the end of the run; a BaseException too
            # (quack's ``CompilePending`` is one), which would otherwise leave the row "ok" with nothing measured
            status = f"failed: {reason(e)}"
            row["traceback"] = traceback.format_exc()
        if agree is not None:
            status = agree(status)
        if status != "ok":
            break
    row.pop("_phase", None)
    row["status"] = status


#: Seconds the device gets to run one tiny op after a row timed out, before the run is ended as stalled.
DEVICE_PROBE_S = 30.0


class DeviceStalled(RuntimeError):
    """A timed-out row still holds the device: the rows after it cannot run."""


def _device_responds(env: Env, timeout_s: float) -> bool:
    """Whether one tiny op on ``env.device`` completes within ``timeout_s`` (in a thread: it may never return)."""
    done = threading.Event()

    def probe():
        if env.cuda:
            torch.cuda.set_device(env.device)
        torch.ones(1, device=env.device).add_(1)
        synchronize(env.device)
        done.set()
    threading.Thread(target=probe, name="vpce-bench device probe", daemon=True).start()
    return done.wait(timeout_s)


def run_row(row: dict, phases: list[Phase], env: Env, timeout_s: float | None):
    """``run_phases(row, phases)`` within ``timeout_s`` seconds (None or 0: no limit; the module docstring says how).

    Raises ``DeviceStalled`` after a timeout if the device no longer answers; the row is reported first.
    """
    if not timeout_s:
        run_phases(row, phases)
        return
    # The phases write into ``row``; the caller copies it (``public``) as soon as this returns, so an abandoned
    # worker that finishes later changes nothing that is reported.
    done = threading.Event()

    def worker():
        try:
            if env.cuda:
                torch.cuda.set_device(env.device)  # the current device is per thread
            run_phases(row, phases)
        finally:
            done.set()
    started = time.perf_counter()
    threading.Thread(target=worker, name=f"vpce-bench row {row['method']}", daemon=True).start()
    if done.wait(timeout_s):
        return
    row.update(status=f"failed: timeout after {timeout_s:g} s (in {row.get('_phase', 'start')})",
               timeout_s=timeout_s, seconds=time.perf_counter() - started, ms=None, ms_min=None, x_floor=None)
    if not _device_responds(env, DEVICE_PROBE_S):
        raise DeviceStalled(f"{env.device} did not run a tiny op within {DEVICE_PROBE_S:g} s after "
                            f"{row['method']} timed out")


_IN_PROCESS: list = []  # quack's ``suppress_pool``, entered for the rest of the process (``_compile_in_process``)


def _compile_in_process():
    """After a row is abandoned by its time limit, every later row compiles its quack kernels itself. quack's
    autotuner (the first call of its tuned GEMMs) makes a compile pool the whole process's while it tunes (module
    state, ``quack.cache.async_compile.pool_scope``), and then any quack kernel not yet compiled raises
    ``CompilePending`` instead of compiling. A row abandoned while tuning leaves that pool on (quack's base path,
    abandoned at its time limit in its first step, made the next row's first quack GEMM raise ``CompilePending``).
    quack's ``suppress_pool`` turns the pool off for every thread; it stays entered (the abandoned thread may run
    on). Nothing without quack."""
    if _IN_PROCESS:
        return
    try:
        from quack.cache.async_compile import suppress_pool
    except Exception:  # noqa: BLE001 - not installed, or an install that fails to import: no pool to turn off
        return
    ctx = suppress_pool()
    ctx.__enter__()
    _IN_PROCESS.append(ctx)


def _free_after(env: Env, abandoned: str | None) -> str | None:
    """``free_memory`` between rows; None, or why the run must end. After a row abandoned by its time limit the
    device call can fail because of what that row's thread still does (quack's first step, abandoned while it
    captured a CUDA graph, made the next ``synchronize`` raise "operation not permitted when stream is
    capturing"): the remaining rows are then reported ``failed: not run`` and the tables written,
    as for a stalled device. Without an abandoned row the error propagates."""
    try:
        free_memory(env.device)
    except Exception as e:  # noqa: BLE001 - only after a timeout, where the abandoned thread may be the cause
        if abandoned is None:
            raise
        return f"{env.device} failed after {abandoned} timed out: {type(e).__name__}: {str(e).splitlines()[0]}"
    return None


def _record_timing(row: dict, timing: Timing, floor_ms: float | None):
    row["ms"], row["ms_min"], row["reps"] = timing.median, timing.min, len(timing.samples)
    row["floor_ms"] = floor_ms
    if floor_ms:
        row["x_floor"] = timing.median / floor_ms


def _record_loss(row: dict, loss: torch.Tensor, ref: Result):
    row["loss"] = float(loss.detach().double())
    ref_loss = float(ref.loss)
    row["loss_err"] = abs(row["loss"] - ref_loss) / abs(ref_loss)


def measure_floor(shape: Shape, prob: Problem, env: Env, settings: Settings, agree=None) -> dict[str, float]:
    """The three GEMMs of exact fwd+bwd, in the run's dtype through cuBLAS: logits, dX and dW; their sum
    ``total_ms``, and ``frozen_ms`` = logits + dX, the floor of a frozen weight (no dW).

    ``G`` stands in for the logits' gradient: random ``[N, V]`` in the run's dtype (GEMM speed depends on data).
    Under ``--tp`` ``prob.w`` is this rank's shard, so ``V`` is its rows; ``agree`` is passed on to ``measure``.

    A distillation problem (``prob.xt``) adds the teacher's logits GEMM ``[N, D_T] @ [D_T, V]``
    (``teacher_logits_ms``) to ``total_ms``, the floor of its rows, and has no ``frozen_ms``.

    Where ``G`` and the logits ``[N, V]`` would not fit in the device's free memory (the Llama-3-8B head at
    N = 262144 needs 134 GB for them), each GEMM runs over ``chunks`` equal token chunks (the fewest, a power of
    2, that fit; ``chunks`` in the result): the same FLOP in GEMMs of at least ``N / chunks`` rows, and dW as
    ``chunks`` GEMMs of ``K = N / chunks`` without their sum. At these sizes the floor's time is in proportion to
    N (docs/benchmarks.md).
    """
    x, w, xt, wt = prob.x, prob.w, prob.xt, prob.wt
    n, v = x.shape[0], w.shape[0]
    chunks = _floor_chunks(n, v, env)
    rows = -(-n // chunks)
    cuts = [slice(a, min(n, a + rows)) for a in range(0, n, rows)]
    gen = torch.Generator(device=env.device).manual_seed(settings.seed + 1)
    g = torch.randn(rows, v, device=env.device, generator=gen).to(env.dtype)

    def each(gemm):
        def run():
            for c in cuts:
                gemm(c)  # its output freed before the next chunk's
        return run
    gemms = {"logits_ms": each(lambda c: torch.mm(x[c], w.t())),                # [N, D] @ [D, V]
             "dx_ms": each(lambda c: torch.mm(g[: c.stop - c.start], w)),       # [N, V] @ [V, D]
             "dw_ms": each(lambda c: torch.mm(g[: c.stop - c.start].t(), x[c]))}  # [V, N] @ [N, D]
    if xt is not None:
        gemms = {"teacher_logits_ms": each(lambda c: torch.mm(xt[c], wt.t())), **gemms}  # [N, D_T] @ [D_T, V]
    out = {"chunks": chunks}
    for key, fn in gemms.items():
        fn()
        out[key] = measure(fn, env.device, settings, agree).median
    out["total_ms"] = out["logits_ms"] + out["dx_ms"] + out["dw_ms"]
    if xt is None:
        out["frozen_ms"] = out["logits_ms"] + out["dx_ms"]
    else:
        out["total_ms"] += out["teacher_logits_ms"]
    return out


def _floor_chunks(n: int, v: int, env: Env) -> int:
    """Token chunks of the floor's GEMMs: 1, or the fewest (a power of 2) whose ``G`` (drawn in fp32) and logits
    ``[N / chunks, V]`` take at most 90 % of the device's free memory."""
    if not env.cuda:
        return 1
    free, _ = torch.cuda.mem_get_info(env.device)
    elem = torch.finfo(env.dtype).bits // 8
    need = n * v * max(4 + elem, 2 * elem)
    chunks = 1
    while need / chunks > 0.9 * free and chunks < n:
        chunks *= 2
    return chunks


def floor_phase(row: dict, shape: Shape, prob: Problem, env: Env, settings: Settings, agree_time=None) -> Phase:
    """The floor row's one phase: ``measure_floor``, kept in ``row["_floor"]`` for the shape record."""
    def floor():
        out = measure_floor(shape, prob, env, settings, agree_time)
        row.update(ms=out["total_ms"], floor_ms=out["total_ms"], x_floor=1.0, reps=None, _floor=out)
        if out["chunks"] > 1:
            row["label"] += f" (over {out['chunks']} token chunks)"
    return floor


def make_step(fn, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, *extra: torch.Tensor):
    """One timed step: ``x.grad = w.grad = None; loss = fn(x, w, y, *extra); loss.backward()`` (``extra``: the
    teacher's ``xt``, ``wt`` of a distillation row).

    A loss function may carry ``fn.context``, a context-manager factory that must hold over its forward and its
    backward both (torch's ``loss_parallel``).
    """
    context = getattr(fn, "context", contextlib.nullcontext)

    def step():
        x.grad = w.grad = None
        with context():
            loss = fn(x, w, y, *extra)
            loss.backward()
        return loss
    return step


class References:
    """The float64 reference each row is checked against, computed when a row first asks for it: the
    cross-entropy's, or under ``--distill`` the one of the row's divergence (``Method.distill``).

    Only the latest is kept: the rows come grouped by divergence (table order), so each is computed once, and at
    most one reference's ``dX`` and ``dW`` are held while rows run. ``where`` are ``reference_of``'s keywords of
    the layout (under ``--tp``: the group and the shards; every rank asks for the same references in the same
    order, so their collectives line up). ``losses`` and ``seconds`` are for the shape's record, and on one
    device (no ``group``) ``logits_errs``: each divergence's loss error from the GEMM's logits alone
    (``harness.gemm_logits_loss``).
    """

    def __init__(self, prob: Problem, settings: Settings, progress: Progress | None = None, **where):
        self.prob, self.settings, self.progress, self.where = prob, settings, progress, where
        self.key, self.ref = None, None
        self.losses: dict[str, float] = {}
        self.logits_errs: dict[str, float] = {}
        self.seconds = 0.0

    def of(self, distill: tuple[str, float | None] | None) -> Result:
        if self.ref is None or distill != self.key:
            self.ref = None
            free_memory(self.prob.x.device)
            ref, seconds = reference_of(self.prob, self.settings, distill=distill, **self.where)
            self.key, self.ref = distill, ref
            self.seconds += seconds
            name = "cross-entropy" if distill is None else divergence_label(distill)
            self.losses[name] = float(ref.loss)
            if distill is not None and self.where.get("group") is None:
                self.logits_errs[name] = abs(gemm_logits_loss(self.prob, distill, self.settings) - float(ref.loss)) \
                    / abs(float(ref.loss))
                free_memory(self.prob.x.device)
            if distill is not None and self.progress is not None:
                self.progress.note(f"float64 reference of the {name} in {seconds:.1f} s (loss {float(ref.loss):.6f})")
        return self.ref


def fwd_bwd_phases(row: dict, method: Method, env: Env, settings: Settings, prob: Problem,
                   ref: Result | References, *, floor_ms: float | None, x_in: torch.Tensor | None = None,
                   ref_dx: Callable[[torch.Tensor], torch.Tensor] | None = None,
                   extra: tuple[torch.Tensor, ...] | None = None, shard_rows: list[int] | None = None,
                   agree_time=None) -> list[Phase]:
    """The phases of a fwd+bwd row: can it run here, its reference, build, first step, timed steps, peak memory.

    The first step (it compiles or autotunes) is the one checked: loss against ``ref.loss``, ``x.grad`` against
    ``ref_dx(ref.dhidden)`` (default: all of it) and ``w.grad`` against ``ref.dweight``; ``row["_dx_sq"]`` and
    ``row["_dw_sq"]`` keep the squared errors, which combine over ranks. ``ref`` is the reference, or the shape's
    ``References``, asked in the row's second phase for the one of ``method.distill``. A frozen row's weight does
    not require grad: its ``w.grad`` must stay None, and there is no ``dW`` error; a ``Method.main_grad`` row's
    ``w.grad`` must stay None too, and its ``dW`` is ``w.main_grad``. ``x_in`` (default ``prob.x``)
    is the hidden input (under ``--sp`` this rank's slice), ``extra`` (default ``prob.extra``) the loss function's
    arguments after the targets (the teacher's, under ``--sp`` its hidden slice); ``agree_time`` is passed on to
    ``measure``.
    """
    x_in = prob.x if x_in is None else x_in
    extra = prob.extra if extra is None else extra
    live = SimpleNamespace(fn=None, step=None, x=None, w=None, ref=None, ref_dx=None)

    def can_run():
        method.require(env, shard_rows)

    def reference():
        live.ref = ref.of(method.distill) if isinstance(ref, References) else ref
        live.ref_dx = live.ref.dhidden if ref_dx is None else ref_dx(live.ref.dhidden)
        if "ref_loss" in row:
            row["ref_loss"] = float(live.ref.loss)

    def build():
        live.fn = method.build(env)
        if "note" in row:  # --tp rows say how the peer's hidden states enter the vocab-parallel region
            row["note"] = getattr(live.fn, "note", None) or None

    def first_step():
        live.x = x = x_in.detach().clone().requires_grad_()
        live.w = w = prob.w.detach().clone().requires_grad_(not method.frozen)
        if method.main_grad:
            w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        live.step = make_step(live.fn, x, w, prob.y, *extra)
        loss = live.step()
        synchronize(env.device)
        if (method.frozen or method.main_grad) and w.grad is not None:
            raise RuntimeError("the frozen weight got a gradient" if method.frozen else
                               "the weight got a .grad beside its main_grad")
        ref = live.ref
        if method.plain:
            _record_loss(row, loss, ref)
            row["_dx_sq"] = sq_err(x.grad, live.ref_dx)
            dw = w.main_grad if method.main_grad else w.grad
            row["_dw_sq"] = None if method.frozen else sq_err(dw, ref.dweight)
            row["dx_err"], row["dw_err"] = err_from_sq(row["_dx_sq"]), err_from_sq(row["_dw_sq"])
        else:
            row["loss"] = float(loss.detach())

    def timed():
        live.x.grad = live.w.grad = None
        free_memory(env.device)
        _record_timing(row, measure(live.step, env.device, settings, agree_time), floor_ms)

    def memory():
        live.x.grad = live.w.grad = None
        free_memory(env.device)
        row["extra_gib"] = peak_extra_bytes(live.step, env.device) / GiB

    return [can_run, reference, build, first_step, timed, memory]


def _no_grad_phases(row: dict, method: Method, env: Env, settings: Settings, prob: Problem, ref: Result,
                    gemm_ms: float | None) -> list[Phase]:
    """The phases of a forward under ``torch.no_grad()``, timed against the logits GEMM alone."""
    live = SimpleNamespace(forward=None)

    def can_run():
        method.require(env)

    def build():
        fn = method.build(env)

        def forward():
            with torch.no_grad():
                return fn(prob.x, prob.w, prob.y)
        live.forward = forward

    def first_call():
        _record_loss(row, live.forward(), ref)

    def timed():
        free_memory(env.device)
        _record_timing(row, measure(live.forward, env.device, settings), gemm_ms)

    def memory():
        free_memory(env.device)
        row["extra_gib"] = peak_extra_bytes(live.forward, env.device) / GiB

    return [can_run, build, first_call, timed, memory]


def shape_record(shape: Shape, env: Env) -> dict:
    """The JSON record of ``shape`` before anything is measured: its sizes, FLOP of one exact fwd+bwd and the bytes
    of its gradients and inputs (a distillation shape: the teacher's logits GEMM and inputs included)."""
    elem = torch.finfo(env.dtype).bits // 8
    n, d, v = shape.n, shape.d, shape.v
    record = dict(name=shape.name, n=n, d=d, v=v, sweeps=list(shape.sweeps), flops_fwd_bwd=6 * n * d * v,
                  grads_gib=(n * d + v * d) * elem / GiB, inputs_gib=(n * d + v * d) * elem / GiB + n * 8 / GiB,
                  ref_loss=None, ref_seconds=None, floor=None)
    if shape.distill:
        dt = shape.d_teacher
        record.update(d_teacher=dt, flops_fwd_bwd=record["flops_fwd_bwd"] + 2 * n * dt * v,
                      inputs_gib=record["inputs_gib"] + (n * dt + v * dt) * elem / GiB, ref_losses={})
        del record["ref_loss"]
    return record


def first_reference(shape: Shape, refs: References, record: dict, env: Env, progress: Progress, t0: float):
    """The float64 reference of the plain loss, computed before the first row (None for the distillation: one
    reference per divergence, each computed before the first row that needs it); its loss and time go into
    ``record``."""
    if shape.distill:
        progress.note(f"inputs in {time.perf_counter() - t0:.1f} s")
        return None
    ref = refs.of(None)
    free_memory(env.device)
    record["ref_loss"], record["ref_seconds"] = float(ref.loss), refs.seconds
    progress.note(f"inputs + float64 reference in {time.perf_counter() - t0:.1f} s (loss {record['ref_loss']:.6f})")
    return ref


def run_shape(shape: Shape, env: Env, names: list[str], settings: Settings, progress: Progress,
              *, no_grad: bool = True) -> tuple[dict, list[dict]]:
    """Measure every selected row on fresh inputs of ``shape``; returns (shape record, rows)."""
    methods = [METHODS[n] for n in names if n != FLOOR]
    entries = ([(None, "floor")] if FLOOR in names else []) + \
        [(m, "frozen" if m.frozen else "fwd+bwd") for m in methods] + \
        [(m, "no-grad") for m in methods if no_grad and m.no_grad]
    progress.shape(shape, env, len(entries))

    t0 = time.perf_counter()
    prob = make_problem(shape, env, settings)
    refs = References(prob, settings, progress)
    record = shape_record(shape, env)
    ref = first_reference(shape, refs, record, env, progress, t0)

    rows = []
    floor = {}
    limit = settings.row_timeout_s
    stalled = abandoned = None
    for m, mode in entries:
        if m is None:
            row = new_row(shape, env, FLOOR, floor_label(shape), "floor")
            phases = [floor_phase(row, shape, prob, env, settings)]
        else:
            row = new_row(shape, env, m.name, m.row_label(env) + (" no-grad" if mode == "no-grad" else ""), mode)
            floor_ms = floor.get(FLOOR_OF_MODE[mode][1])
            if mode == "no-grad":
                phases = _no_grad_phases(row, m, env, settings, prob, ref, floor_ms)
            else:
                phases = fwd_bwd_phases(row, m, env, settings, prob, refs if shape.distill else ref,
                                        floor_ms=floor_ms)
        progress.start(row)
        if stalled is not None:
            row["status"] = f"failed: not run: {stalled}"
        else:
            if abandoned is not None:
                row["after_timeout"] = abandoned  # shares the machine with a row that may still be computing
            try:
                run_row(row, phases, env, limit)
            except DeviceStalled as e:
                stalled = str(e)
            if row["status"].startswith("failed: timeout"):
                abandoned = row["method"]
                _compile_in_process()
        if m is None:
            floor = row.get("_floor", {})
            record["floor"] = floor or None
        if stalled is None:
            stalled = _free_after(env, abandoned)
        rows.append(public(row))
        progress.finish(row)
    if shape.distill:
        record["ref_losses"], record["ref_seconds"] = refs.losses, refs.seconds
        record["gemm_logits_loss_errs"] = refs.logits_errs

    del prob, ref, refs
    if stalled is None:
        stalled = _free_after(env, abandoned)
    if stalled is not None:
        record["stalled"] = stalled
    return record, rows
