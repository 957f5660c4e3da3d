"""Multi-GPU check: vocab-sharded vpce equals the single-GPU (tp=1) result, on every rank of a torchrun launch.

    torchrun --standalone --nproc-per-node 2 launch/check_tp.py
    torchrun --standalone --nproc-per-node 4 launch/check_tp.py --budgets auto,lean --layouts replicated,sp

Every rank draws the same full problem (bf16 on CUDA, fp32 on CPU), computes the tp=1 loss and gradients with
the whole lm_head on its own device, then the sharded ones with its rows of an **uneven, padded** vocab split over
all processes of the launch (hidden replicated, or its token slice with ``sp``), for each memory budget. It prints
each rank's relative differences (loss, dX or its slice, its dW rows) and exits 1 if any exceeds the tolerance
(bf16: a few ulps from the extra rounding of summed partials). ``tests/parallel/test_multi_gpu.py`` runs the same
``check`` under NCCL on 2 and 4 GPUs. Several nodes: torchrun's rendezvous, the same command on every node
(``--rdzv-endpoint``: host:port of one node that all of them reach; ``--rdzv-id``: any name the job shares)::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST0:29500 --rdzv-id vpce-check \\
        launch/check_tp.py

On CUDA each rank uses ``cuda:LOCAL_RANK`` and NCCL; without CUDA, the CPU and gloo (the torch backend). The
collective environment is ``vpce.bench.launch_env``'s (NVLink multicast off). One process works too, with
torchrun (``--nproc-per-node 1``) or without it (``python launch/check_tp.py``): tp=1 against itself.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vpce  # noqa: E402
from vpce.bench.launch_env import init_process_group, local_cuda_device  # noqa: E402

TOLERANCE = {"loss": 1e-5, "dX": 1e-2, "dW": 1e-2}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def check(rank: int, world: int, budget: str, sp: bool, *, device: torch.device, n_per_rank: int = 2048,
          d: int = 1024, vocab: int = 50000, group=None) -> dict[str, float]:
    """This rank's relative differences between the sharded run and tp=1, for one budget and layout."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)  # the same full problem on every rank
    n = n_per_rank * world
    padded = -(-vocab // 256) * 256  # rows >= vocab are padding (Megatron's habit)
    x = torch.randn(n, d, device=device, generator=gen).to(dtype)
    w = (torch.randn(padded, d, device=device, generator=gen) / d**0.5).to(dtype)
    y = torch.randint(0, vocab, (n,), device=device, generator=gen)
    y[::11] = -100
    g = torch.rand((), device=device, generator=gen) + 0.5
    opts = dict(vocab_size=vocab, memory_budget=budget, label_smoothing=0.1)

    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    (vpce.linear_cross_entropy(x1, w1, y, **opts) * g).backward()
    loss1 = vpce.linear_cross_entropy(x1.detach(), w1.detach(), y, **opts)

    # uneven split: every rank but the last takes 256 rows more than its even share
    bounds = [0] + [padded * (r + 1) // world + (256 if r < world - 1 else 0) for r in range(world)]
    bounds[-1] = padded
    lo, hi = bounds[rank], bounds[rank + 1]
    rows = slice(rank * n_per_rank, (rank + 1) * n_per_rank)
    xs = (x[rows] if sp else x).clone().requires_grad_()
    ws = w[lo:hi].clone().requires_grad_()
    group = group or dist.group.WORLD
    # with vocab_start given too (as Megatron gives it) a CUDA call decides the ranks' agreement on the device (no
    # host read); without it the layout is learned and read back: the two layouts take the two paths
    start = dict(vocab_start=lo) if sp else {}
    loss = vpce.linear_cross_entropy(xs, ws, y, group=group, sequence_parallel=sp, **start, **opts)
    (loss * g).backward()
    want_dx = x1.grad[rows] if sp else x1.grad
    return {"loss": _rel(loss.detach(), loss1), "dX": _rel(xs.grad, want_dx), "dW": _rel(ws.grad, w1.grad[lo:hi])}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budgets", default="auto,lean", help="memory budgets to check")
    ap.add_argument("--layouts", default="replicated,sp", help="replicated and/or sp (sequence parallel)")
    ap.add_argument("--n-per-rank", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=1024, help="D")
    ap.add_argument("--vocab", type=int, default=50000)
    ap.add_argument("--tol-scale", type=float, default=1.0, help="multiplies the tolerances (0: any difference fails)")
    args = ap.parse_args(argv)
    if torch.cuda.is_available():
        device = local_cuda_device()
        init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(1)
        init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    worst = 0
    for budget in args.budgets.split(","):
        for layout in args.layouts.split(","):
            errs = check(rank, world, budget, layout == "sp", device=device, n_per_rank=args.n_per_rank, d=args.hidden,
                         vocab=args.vocab)
            every = [None] * world
            dist.all_gather_object(every, errs)
            if rank == 0:
                for r, e in enumerate(every):
                    bad = [k for k, v in e.items() if v > TOLERANCE[k] * args.tol_scale]
                    worst = max(worst, len(bad))
                    print(f"world={world} budget={budget} layout={layout} rank={r}: "
                          + "  ".join(f"{k} {v:.2e}" for k, v in e.items()) + ("  FAIL " + ",".join(bad) if bad else ""))
    flag = torch.tensor([worst], device=device)
    dist.broadcast(flag, 0)
    dist.destroy_process_group()
    return 1 if int(flag) else 0


if __name__ == "__main__":
    sys.exit(main())
