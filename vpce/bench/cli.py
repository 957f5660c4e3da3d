"""Command line of ``python -m vpce.bench``: shapes, sweeps, method selection, and the run itself (one device
here; ``--tp`` hands the run to ``vpce.bench.tp``, ``--profile`` to ``vpce.bench.profile``). ``--distill`` makes
every shape a distillation problem (a teacher head of ``--teacher-dim``) and measures the distillation rows."""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import shlex
import sys
import textwrap
from pathlib import Path

import torch

from .harness import Env, Settings, Shape, ready_extra
from .first_step import DEFAULT_METHODS as FIRST_STEP_METHODS, format_first_step, run_first_step
from .meta import DTYPES, INPUTS, device_info, distill_settings, git_commit, now_utc, package_versions, timings_caveat
from .methods import FLOOR, METHODS, default_methods, device_backend, method_names, quick_methods
from .peers import shutdown_megatron
from .plots import plot_shapes, plot_sweeps
from .profile import run_profile
from .report import Progress, format_shape, write_json
from .runner import run_shape
from .tp import main_tp

#: Named problem sizes (N tokens, D hidden, V vocab): the lm_heads of known models at 16k tokens.
SHAPES = {
    "llama3-8b": (16384, 4096, 128256),
    "gemma2-2b": (8192, 2304, 256000),
    "llama3-70b": (16384, 8192, 128256),
    "qwen2.5-7b": (16384, 3584, 152064),
    # long context on the Llama-3-8B head (the lean route and "auto"; peers that run out of memory say so)
    "llama3-8b-64k": (65536, 4096, 128256),
    "llama3-8b-128k": (131072, 4096, 128256),
    "llama3-8b-256k": (262144, 4096, 128256),
    # --quick: seconds on a CPU
    "tiny": (256, 64, 1024),
    "tiny-odd": (200, 72, 2003),
}
DEFAULT_SHAPES = "llama3-8b,gemma2-2b"
TP_DEFAULT_SHAPES = "llama3-8b"  # --tp: the head of the multi-GPU bars (llama3-70b: the anchors' D=8192 class)
QUICK_SHAPES = "tiny,tiny-odd"
#: --distill (with --tp too): the Llama-3-8B student head against a teacher of --teacher-dim (default 8192, a
#: Llama-3-70B-sized head): N=16384, D=4096, D_T=8192, V=128256, the distillation's target case.
DISTILL_DEFAULT_SHAPES = "llama3-8b"
DISTILL_TEACHER_DIM = 8192
QUICK_TEACHER_DIM = 96  # --distill --quick: the tiny shapes' teacher

#: Sweeps: the axis varies over these values, the other two stay at the centre shape's.
SWEEPS = {"N": (2048, 4096, 8192, 16384, 32768, 65536, 131072, 262144), "D": (1024, 2048, 4096, 8192), "V": (32000, 64000, 128256, 256000)}
SWEEP_CENTRE = "llama3-8b"
QUICK_SWEEPS = {"N": (64, 128, 256, 512), "D": (32, 64, 128), "V": (256, 1024, 4096)}
QUICK_SWEEP_CENTRE = "tiny"

#: One GEMM of a shape above this many FLOP (2 N D V) is GPU-sized: minutes or hours per row on a CPU.
GPU_SIZED_FLOP = 1e11


def _parse_shape(token: str) -> Shape:
    if token in SHAPES:
        n, d, v = SHAPES[token]
        return Shape(name=token, n=n, d=d, v=v)
    parts = token.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"shape: expected one of {sorted(SHAPES)} or NxDxV with positive ints, "
                                         f"got {token!r}")
    n, d, v = map(int, parts)
    return Shape(name=token, n=n, d=d, v=v)


