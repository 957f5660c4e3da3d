"""What a benchmark run records about itself: dtypes by name, the device, the commit and package versions.

Both entry points (``vpce.bench.cli`` for one device, ``vpce.bench.tp`` under ``--tp``) import this module; it
imports neither.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import subprocess
from pathlib import Path

import torch

__all__ = ["DTYPES", "INPUTS", "TEACHER_INPUTS", "distill_settings", "device_info", "git_commit", "package_version",
           "package_versions", "now_utc", "timings_caveat"]

#: ``--dtype`` names.
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

#: How the inputs are drawn (``harness.make_problem``), as the JSON's ``settings.inputs`` says it.
INPUTS = "x ~ N(0,1), w ~ N(0, logit_scale^2/D), targets uniform over the vocab, none ignored"

#: How a distillation shape's teacher is drawn (``harness.make_problem``), as the JSON's ``distill`` says it.
TEACHER_INPUTS = ("xt ~ N(0,1) [N, D_T], wt ~ N(0, logit_scale^2/D_T) [V, D_T], from their own seed, independent of "
                  "the student's x, w (those of the cross-entropy problem of N, D, V)")


def distill_settings(args) -> dict:
    """The JSON's ``task`` and ``distill`` fields of a ``--distill`` run (nothing otherwise): the teacher, and what
    every distillation row computes."""
    if not getattr(args, "distill", False):
        return {}
    return dict(task="distillation", distill=dict(
        teacher_dim=args.teacher_dim, temperature=1.0, teacher_inputs=TEACHER_INPUTS,
        loss="mean over the tokens (none ignored) of a divergence between the teacher's softmax q and the "
             "student's p; the teacher detached, gradients into the student's x and w",
        divergences={"forward KL": "KL(q || p)", "reverse KL": "KL(p || q)",
                     "JSD beta=0.5": "beta KL(q || m) + (1 - beta) KL(p || m), m = beta q + (1 - beta) p"},
        floor="teacher logits GEMM [N, D_T] @ [D_T, V] + the student's logits, dX and dW GEMMs (cuBLAS, run's dtype)"))


#: Distributions whose versions the JSON records (None: not installed).
PACKAGES = ("torch", "triton", "liger-kernel", "cut-cross-entropy", "megatron-core", "quack-kernels",
            "nvidia-cutlass-dsl", "fla-core", "trl", "verl", "numpy", "matplotlib")


def device_info(device: torch.device) -> dict:
    """Type, name and size of ``device`` (a CUDA GPU's capability and memory; a CPU's model and core count)."""
    if device.type == "cuda":
        prop = torch.cuda.get_device_properties(device)
        return dict(type="cuda", name=prop.name, capability=f"{prop.major}.{prop.minor}",
                    memory_gib=prop.total_memory / 2**30, multiprocessors=prop.multi_processor_count)
    return dict(type=device.type, name=_cpu_model(), cpus=os.cpu_count())


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def timings_caveat(device: torch.device) -> str | None:
    """The line every run on a CPU prints: its times do not say anything about the GPU kernels."""
    if device.type == "cuda":
        return None
    return (f"note: on {device.type} times vary many-fold and say nothing about GPU kernels; the float64 errors "
            f"and the memory are meaningful")


def git_commit() -> str | None:
    """The checkout's ``HEAD`` commit, with ``-dirty`` after it where tracked files differ from it (the result then
    belongs to no commit), or None outside a git checkout (an installed wheel)."""
    here = Path(__file__).resolve().parent
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                                 capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0:
        return None
    return out.stdout.strip() + ("-dirty" if changed.returncode == 0 and changed.stdout.strip() else "")


def now_utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def package_version(pkg: str) -> str | None:
    """Installed version of distribution ``pkg``; None when it is not installed."""
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, str | None]:
    """Installed versions of torch, triton, the peers and vpce (None: not installed), and torch's CUDA."""
    out = {pkg: package_version(pkg) for pkg in PACKAGES}
    from .. import __version__
    out["vpce"] = __version__
    out["cuda"] = torch.version.cuda
    return out
