"""The child process of ``vpce.backends.hopper``: ``python -m vpce.backends.hopper_child --dtype bf16 --device-name
NAME`` compiles the ``hopper`` extra's kernels into quack's cache without a GPU (``CUDA_VISIBLE_DEVICES`` empty, the
architecture in ``QUACK_ARCH`` / ``CUTE_DSL_ARCH``: ``hopper.child_env``). It calls the functions of
``backends.gemm`` that the fast route calls, on small CPU tensors of the dtype and layouts the route gives them, so
that each kernel lands under the key the GPU process looks up. The kernels of a plain call come first, then it says
``READY`` on stdout and goes on with the soft-capped and label-smoothing epilogues."""

from __future__ import annotations

import argparse
import functools
import sys

import torch

from ..options import Folded
from . import gemm
from .hopper import quack

#: The line the child prints once the kernels of a plain call (no soft cap, no label smoothing) are compiled.
READY = "ready"


def _compile(label: str, launch) -> None:
    """Run one of ``backends.gemm``'s quack calls on CPU tensors: quack compiles the kernel and writes it to its
    cache, then fails where it would ask the (absent) GPU for its launch."""
    try:
        launch()
    except Exception as e:  # noqa: BLE001 - every call ends here, after its compile, without a GPU
        print(f"{label}: {type(e).__name__}", file=sys.stderr)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m vpce.backends.hopper_child",
                                description="Compile the hopper extra's kernels into quack's cache, without a GPU.")
    p.add_argument("--dtype", choices=("bf16", "fp16"), required=True)
    p.add_argument("--device-name", required=True, help="the GPU's name (torch.cuda.get_device_name)")
    args = p.parse_args(argv)
    if quack() is None:
        print("quack-kernels does not import", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    n, d, v = 64, 128, 192  # any sizes: each kernel is compiled for symbolic shapes
    g = torch.zeros(n, v, dtype=dtype)
    x = torch.zeros(n, d, dtype=dtype)
    w = torch.zeros(v, d, dtype=dtype)
    one = torch.ones(())
    logits = []
    if dtype == torch.bfloat16:  # the statistics epilogue runs on bf16 logits only
        t, zt, cw = torch.zeros(n, dtype=torch.int32), torch.zeros(n), torch.ones(v)
        # the plain epilogue, then the soft-capped one before the label-smoothing ones
        logits = [(Folded(softcap=cap), sum_z) for sum_z in (False, True) for cap in (None, 30.0)]
    first = [("dW", lambda: gemm.scaled_weight_grad(None, g, x, one, dtype)),
             ("dX", lambda: gemm.scaled_hidden_grad(g, w, one, dtype, tile=gemm.dx_tile(args.device_name))),
             ("dW after earlier chunks", lambda: gemm.scaled_weight_grad(torch.zeros(v, d), g, x, one, dtype))]
    later = []
    for folded, sum_z in logits:
        launch = functools.partial(gemm.logits_with_stats, g, x, w, t, zt, folded, sum_z, cw if sum_z else None)
        (first if folded.softcap is None and not sum_z else later).append((f"logits {folded} sum_z={sum_z}", launch))
    for label, launch in first:
        _compile(label, launch)
    print(READY, flush=True)  # the parent's signal: what a plain call needs is in the cache
    for label, launch in later:
        _compile(label, launch)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
