"""``python -m vpce.bench --profile``: where one step's time goes, kernel by kernel and phase by phase.

For each shape and each row of ``--methods`` (default: vpce on the device's backend, ``vpce-triton`` on CUDA and
``vpce-torch`` on a CPU; with ``--distill`` ``vpce-fkl`` and ``vpce-jsd`` on the distillation's inputs), the row's
fwd+bwd step (``runner.make_step``; a frozen row's weight does not require grad) runs once (compile, autotune), is
timed as the benchmark times it (``harness.measure``: ``--warmup`` calls, then the median of the timed ones), and
then runs ``--profile-steps`` more times under ``torch.profiler``:

* on CUDA, with CPU and CUDA activities: every device event (kernels, memcpy, memset) and its GPU time;
* on a CPU, CPU activities only: every operator and its self time (the op minus the ops it calls), so that nested
  ops are not counted twice. These are CPU ops, not GPU kernels: they say where the torch backend spends its time.

The profiled steps are timed as a whole too (CUDA events around them on CUDA, ``time.perf_counter`` on a CPU); a
"step" below is that time over their number, and every percentage is of it.

* **Per kernel** (on a CPU, per op): name, phase, calls per step, ms per step, % of the step.
* **Per phase**: the kernels grouped by name with ``PHASES`` (the first pattern that matches names the phase;
  ``other`` when none does): vpce's fused logits kernel, the cuBLAS (or CUTLASS) GEMMs, vpce's two bandwidth
  passes over stored logits (and the fp32 target logits), the distillation's passes, reductions and the statistics
  combine, casts and copies, collectives, elementwise kernels and fills. A
  last line is the part of the step in no kernel: launch gaps, host work, synchronization (negative where
  kernels overlap, on two streams).

Output: progress lines on stderr, the tables on stdout, ``--out/profile.json`` (``schema: "vpce.bench.profile/1"``,
every kernel's full name). A profiler's timings of a CPU are as meaningless for the GPU as the benchmark's.
"""

from __future__ import annotations

import platform
import re
import time
from collections import defaultdict
from types import SimpleNamespace

import torch
from torch.autograd import DeviceType

from .harness import Env, Settings, Shape, free_memory, make_problem, measure, synchronize
from .meta import device_info, git_commit, now_utc, package_versions
from .methods import METHODS
from .report import Progress, format_number, markdown_table, write_json
from .runner import make_step, run_phases

__all__ = ["PHASES", "OTHER", "phase_of", "profile_method", "format_profile", "run_profile"]

#: (phase, regular expression searched in a kernel's or op's name, case-insensitive); the first match wins, so a
#: specific pattern goes above a general one. New kernels are added here.
PHASES = (
    ("logits tiles (fused GEMM + softmax stats)", r"_logits_tiles_kernel"),
    ("stored logits -> stats / grad", r"_stored_logits_kernel|_target_logits_kernel|_target_out_of_lse_kernel"),
    ("distillation passes", r"_distill_\w+_kernel"),
    ("speculative fallback (gated)", r"_gated_\w+_kernel"),
    ("casts / copies", r"_scale_cast_kernel|memcpy|^aten::(copy_|_to_copy)$"),
    ("collectives", r"nccl|c10d::|gloo"),
    ("GEMMs (cuBLAS / CUTLASS)", r"gemm|sm90|cutlass|nvjet|^aten::(mm|addmm_?|bmm|baddbmm)$"),
    ("reductions / combine", r"_reduce_tiles_kernel|_combine_\w+_kernel|_grad_metrics_kernel|reduce_kernel"
                             r"|softmax|nll_loss"
                             r"|triton_red_|triton_per_|^aten::(sum|amax|amin|max|min|logsumexp|mean)$"),
    ("elementwise / fills", r"elementwise|memset|fill|triton_poi_"
                            r"|^aten::(exp|sub|mul|add|div|neg|log|where|clamp|zero|fill)_?$"),
)
OTHER = "other"
_COMPILED = [(name, re.compile(pattern, re.IGNORECASE)) for name, pattern in PHASES]

