"""``python -m vpce.bench --first-step``: how long a fresh process waits for its first fwd+bwd.

A training job's first step pays for every kernel it compiles: Triton's JIT, quack's CuTe DSL kernels (the
``hopper`` extra), TorchInductor's code generation. This mode measures that wait, row by row, in processes of
their own:

1. **cold**: a new process whose kernel caches are empty: ``TRITON_CACHE_DIR``, ``QUACK_CACHE_DIR`` (quack's
   compiled GEMMs), ``CUTE_DSL_CACHE_DIR`` (the CuTe DSL's own file cache of compiled modules) and
   ``TORCHINDUCTOR_CACHE_DIR`` point into a fresh temporary folder;
2. **warm cache**: a second new process with the same folders, so that it reuses what the first one compiled
   (a job restarted on the same machine, or a second job).

Python's own bytecode is not a kernel cache: pip compiles it when it installs a package, so no user's first step
compiles Python sources. Some images cannot keep it (a read-only ``site-packages``, ``PYTHONDONTWRITEBYTECODE``),
and a row would then count seconds of compiling ``sympy`` or ``torch._dynamo`` sources as its first step. So every
process of the mode writes and reads bytecode under one ``PYTHONPYCACHEPREFIX`` folder, and before each row's cold
process a **priming** process runs the row once with kernel caches of its own, thrown away: the row's modules are
then compiled to bytecode as an installed environment has them, and its kernel caches stay empty.

Each process builds the row's loss as the main bench does (``vpce.bench.methods``), draws the shape's inputs
(``x ~ N(0, 1)``, ``w ~ N(0, 1/D)``, uniform targets), and times, with the device synchronized:

- ``startup_s``: from the process's launch to the start of its first step: Python, importing torch, vpce and
  the row's libraries, the CUDA context, building the loss function and drawing the inputs;
- ``first_s``: the first fwd+bwd (the number this mode is for);
- ``step_ms``: a later fwd+bwd, the median of three, for scale.
- for vpce's rows with the ``hopper`` extra on an sm_90 GPU, whose first steps run without the extra's kernels
  while they build (``vpce.backends.hopper``): ``extra_ready_s``, from the process's launch to when they are
  ready (``vpce.build_hopper_kernels`` waits for them after the steps above), and ``extra_first_s``, the first
  fwd+bwd that runs them.

The parent prints one table per shape and writes ``first-step.json`` under ``--out``. Rows that cannot run here
are ``missing: ...``, rows that raise are ``failed: ...``, as in the main bench.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["CACHE_VARIABLES", "DEFAULT_METHODS", "run_first_step", "format_first_step"]

#: The environment variables that place each compiler's persistent cache (all pointed into one fresh folder).
CACHE_VARIABLES = ("TRITON_CACHE_DIR", "QUACK_CACHE_DIR", "CUTE_DSL_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")

#: The rows measured when ``--methods`` is not given: vpce on the device's backend, and the peers a user weighs it
#: against for start-up time.
DEFAULT_METHODS = ("vpce-triton", "liger", "compile", "torch")

#: Longest one process may take before it is stopped and its row marked failed.
PROCESS_TIMEOUT_S = 900.0


def _child(argv: list[str]) -> int:
    """One process: build the row, time its first fwd+bwd, print one JSON line."""
    p = argparse.ArgumentParser(prog="python -m vpce.bench.first_step")
    p.add_argument("method")
    p.add_argument("shape", help="NxDxV")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    n, d, v = (int(t) for t in args.shape.split("x"))
    import torch

    from .harness import Env, synchronize
    from .meta import DTYPES
    from .methods import METHODS
    from .peers import Unavailable

    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device.index or 0)
        torch.zeros(1, device=device)  # the CUDA context is the process's, not the row's
    env = Env(device=device, dtype=DTYPES[args.dtype])
    method = METHODS[args.method]
    out = dict(method=args.method, label=method.row_label(env), caches={v: os.environ.get(v) for v in CACHE_VARIABLES},
               pycache=os.environ.get("PYTHONPYCACHEPREFIX"))
    try:
        method.require(env)
        if method.main_grad or method.distill or method.tp_only:
            raise Unavailable("not a plain cross-entropy row")
        fn = method.build(env)
        gen = torch.Generator(device="cpu").manual_seed(args.seed)
        x = torch.randn(n, d, generator=gen).to(device, env.dtype).requires_grad_()
        w = (torch.randn(v, d, generator=gen) * d**-0.5).to(device, env.dtype).requires_grad_()
        y = torch.randint(0, v, (n,), generator=gen).to(device)
        synchronize(device)

        def step():
            x.grad = w.grad = None
            fn(x, w, y).backward()
            synchronize(device)

        out["first_started"] = time.time()
        t0 = time.perf_counter()
        step()
        out["first_s"] = time.perf_counter() - t0
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
        out["step_ms"] = statistics.median(times) * 1e3
        if args.method.startswith("vpce") and device.type == "cuda":
            # the hopper extra's kernels build while the first steps run without them (vpce.backends.hopper): when
            # they are ready, and the first step that runs them
            import vpce

            if vpce.build_hopper_kernels(device, env.dtype):
                out["extra_ready_at"] = time.time()
                t0 = time.perf_counter()
                step()
                out["extra_first_s"] = time.perf_counter() - t0
        out["status"] = "ok"
    except Unavailable as e:
        out["status"] = f"missing: {e}"
    except Exception as e:  # noqa: BLE001 - the row's own failure is what the table reports
        out["status"] = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    print("FIRST-STEP " + json.dumps(out), flush=True)
    return 0


def _run_process(method: str, shape, dtype: str, device: str, seed: int, cache: Path, pycache: Path) -> dict:
    """Run one child process with its kernel caches in ``cache`` and Python's bytecode under ``pycache``; returns its
    JSON line plus the process's wall time."""
    env = dict(os.environ, PYTHONPYCACHEPREFIX=str(pycache))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    for var in CACHE_VARIABLES:
        env[var] = str(cache / var.lower())
    cmd = [sys.executable, "-m", "vpce.bench.first_step", method, f"{shape.n}x{shape.d}x{shape.v}",
           "--dtype", dtype, "--device", device, "--seed", str(seed)]
    launched, t0 = time.time(), time.perf_counter()
    try:
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=PROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return dict(method=method, status=f"failed: timeout after {PROCESS_TIMEOUT_S:.0f} s")
    wall = time.perf_counter() - t0
    for line in done.stdout.splitlines():
        if line.startswith("FIRST-STEP "):
            row = json.loads(line[len("FIRST-STEP "):])
            row["process_s"] = wall
            if "first_started" in row:
                row["startup_s"] = row.pop("first_started") - launched
            if "extra_ready_at" in row:
                row["extra_ready_s"] = row.pop("extra_ready_at") - launched
            return row
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return dict(method=method, status=f"failed: exit {done.returncode}: {tail[0][:200]}")


