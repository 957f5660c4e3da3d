"""Under ``torch.autocast`` vpce computes as if its GEMM operands had been passed in the autocast dtype (as
``nn.Linear`` does), and the gradients come back in the parameters' dtype (fp32 for fp32 parameters).

Before: the torch backend's fast route raised a dtype error in a scatter, and the Triton route ran fp32 GEMMs
(4.1x slower on the Llama-3-8B head) with no warning.
"""

from __future__ import annotations

import pytest
import torch

import vpce
from distributed import run_ranks
from problems import leaf, make_problem

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
CASES = [("torch", torch.bfloat16), ("torch", torch.float16), ("triton", torch.float16)]
if CUDA:
    CASES.append(("triton", torch.bfloat16))


def _both(p, backend, dtype, device, entry, **kw):
    """(autocast call on fp32 tensors, the same call on tensors already in ``dtype``): outputs and grads."""
    out = []
    for under_autocast in (True, False):
        cast = (lambda t: t) if under_autocast else (lambda t: t.to(dtype))
        h, w, b = (leaf(cast(t).to(device)) for t in (p.hidden, p.weight, p.bias))
        y = p.target.to(device)
        with torch.autocast(device, dtype=dtype, enabled=under_autocast):
            if entry == "ce":
                res = vpce.linear_cross_entropy(h, w, y, b, backend=backend, **kw)
            else:
                logp, ent = vpce.linear_log_probs(h, w, y, b, backend=backend, return_entropy=True, **kw)
                res = logp.sum() + 0.5 * ent.sum()
        res.backward()
        out.append((res.detach(), h.grad, w.grad, b.grad))
    return out


@pytest.mark.parametrize("entry,budget", [("ce", "auto"), ("ce", "lean"), ("logprobs", None)])
@pytest.mark.parametrize("backend,dtype", CASES, ids=[f"{b}-{str(d)[6:]}" for b, d in CASES])
def test_autocast_equals_the_call_on_autocast_dtype_operands(backend, dtype, entry, budget):
    p = make_problem(37, 24, 101, dtype=torch.float32, bias=True, ignore_frac=0.1, seed=3)
    kw = dict(memory_budget=budget) if entry == "ce" else {}
    (loss, dh, dw, db), (want, dh2, dw2, db2) = _both(p, backend, dtype, DEV, entry, **kw)
    assert abs(float(loss) - float(want)) <= 1e-5 * abs(float(want)), (float(loss), float(want))
    for name, g, g2 in (("hidden", dh, dh2), ("weight", dw, dw2), ("bias", db, db2)):
        assert g.dtype == torch.float32, f"{name}.grad is {g.dtype}, expected the parameter's fp32"
        # the same 16-bit gradient, cast up (only the accumulation of two casts may differ)
        torch.testing.assert_close(g, g2.float(), rtol=0, atol=float(g2.abs().max()) * 2 ** -9, msg=name)


def _sharded(rank, world):
    import torch.distributed as dist

    p = make_problem(12, 16, 50, dtype=torch.float32, bias=True, seed=5)
    sizes = [30, 20]
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    res = []
    for under_autocast in (True, False):
        cast = (lambda t: t) if under_autocast else (lambda t: t.to(torch.bfloat16))
        h, w, b = leaf(cast(p.hidden)), leaf(cast(p.weight[sl])), leaf(cast(p.bias[sl]))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=under_autocast):
            loss = vpce.linear_cross_entropy(h, w, p.target, b, group=dist.group.WORLD, backend="torch")
        loss.backward()
        res.append((float(loss), h.grad.dtype, w.grad.dtype, float((h.grad.float()).norm())))
    return res


@pytest.mark.skipif(CUDA, reason="gloo ranks on the CPU")
def test_autocast_vocab_parallel():
    for rank, ((loss, hd, wd, hn), (want, _, _, hn2)) in enumerate(run_ranks(_sharded, 2, timeout=120)):
        assert abs(loss - want) <= 1e-5 * abs(want), (rank, loss, want)
        assert hd == wd == torch.float32
        assert abs(hn - hn2) <= 1e-2 * hn2, (rank, hn, hn2)


def test_main_grad_under_autocast_is_refused():
    p = make_problem(5, 8, 20, dtype=torch.float32)
    w = leaf(p.weight)
    w.main_grad = torch.zeros_like(w)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(ValueError, match="accumulate_main_grad: expected a weight that torch.autocast leaves"):
            vpce.linear_cross_entropy(leaf(p.hidden), w, p.target, accumulate_main_grad=True)
