"""Vocab parallelism over NCCL, one GPU per rank (skips without 2 GPUs): the sharded result equals the
single-GPU (tp=1) result within bf16 rounding, replicated and sequence-parallel, uneven shards, padded vocab,
both memory routes."""

import pytest
import torch

import vpce
from distributed import run_ranks
from oracle import rel_err

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")


def _nccl_main(rank, world, budget, sp):
    import torch.distributed as dist

    torch.manual_seed(0)  # the same full problem on every rank
    n, d, vocab = 2048 * world, 1024, 50000
    padded = 50176  # a multiple of 256; rows >= vocab are padding
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    w = (torch.randn(padded, d, device="cuda") / d**0.5).to(torch.bfloat16)
    y = torch.randint(0, vocab, (n,), device="cuda")
    y[::11] = -100
    g = torch.rand((), device="cuda") + 0.5

    # tp = 1 on this GPU
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss1 = vpce.linear_cross_entropy(x1, w1, y, vocab_size=vocab, memory_budget=budget, label_smoothing=0.1)
    (loss1 * g).backward()

    # sharded: uneven row split (the first rank takes a larger share)
    bounds = [0] + [padded * (r + 1) // world + (256 if r < world - 1 else 0) for r in range(world)]
    bounds[-1] = padded
    lo, hi = bounds[rank], bounds[rank + 1]
    rows = slice(rank * n // world, (rank + 1) * n // world)
    xs = (x[rows] if sp else x).clone().requires_grad_()
    ws = w[lo:hi].clone().requires_grad_()
    loss = vpce.linear_cross_entropy(xs, ws, y, group=dist.group.WORLD, sequence_parallel=sp, vocab_size=vocab,
                                     memory_budget=budget, label_smoothing=0.1)
    (loss * g).backward()
    want_dx = x1.grad[rows] if sp else x1.grad
    return rel_err(loss, loss1), rel_err(xs.grad, want_dx), rel_err(ws.grad, w1.grad[lo:hi])


@pytest.mark.parametrize("world", [w for w in (2, 4) if w <= max(GPUS, 2)])
@pytest.mark.parametrize("budget", ["auto", "lean"])
@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence-parallel"])
def test_nccl_sharded_equals_single_gpu(world, budget, sp):
    for rank, (loss_err, dx_err, dw_err) in enumerate(run_ranks(_nccl_main, world, budget, sp, backend="nccl")):
        where = f"rank {rank}/{world} budget={budget} sp={sp}"
        assert loss_err < 1e-5, f"{where}: loss differs from tp=1 by {loss_err:.2e}"
        # dX partial sums are rounded to bf16 once more before the all-reduce: a few bf16 ulps at most
        assert dx_err < 1e-2, f"{where}: dX differs from tp=1 by {dx_err:.2e}"
        assert dw_err < 1e-2, f"{where}: dW shard differs from tp=1 by {dw_err:.2e}"