def _sweep_shapes(axes: list[str], quick: bool) -> list[Shape]:
    centre_name = QUICK_SWEEP_CENTRE if quick else SWEEP_CENTRE
    grids = QUICK_SWEEPS if quick else SWEEPS
    centre = dict(zip("NDV", SHAPES[centre_name]))
    points: dict[tuple[int, int, int], list[str]] = {}
    for axis in axes:
        for value in grids[axis]:
            key = tuple(value if a == axis else centre[a] for a in "NDV")
            points.setdefault(key, []).append(axis)
    return [Shape(name=centre_name if key == SHAPES[centre_name] else "x".join(map(str, key)),
                  n=key[0], d=key[1], v=key[2], sweeps=tuple(ax)) for key, ax in sorted(points.items())]


def _csv(choices: list[str], what: str, expand_all: bool = True):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if items == ["all"]:
            return list(choices) if expand_all else ["all"]
        bad = [t for t in items if t not in choices]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{what}: expected a comma-separated list of {choices} (or 'all'), "
                                             f"got {text!r}")
        return [c for c in choices if c in items]  # table order
    return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults in ``--help``, except a ``None`` default: its help text says what None stands for."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m vpce.bench",
        description="Side-by-side fwd+bwd time, peak extra memory and float64 error of fused linear + "
                    "cross-entropy implementations against the three-GEMM floor.",
        formatter_class=_HelpFormatter)
    p.add_argument("--shapes", default=None,
                   help=f"comma-separated names ({', '.join(SHAPES)}) or NxDxV; default {DEFAULT_SHAPES} "
                        f"({TP_DEFAULT_SHAPES} with --tp, {QUICK_SHAPES} with --quick)")
    p.add_argument("--sweep", type=_csv(list("NDV"), "sweep"), default=None,
                   help=f"sweep one or more of N,D,V around {SWEEP_CENTRE}: " +
                        "; ".join(f"{k} in {v}" for k, v in SWEEPS.items()) + " (replaces the default shapes)")
    ce_names = [n for n in method_names() if n == FLOOR or METHODS[n].distill is None]
    p.add_argument("--methods", type=_csv(method_names(), "methods", expand_all=False), default=None,
                   help=f"rows to measure: {','.join(ce_names)}; with --quick the default is the rows of "
                        f"vpce.bench.methods.QUICK that run here; 'all' (the default otherwise): "
                        f"{','.join(default_methods(False))} (with --tp: {','.join(default_methods(True))}; with "
                        f"--profile the default is vpce-triton on CUDA, vpce-torch on a CPU); with --distill the "
                        f"distillation rows instead: {','.join(default_methods(False, True))} (the default; with "
                        f"--tp: {','.join(default_methods(True, True))}; with --profile: vpce-fkl,vpce-jsd)")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny shapes and few repetitions (a smoke run; works on CPU)")
    p.add_argument("--out", type=Path, default=Path("bench-out"), help="folder for bench.json and the plots")
    p.add_argument("--skip-no-grad", action="store_true", help="leave out the no-grad forward rows")
    p.add_argument("--logit-scale", type=float, default=1.0,
                   help="standard deviation of the logits (x ~ N(0,1), w ~ N(0, scale^2/D))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=None, help="calls before timing (default 3, 1 with --quick)")
    p.add_argument("--reps", type=int, default=None, help="fewest timed calls per row (default 10, 3 with --quick)")
    p.add_argument("--rep-time", type=float, default=None,
                   help="seconds of timed calls per row, within --reps..200 calls (default 1.5, 0.05 with --quick)")
    p.add_argument("--settle", type=float, default=0.0, metavar="SECONDS",
                   help="untimed calls, back to back, for about this long before each row's timed calls, so that "
                        "a GPU at its power limit is timed at its settled clock, the floor's GEMMs too (default 0: "
                        "none; about 1 settles an H100 under these GEMMs)")
    p.add_argument("--row-timeout", type=float, default=300.0, metavar="SECONDS",
                   help="a row still running after this long is abandoned and reported 'failed: timeout', and the "
                        "run goes on (a device left stalled by it ends the run, with the tables written); 0: no "
                        "limit")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.add_argument("--first-step", action="store_true",
                   help="time a fresh process's first fwd+bwd per row, with empty kernel caches and then with the "
                        f"first process's caches (vpce.bench.first_step; default rows {','.join(FIRST_STEP_METHODS)}, "
                        "default shape llama3-8b)")
    p.add_argument("--profile", action="store_true",
                   help="instead of the tables: where a step's time goes, per kernel and per phase (torch.profiler; "
                        "CUDA kernels, or CPU ops on a CPU), for the --methods rows; writes --out/profile.json")
    p.add_argument("--profile-steps", type=int, default=3, help="with --profile: steps run under the profiler")
    kd = p.add_argument_group("distillation (see vpce.bench)")
    kd.add_argument("--distill", action="store_true",
                    help="measure vpce.linear_distillation_loss (forward KL, JSD beta=0.5, reverse KL; and lean) "
                         "against plain torch (both heads' logits materialized) and liger-kernel's "
                         "LigerFusedLinearJSD, each against the float64 reference of its divergence, timed against "
                         "the floor teacher logits GEMM + the student's 3 GEMMs; every shape gets a teacher head "
                         f"[V, --teacher-dim]; default shape {DISTILL_DEFAULT_SHAPES} (with the default teacher dim: "
                         "the issue's case); writes --out/bench-distill.json")
    kd.add_argument("--teacher-dim", type=int, default=None, metavar="D_T",
                    help=f"with --distill: the teacher's hidden size (default {DISTILL_TEACHER_DIM}; "
                         f"{QUICK_TEACHER_DIM} with --quick)")
    tp = p.add_argument_group("tensor parallel (under torchrun; see vpce.bench.tp)")
    tp.add_argument("--tp", action="store_true",
                    help="vocab-parallel rows, per rank, the vocab sharded over every process of the launch "
                         "(NCCL on cuda:LOCAL_RANK, gloo on CPU); writes --out/bench-tp<K>[-sp].json")
    tp.add_argument("--sp", action="store_true",
                    help="with --tp: sequence parallel layout (each rank's hidden input is its N/tp slice of the "
                         "tokens; targets full) instead of hidden replicated")
    tp.add_argument("--timeout", type=float, default=600.0,
                    help="with --tp: process-group timeout in seconds (a hung collective ends the run)")
    tp.add_argument("--inject-failure", metavar="METHOD@RANK", default=None,
                    help="with --tp, for testing: METHOD's row raises on RANK when it is built (the row must be "
                         "reported failed by every rank, and the run go on)")
    return p


def _gpu_sized(shapes: list[Shape]) -> list[str]:
    return [s.name for s in shapes if 2 * s.n * max(s.d, s.d_teacher or 0) * s.v > GPU_SIZED_FLOP]


def _check_methods(args, parser):
    """``--methods`` of the run's kind: distillation rows with ``--distill``, cross-entropy rows without."""
    wrong = [n for n in args.methods if n != FLOOR and (METHODS[n].distill is not None) != args.distill]
    if wrong and args.distill:
        parser.error(f"--methods: with --distill expected distillation rows ({','.join(default_methods(False, True))}"
                     f"), got {','.join(wrong)}")
    if wrong:
        parser.error(f"--methods: {','.join(wrong)}: distillation rows, expected with --distill")


def _first_step(args, shapes, device, command, progress) -> int:
    """``--first-step``: every row in fresh processes (``vpce.bench.first_step``); a table and first-step.json."""
    names = [n for n in args.methods if n != FLOOR]
    rows = run_first_step(names, shapes, args.dtype, str(device), args.seed, progress)
    name = device_info(device)["name"]
    print(format_first_step(rows, name), flush=True)
    doc = dict(schema="vpce.bench.first_step/1", date=now_utc(), command=command, commit=git_commit(),
               device=device_info(device), versions=package_versions(), python=platform.python_version(),
               dtype=args.dtype, rows=rows)
    out_json = args.out / "first-step.json"
    write_json(out_json, doc)
    progress.note(f"wrote {out_json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device: expected an available device, got {args.device!r} (no CUDA here)")
    left_out = []  # --quick's rows that do not run here
    if args.first_step and (args.tp or args.profile or args.distill or args.sweep):
        parser.error("--first-step: expected without --tp, --profile, --distill and --sweep, got it with them")
    if args.first_step and args.methods is None:
        args.methods = [m for m in FIRST_STEP_METHODS if m in method_names()]
    if args.profile and args.methods is None:
        args.methods = ["vpce-fkl", "vpce-jsd"] if args.distill else \
            [f"vpce-{device_backend(Env(device=device, dtype=DTYPES[args.dtype]))}"]
    elif args.methods is None and args.quick and not (args.tp or args.distill):
        args.methods, left_out = quick_methods(Env(device=device, dtype=DTYPES[args.dtype]))
    elif args.methods in (None, ["all"]):
        args.methods = default_methods(args.tp, args.distill)
    _check_methods(args, parser)
    if args.teacher_dim is not None and not args.distill:
        parser.error(f"--teacher-dim: expected together with --distill, got --teacher-dim {args.teacher_dim} "
                     f"without it")
    if args.distill:
        if args.teacher_dim is None:
            args.teacher_dim = QUICK_TEACHER_DIM if args.quick else DISTILL_TEACHER_DIM
        if args.teacher_dim < 1:
            parser.error(f"--teacher-dim: expected a positive number, got {args.teacher_dim}")
        if args.sweep:
            parser.error("--sweep: expected without --distill (name the distillation shapes with --shapes)")
    if not args.tp and (args.sp or args.inject_failure):
        parser.error("--sp and --inject-failure: expected together with --tp, got them without it")
    if args.profile and args.tp:
        parser.error("--profile: expected without --tp, got both (launch/profile_tp.py profiles a vocab-parallel "
                     "step)")
    if args.profile and args.profile_steps < 1:
        parser.error(f"--profile-steps: expected a positive number, got {args.profile_steps}")
    if args.row_timeout < 0:
        parser.error(f"--row-timeout: expected seconds >= 0 (0: no limit), got {args.row_timeout}")
    if not 0 <= args.settle < float("inf"):
        parser.error(f"--settle: expected seconds >= 0 (0: none), got {args.settle}")
    if args.profile and args.methods == [FLOOR]:
        parser.error("--methods: expected rows with a loss to profile, got only the floor")

    shapes = [] if args.sweep else None
    if args.sweep:
        shapes = _sweep_shapes(args.sweep, args.quick)
    if args.shapes is not None or shapes is None:
        try:
            default = QUICK_SHAPES.split(",")[0] if args.quick and args.first_step else \
                SWEEP_CENTRE if args.first_step else QUICK_SHAPES if args.quick else DISTILL_DEFAULT_SHAPES if args.distill else \
                TP_DEFAULT_SHAPES if args.tp else DEFAULT_SHAPES
            named = [_parse_shape(t) for t in (args.shapes or default).split(",") if t]
        except argparse.ArgumentTypeError as e:
            parser.error(str(e))
        shapes = (shapes or []) + named
    if args.distill:
        shapes = [dataclasses.replace(s, d_teacher=args.teacher_dim) for s in shapes]

    warnings = []  # printed on stderr even with --quiet
    if left_out:
        warnings.append(f"note: --quick leaves out rows not installed or not for {device.type}: "
                        f"{', '.join(left_out)}")
    big = _gpu_sized(shapes) if device.type != "cuda" else []
    if big and args.shapes is None and not args.quick:  # the defaults, or a full-size sweep: never on a CPU
        what = f"the sweep over {','.join(args.sweep)}" if args.sweep else f"the default shapes ({', '.join(big)})"
        print(f"python -m vpce.bench: on {device.type} {what} would run for hours (GPU-sized); add --quick for tiny "
              f"shapes, or name small ones with --shapes NxDxV", file=sys.stderr)
        return 2
    if big:
        warnings.append(f"note: {', '.join(big)}: GPU-sized, on {device.type} this may run for hours")
    caveat = timings_caveat(device)
    if caveat and args.dtype != "fp32":
        caveat += ";\n" + textwrap.fill(
            f"{args.dtype} matmuls on a CPU take CPU-specific paths whose speed differs many-fold with the output "
            f"dtype (the floor's GEMMs write {args.dtype}, vpce's torch backend writes fp32 logits), so the "
            f"'x floor' ratios compare CPU arithmetic paths, not methods; --dtype fp32 compares like with like",
            width=110)
    if caveat:
        warnings.append(caveat)
    settings = Settings(
        warmup=args.warmup if args.warmup is not None else (1 if args.quick else 3),
        min_reps=args.reps if args.reps is not None else (3 if args.quick else 10),
        max_reps=20 if args.quick else 200,
        rep_time_s=args.rep_time if args.rep_time is not None else (0.05 if args.quick else 1.5),
        settle_s=args.settle, logit_scale=args.logit_scale, seed=args.seed, row_timeout_s=args.row_timeout or None)
    command = shlex.join(["python", "-m", "vpce.bench", *(sys.argv[1:] if argv is None else argv)])
    if args.tp:
        return main_tp(args, parser, shapes, settings, command, warnings)

    progress = Progress(enabled=not args.quiet)
    for line in warnings:
        progress.warn(line)
    if args.first_step:
        return _first_step(args, shapes, device, command, progress)

    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    env = Env(device=device, dtype=DTYPES[args.dtype])
    ready_extra(env)
    if args.profile:
        if caveat:
            print(caveat + "\n", flush=True)
        names = [n for n in args.methods if n != FLOOR]
        status = run_profile(args, shapes, env, settings, names, command, progress)
        shutdown_megatron()
        return status
    doc = dict(
        schema="vpce.bench.distill/1" if args.distill else "vpce.bench/1",
        date=now_utc(),
        command=command,
        commit=git_commit(),
        device=device_info(device),
        versions=package_versions(),
        python=platform.python_version(),
        dtype=args.dtype,
        tp=env.tp,
        settings=dict(dataclasses.asdict(settings), tf32=torch.backends.cuda.matmul.allow_tf32, inputs=INPUTS),
        **distill_settings(args),
        methods=args.methods,
        shapes=[],
        rows=[],
    )
    stem = "bench-distill" if args.distill else "bench"
    out_json = args.out / f"{stem}.json"
    if caveat:
        print(caveat + "\n", flush=True)  # with the tables too, so that a copied table keeps it
    for shape in shapes:
        record, rows = run_shape(shape, env, args.methods, settings, progress, no_grad=not args.skip_no_grad)
        doc["shapes"].append(record)
        doc["rows"].extend(rows)
        print(format_shape(record, rows, args.dtype, doc["device"]["name"]), flush=True)
        write_json(out_json, doc)  # after every shape: a crash later keeps what was measured
        if record.get("stalled"):
            # a thread stuck in a device call can block a normal exit (runner's docstring): leave at once
            progress.warn(f"error: {record['stalled']}; the remaining rows and shapes were not run; wrote {out_json}")
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(3)
    shutdown_megatron()

    notes = set()
    for files, note in (plot_shapes(doc, args.out, stem), plot_sweeps(doc, args.out)):
        for f in files:
            progress.note(f"wrote {f}")
        if note and note not in notes:
            progress.note(note)
            notes.add(note)
    progress.note(f"wrote {out_json}")
    return 0