def run_first_step(methods: list[str], shapes, dtype: str, device: str, seed: int, progress) -> list[dict]:
    """Each row of ``methods`` on each shape: a priming process (its kernel caches thrown away), then a cold
    process, then a warm-cache one, with kernel caches of the row's own and one bytecode folder for all."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="vpce-first-step-pyc-") as pycache:
        for shape in shapes:
            for method in methods:
                with tempfile.TemporaryDirectory(prefix="vpce-first-step-prime-") as prime:
                    progress.note(f"{shape.name} {method} (priming Python's bytecode) ...")
                    _run_process(method, shape, dtype, device, seed, Path(prime), Path(pycache))
                rows += _cold_then_warm(method, shape, dtype, device, seed, Path(pycache), progress)
    return rows


def _cold_then_warm(method: str, shape, dtype: str, device: str, seed: int, pycache: Path, progress) -> list[dict]:
    """The row's cold process, then its warm-cache one, sharing one fresh folder of kernel caches."""
    rows = []
    with tempfile.TemporaryDirectory(prefix="vpce-first-step-") as tmp:
        for phase in ("cold", "warm cache"):
            progress.note(f"{shape.name} {method} ({phase}) ...")
            row = _run_process(method, shape, dtype, device, seed, Path(tmp), pycache)
            row.update(shape=shape.name, n=shape.n, d=shape.d, v=shape.v, phase=phase)
            rows.append(row)
            progress.note(f"{shape.name} {method} ({phase}): " + (
                f"first step {row['first_s']:.2f} s" if row.get("status") == "ok" else row["status"]))
    return rows


def format_first_step(rows: list[dict], device_name: str) -> str:
    """Markdown table: one line per row and phase."""
    lines = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape]
        r0 = mine[0]
        lines += [f"## first step: {shape} (N={r0['n']} D={r0['d']} V={r0['v']}), {device_name}", "",
                  "| method | phase | first fwd+bwd s | startup s | process s | later step ms | extra ready s | "
                  "its first step s | status |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in mine:
            ok = r.get("status") == "ok"
            cell = (lambda k, f: f.format(r[k]) if ok and k in r else "")
            lines.append(f"| {r.get('label', r['method'])} | {r['phase']} | {cell('first_s', '{:.2f}')} | "
                         f"{cell('startup_s', '{:.2f}')} | {cell('process_s', '{:.1f}')} | "
                         f"{cell('step_ms', '{:.1f}')} | {cell('extra_ready_s', '{:.1f}')} | "
                         f"{cell('extra_first_s', '{:.2f}')} | {r.get('status', '')} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
