"""Vocab parallelism over NCCL, one GPU per rank (skips without 2 GPUs): the sharded result equals the
single-GPU (tp=1) result within bf16 rounding, replicated and sequence-parallel, uneven shards, padded vocab,
both memory routes. The check itself is ``launch/check_tp.py``'s (also a torchrun entry point); on CPU,
``tests/launch/test_launch_check_tp.py`` runs that script under torchrun with gloo."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from distributed import run_ranks

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")

CHECK = Path(__file__).resolve().parents[2] / "launch" / "check_tp.py"


def _check_module():
    spec = importlib.util.spec_from_file_location("launch_check_tp", CHECK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _nccl_main(rank, world, budget, sp):
    return _check_module().check(rank, world, budget, sp, device=torch.device("cuda", rank))


@pytest.mark.parametrize("world", [w for w in (2, 4) if w <= max(GPUS, 2)])
@pytest.mark.parametrize("budget", ["auto", "lean"])
@pytest.mark.parametrize("sp", [False, True], ids=["replicated", "sequence-parallel"])
def test_nccl_sharded_equals_single_gpu(world, budget, sp):
    tol = _check_module().TOLERANCE
    for rank, errs in enumerate(run_ranks(_nccl_main, world, budget, sp, backend="nccl")):
        where = f"rank {rank}/{world} budget={budget} sp={sp}"
        # dX partial sums are rounded to bf16 once more than tp=1: a few bf16 ulps at most
        for key, err in errs.items():
            assert err < tol[key], f"{where}: {key} differs from tp=1 by {err:.2e}"


def _one_dw_gemm_main(rank, world):
    """``check`` with ``P`` chunks of 2048 tokens at its 25000 columns per rank (4096 tokens at tp=2): ``"auto"``
    keeps every token's gradient in one ``P`` and finishes dW in one quack GEMM (``routing.one_weight_grad_gemm``),
    ``"fast"`` takes two chunks. Records each call's last dW GEMM: (no accumulator, tokens)."""
    import dataclasses

    from vpce import routing
    from vpce.backends import grads

    gib = 2048 * 25000 * 2 / 2**30
    routing.SIZING = dataclasses.replace(routing.SIZING, fast_p_gib=gib, min_p_gib=gib)
    seen = []
    real = grads.scaled_weight_grad
    grads.scaled_weight_grad = lambda acc, g, *a: seen.append((acc is None, g.shape[0])) or real(acc, g, *a)
    out = {}
    for budget in ("auto", "fast"):
        seen.clear()
        errs = _check_module().check(rank, world, budget, False, device=torch.device("cuda", rank))
        out[budget] = (errs, seen[-1] if seen else None)
    return out


def test_nccl_one_dw_gemm_over_every_token():
    from vpce.backends import hopper

    if torch.cuda.get_device_capability(0)[0] != 9 or hopper.quack() is None:
        pytest.skip("needs the hopper extra on sm_90")
    tol = _check_module().TOLERANCE
    for rank, out in enumerate(run_ranks(_one_dw_gemm_main, 2, backend="nccl")):
        assert out["auto"][1] == (True, 4096) and out["fast"][1] == (False, 2048), (rank, out)
        for budget, (errs, _) in out.items():
            for key, err in errs.items():
                assert err < tol[key], f"rank {rank} budget={budget}: {key} differs from tp=1 by {err:.2e}"