#: Kernels listed per row in the table (the JSON has every one).
TOP = 30


def phase_of(name: str) -> str:
    """The phase of a kernel (or op) called ``name``: the first of ``PHASES`` whose pattern it contains."""
    for phase, pattern in _COMPILED:
        if pattern.search(name):
            return phase
    return OTHER


def _kernel_times(prof, cuda: bool) -> dict[str, list]:
    """``name: [calls, microseconds]`` of every device event (CUDA) or every CPU op's self time (CPU)."""
    kind = DeviceType.CUDA if cuda else DeviceType.CPU
    out = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type != kind:
            continue
        acc = out[e.name]
        acc[0] += 1
        acc[1] += e.time_range.elapsed_us() if cuda else e.self_cpu_time_total
    return out


def _timed_profile(step, env: Env, steps: int):
    """``steps`` calls of ``step`` under ``torch.profiler``; returns (profiler, wall ms of all of them)."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if env.cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        if env.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        if env.cuda:
            end.record()
        synchronize(env.device)
        wall_ms = start.elapsed_time(end) if env.cuda else (time.perf_counter() - t0) * 1e3
    return prof, wall_ms


def _summarize(times: dict[str, list], steps: int, step_ms: float) -> tuple[list[dict], list[dict]]:
    """Per kernel and per phase: calls and ms per step, % of ``step_ms``; heaviest first."""
    kernels = [dict(name=name, phase=phase_of(name), calls=calls / steps, ms=us / 1e3 / steps)
               for name, (calls, us) in times.items()]
    kernels.sort(key=lambda k: -k["ms"])
    phases = {}
    for k in kernels:
        k["pct"] = 100 * k["ms"] / step_ms
        p = phases.setdefault(k["phase"], dict(phase=k["phase"], kernels=0, calls=0.0, ms=0.0))
        p["kernels"] += 1
        p["calls"] += k["calls"]
        p["ms"] += k["ms"]
    order = [name for name, _ in PHASES] + [OTHER]
    phases = sorted(phases.values(), key=lambda p: order.index(p["phase"]))
    for p in phases:
        p["pct"] = 100 * p["ms"] / step_ms
    return kernels, phases


def profile_method(shape: Shape, env: Env, name: str, settings: Settings, steps: int, prob=None) -> dict:
    """One row's profile on ``shape`` (inputs ``prob``, drawn if None): a dict for the JSON and ``format_profile``,
    with ``status`` ``ok``, ``missing: ...`` or ``failed: ...`` as the benchmark's rows."""
    method = METHODS[name]
    prob = make_problem(shape, env, settings) if prob is None else prob
    row = dict(shape=shape.name, n=shape.n, d=shape.d, v=shape.v, method=name, label=method.row_label(env),
               mode="frozen" if method.frozen else "fwd+bwd", status="ok", step_ms=None, steps=steps,
               profiled_step_ms=None, kernels_ms=None, outside_ms=None,
               measured="cuda kernels" if env.cuda else "cpu ops (self time)", phases=[], kernels=[])
    if shape.distill:
        row["d_teacher"] = shape.d_teacher
    live = SimpleNamespace(step=None)

    def can_run():
        method.require(env)

    def first_step():
        fn = method.build(env)
        x = prob.x.detach().clone().requires_grad_()
        w = prob.w.detach().clone().requires_grad_(not method.frozen)
        live.step = make_step(fn, x, w, prob.y, *prob.extra)
        live.step()
        synchronize(env.device)

    def timed():
        row["step_ms"] = measure(live.step, env.device, settings).median

    def profiled():
        prof, wall_ms = _timed_profile(live.step, env, steps)
        row["profiled_step_ms"] = step_ms = wall_ms / steps
        row["kernels"], row["phases"] = _summarize(_kernel_times(prof, env.cuda), steps, step_ms)
        row["kernels_ms"] = sum(k["ms"] for k in row["kernels"])
        row["outside_ms"] = step_ms - row["kernels_ms"]

    run_phases(row, [can_run, first_step, timed, profiled])
    live.step = None
    free_memory(env.device)
    return row


