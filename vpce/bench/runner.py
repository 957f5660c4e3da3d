"""One shape, every selected row: the floor, each method's fwd+bwd, and the no-grad forwards.

A row is a flat dict (the JSON schema is in ``vpce.bench``'s docstring). Each row is self-contained: it clones
the inputs it differentiates, and everything it allocated is released before the next row starts.
"""

from __future__ import annotations

import contextlib
import time
import traceback

import torch

from .harness import (GiB, Env, Problem, Reference, Settings, Shape, float64_reference, free_memory, make_problem,
                      measure, peak_extra_bytes, rel_err, synchronize)
from .methods import FLOOR, METHODS, Method, Unavailable
from .report import Progress

__all__ = ["run_shape", "measure_floor", "make_step"]


def _reason(e: BaseException) -> str:
    if isinstance(e, torch.OutOfMemoryError):
        return "out of memory"
    lines = str(e).strip().splitlines()
    text = f"{type(e).__name__}: {lines[0] if lines else ''}".strip()
    return text if len(text) <= 160 else text[:157] + "..."


def _row(shape: Shape, env: Env, method: str, label: str, mode: str) -> dict:
    return dict(shape=shape.name, n=shape.n, d=shape.d, v=shape.v, tp=env.tp, rank=env.rank, method=method,
                label=label, mode=mode, status="ok", ms=None, ms_min=None, reps=0, floor_ms=None, x_floor=None,
                extra_gib=None, loss=None, loss_err=None, dx_err=None, dw_err=None)


def _finish(row: dict, timing, floor_ms: float | None):
    row["ms"], row["ms_min"], row["reps"] = timing.median, timing.min, len(timing.samples)
    row["floor_ms"] = floor_ms
    if floor_ms:
        row["x_floor"] = timing.median / floor_ms


def _loss_err(loss: torch.Tensor, ref: Reference) -> tuple[float, float]:
    value = float(loss.detach().double())
    return value, abs(value - ref.loss) / abs(ref.loss)


def measure_floor(shape: Shape, prob: Problem, env: Env, settings: Settings, agree=None) -> dict[str, float]:
    """The three GEMMs of exact fwd+bwd, in the run's dtype through cuBLAS: logits, dX and dW.

    ``G`` stands in for the logits' gradient: random ``[N, V]`` in the run's dtype (GEMM speed depends on data).
    Under ``--tp`` ``prob.w`` is this rank's shard, so ``V`` is its rows; ``agree`` is passed on to ``measure``.
    """
    gen = torch.Generator(device=env.device).manual_seed(settings.seed + 1)
    g = torch.randn(prob.x.shape[0], prob.w.shape[0], device=env.device, generator=gen).to(env.dtype)
    x, w = prob.x, prob.w
    gemms = {"logits_ms": lambda: torch.mm(x, w.t()),   # [N, D] @ [D, V]
             "dx_ms": lambda: torch.mm(g, w),           # [N, V] @ [V, D]
             "dw_ms": lambda: torch.mm(g.t(), x)}       # [V, N] @ [N, D]
    out = {}
    for key, fn in gemms.items():
        fn()
        out[key] = measure(fn, env.device, settings, agree).median
    out["total_ms"] = out["logits_ms"] + out["dx_ms"] + out["dw_ms"]
    return out


def make_step(fn, x: torch.Tensor, w: torch.Tensor, y: torch.Tensor):
    """One timed step: ``x.grad = w.grad = None; loss = fn(x, w, y); loss.backward()``.

    A loss function may carry ``fn.context``, a context-manager factory that must hold over its forward and its
    backward both (torch's ``loss_parallel``).
    """
    context = getattr(fn, "context", contextlib.nullcontext)

    def step():
        x.grad = w.grad = None
        with context():
            loss = fn(x, w, y)
            loss.backward()
        return loss
    return step


