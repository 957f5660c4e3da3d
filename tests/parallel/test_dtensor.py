"""DTensor tensor parallelism (torchtitan's layout) on gloo ranks: a Shard(0) weight DTensor on a 1-D mesh."""

import subprocess
import sys

import pytest
import torch

import vpce
from distributed import run_ranks
from vpce.reference import reference, rel_err
from problems import make_problem

pytest.importorskip("torch.distributed.tensor")


def _dtensor_main(rank, world, rows, vocab_size, hidden_layout, backend):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    dtype = torch.float64 if backend == "torch" else torch.float32
    p = make_problem((2 * world, 3), 16, rows, dtype=dtype, bias=True, vocab_size=vocab_size, ignore_frac=0.2,
                     seed=rows)
    w = distribute_tensor(p.weight, mesh, [Shard(0)]).requires_grad_()
    b = distribute_tensor(p.bias, mesh, [Shard(0)]).requires_grad_()
    if hidden_layout == "plain":
        h = p.hidden.clone().requires_grad_()
    else:
        place = Replicate() if hidden_layout == "replicate" else Shard(0)
        h = distribute_tensor(p.hidden, mesh, [place]).requires_grad_()
    t = distribute_tensor(p.target, mesh, [Replicate()])
    loss = vpce.linear_cross_entropy(h, w, t, b, vocab_size=vocab_size if vocab_size != rows else None,
                                     label_smoothing=0.1, backend=backend)
    (loss * 1.5).backward()
    ref = reference(p.hidden, p.weight, p.target, p.bias, grad=torch.tensor(1.5), vocab_size=vocab_size,
                    label_smoothing=0.1)
    from torch.distributed.tensor import DTensor
    assert isinstance(w.grad, DTensor) and tuple(w.grad.placements) == (Shard(0),)
    dh = h.grad.full_tensor() if isinstance(h.grad, DTensor) else h.grad
    return (rel_err(loss, ref.loss), rel_err(dh, ref.dhidden), rel_err(w.grad.full_tensor(), ref.dweight),
            rel_err(b.grad.full_tensor(), ref.dbias))


CASES = [  # (world, rows, vocab_size, hidden layout)
    (2, 64, 64, "plain"), (2, 64, 64, "sequence-shard"), (3, 101, 97, "replicate"),
    (3, 101, 97, "sequence-shard"), (4, 5, 5, "replicate"),
]


@pytest.mark.parametrize("world,rows,vocab_size,hidden_layout", CASES,
                         ids=["even-plain", "even-sp", "uneven-padded-replicate", "uneven-padded-sp",
                              "a-rank-with-no-rows"])
def test_dtensor_weight(world, rows, vocab_size, hidden_layout):
    for rank, errs in enumerate(run_ranks(_dtensor_main, world, rows, vocab_size, hidden_layout, "torch")):
        assert max(errs) < 1e-11, f"rank {rank}: loss/dX/dW/db errs {errs}"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo runs use the CPU interpreter")
def test_dtensor_weight_triton_backend():
    for rank, errs in enumerate(run_ranks(_dtensor_main, 2, 64, 60, "sequence-shard", "triton")):
        assert max(errs) < 2e-5, f"rank {rank}: loss/dX/dW/db errs {errs}"


def _run_docs_snippet(rank, world):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "integrations.md").read_text()
    section = text.split("## DTensor tensor parallelism (torchtitan)", 1)[1].split("\n## ", 1)[0]
    code = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    exec(compile(code, "docs/integrations.md", "exec"), {})
    return True


def test_docs_dtensor_snippet_runs():
    assert all(run_ranks(_run_docs_snippet, 2))


def test_a_call_without_dtensors_does_not_import_them():
    """No tensor can be a DTensor before ``torch.distributed.tensor`` is loaded, so a call in a process that never
    loaded it must not load it (with sympy and torch.fx, seconds of a process's first step)."""
    code = ("import sys, torch, vpce\n"
            "x = torch.randn(6, 8, requires_grad=True); w = torch.randn(20, 8, requires_grad=True)\n"
            "y = torch.tensor([0, 3, -100, 19, 7, 1])\n"
            "vpce.linear_cross_entropy(x, w, y).backward()\n"
            "vpce.linear_distillation_loss(x, w, x.detach(), w.detach(), y).backward()\n"
            "print(sorted(m for m in ('torch.distributed.tensor', 'sympy') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