_PHASE_COLUMNS = (("phase", "phase", None), ("kernels", "kernels", "d"), ("calls/step", "calls", ".3g"),
                  ("ms/step", "ms", "ms"), ("% of step", "pct", ".1f"))
_KERNEL_COLUMNS = (("kernel", "short", None), ("phase", "phase", None), ("calls/step", "calls", ".3g"),
                   ("ms/step", "ms", "ms"), ("% of step", "pct", ".1f"))


def _columns(columns, kind: str):
    """``columns`` with "kernel" in the headers replaced by ``kind`` (on a CPU: "op")."""
    return [(header.replace("kernel", kind), key, fmt) for header, key, fmt in columns]


def format_profile(row: dict, dtype: str, device: str) -> str:
    """A row's profile as text: the header, the per-phase table and the heaviest ``TOP`` kernels."""
    what = "CUDA kernels" if row["measured"] == "cuda kernels" else "CPU ops (self time)"
    teacher = f" D_T={row['d_teacher']}" if row.get("d_teacher") else ""
    lines = [f"## profile: {row['label']}, {row['shape']} (N={row['n']} D={row['d']}{teacher} V={row['v']}), "
             f"{dtype}, {device}"]
    if row["status"] != "ok":
        return "\n".join(lines + [row["status"]]) + "\n"
    step = row["profiled_step_ms"]
    lines.append(f"step {format_number(row['step_ms'], 'ms')} ms (median, not profiled); {row['steps']} profiled "
                 f"steps of {format_number(step, 'ms')} ms, {format_number(row['kernels_ms'], 'ms')} ms of each in "
                 f"{len(row['kernels'])} {what} ({100 * row['kernels_ms'] / step:.1f}%)")
    kind = "kernel" if row["measured"] == "cuda kernels" else "op"
    outside = dict(phase=f"(in no {kind}: launch gaps, host, sync)", kernels=None, calls=None, ms=row["outside_ms"],
                   pct=100 * row["outside_ms"] / step)
    lines += [""] + markdown_table(row["phases"] + [outside], _columns(_PHASE_COLUMNS, kind))
    shown = [dict(k, short=k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "...")
             for k in row["kernels"][:TOP]]
    rest = row["kernels"][TOP:]
    if rest:
        ms = sum(k["ms"] for k in rest)
        shown.append(dict(short=f"({len(rest)} more)", phase="", calls=sum(k["calls"] for k in rest), ms=ms,
                          pct=100 * ms / step))
    lines += [""] + markdown_table(shown, _columns(_KERNEL_COLUMNS, kind))
    return "\n".join(lines) + "\n"


def run_profile(args, shapes: list[Shape], env: Env, settings: Settings, names: list[str], command: str,
                progress: Progress) -> int:
    """``--profile``: every row of ``names`` on every shape; tables on stdout, ``--out/profile.json``."""
    doc = dict(schema="vpce.bench.profile/1", date=now_utc(), command=command, commit=git_commit(),
               device=device_info(env.device), versions=package_versions(), python=platform.python_version(),
               dtype=args.dtype, steps=args.profile_steps, phases=[list(p) for p in PHASES], methods=names,
               profiles=[])
    out_json = args.out / "profile.json"
    for shape in shapes:
        progress.shape(shape, env, len(names))
        prob = make_problem(shape, env, settings)
        for name in names:
            progress.note(f"profiling {METHODS[name].row_label(env)} ...")
            row = profile_method(shape, env, name, settings, args.profile_steps, prob)
            doc["profiles"].append(row)
            print(format_profile(row, args.dtype, doc["device"]["name"]), flush=True)
            write_json(out_json, doc)
        del prob
        free_memory(env.device)
    progress.note(f"wrote {out_json}")
    return 0