def _fwd_bwd_row(row: dict, method: Method, prob: Problem, ref: Reference, env: Env, settings: Settings,
                 floor_ms: float | None):
    """Fill ``row``; everything it allocated is released when it returns (the caller then frees the cache)."""
    try:
        fn = method.build(env)
        x = prob.x.detach().clone().requires_grad_()
        w = prob.w.detach().clone().requires_grad_()
        y = prob.y

        step = make_step(fn, x, w, y)
        loss = step()  # compiles / autotunes; its results are the ones checked
        synchronize(env.device)
        if method.plain:
            row["loss"], row["loss_err"] = _loss_err(loss, ref)
            row["dx_err"], row["dw_err"] = rel_err(x.grad, ref.dx), rel_err(w.grad, ref.dw)
        else:
            row["loss"] = float(loss)
        del loss
        x.grad = w.grad = None
        free_memory(env.device)
        _finish(row, measure(step, env.device, settings), floor_ms)
        x.grad = w.grad = None
        free_memory(env.device)
        row["extra_gib"] = peak_extra_bytes(step, env.device) / GiB
    except Unavailable as e:
        row["status"] = f"missing: {e}"
    except Exception as e:  # a peer's failure is a row, not the end of the run
        row["status"] = f"failed: {_reason(e)}"
        row["traceback"] = traceback.format_exc()


def _no_grad_row(row: dict, method: Method, prob: Problem, ref: Reference, env: Env, settings: Settings,
                 gemm_ms: float | None):
    """Fill ``row`` for a forward under ``torch.no_grad()``, timed against the logits GEMM alone."""
    try:
        fn = method.build(env)

        def forward():
            with torch.no_grad():
                return fn(prob.x, prob.w, prob.y)

        row["loss"], row["loss_err"] = _loss_err(forward(), ref)
        free_memory(env.device)
        _finish(row, measure(forward, env.device, settings), gemm_ms)
        free_memory(env.device)
        row["extra_gib"] = peak_extra_bytes(forward, env.device) / GiB
    except Unavailable as e:
        row["status"] = f"missing: {e}"
    except Exception as e:
        row["status"] = f"failed: {_reason(e)}"
        row["traceback"] = traceback.format_exc()


def run_shape(shape: Shape, env: Env, names: list[str], settings: Settings, progress: Progress,
              *, no_grad: bool = True) -> tuple[dict, list[dict]]:
    """Measure every selected row on fresh inputs of ``shape``; returns (shape record, rows)."""
    methods = [METHODS[n] for n in names if n != FLOOR]
    grad_rows = [(m, "fwd+bwd") for m in methods]
    nograd_rows = [(m, "no-grad") for m in methods if no_grad and m.no_grad]
    total = (FLOOR in names) + len(grad_rows) + len(nograd_rows)
    progress.shape(shape, env, total)

    t0 = time.perf_counter()
    prob = make_problem(shape, env, settings)
    ref = float64_reference(prob, settings.ref_chunk_gib)
    free_memory(env.device)
    elem = torch.finfo(env.dtype).bits // 8
    record = dict(name=shape.name, n=shape.n, d=shape.d, v=shape.v, sweeps=list(shape.sweeps),
                  flops_fwd_bwd=6 * shape.n * shape.d * shape.v,
                  grads_gib=(shape.n * shape.d + shape.v * shape.d) * elem / GiB,
                  inputs_gib=(shape.n * shape.d + shape.v * shape.d) * elem / GiB + shape.n * 8 / GiB,
                  ref_loss=ref.loss, ref_seconds=ref.seconds, floor=None)
    progress.note(f"inputs + float64 reference in {time.perf_counter() - t0:.1f} s (loss {ref.loss:.6f})")

    rows = []
    floor = {}
    if FLOOR in names:
        row = _row(shape, env, FLOOR, "floor: 3 GEMMs", "floor")
        progress.start(row)
        try:
            floor = measure_floor(shape, prob, env, settings)
            record["floor"] = floor
            row.update(ms=floor["total_ms"], floor_ms=floor["total_ms"], x_floor=1.0, reps=None)
        except Exception as e:
            row["status"] = f"failed: {_reason(e)}"
        free_memory(env.device)
        rows.append(row)
        progress.finish(row)

    for m, mode in grad_rows + nograd_rows:
        row = _row(shape, env, m.name, m.label + (" no-grad" if mode == "no-grad" else ""), mode)
        progress.start(row)
        if m.needs_cuda and not env.cuda:
            row["status"] = f"missing: needs a CUDA device (running on {env.device})"
        elif m.tp_only:
            row["status"] = "missing: a vocab-parallel row, measured only under --tp (torchrun)"
        elif mode == "fwd+bwd":
            _fwd_bwd_row(row, m, prob, ref, env, settings, floor.get("total_ms"))
        else:
            _no_grad_row(row, m, prob, ref, env, settings, floor.get("logits_ms"))
        free_memory(env.device)
        rows.append(row)
        progress.finish(row)

    del prob, ref
    free_memory(env.device)
    return record, rows

