"""Under ``torch.autocast`` vpce computes as if its GEMM operands had been passed in the autocast dtype (as
``nn.Linear`` does), and the gradients come back in the parameters' dtype (fp32 for fp32 parameters).

Before: the torch backend's fast route raised a dtype error in a scatter, and the Triton route ran fp32 GEMMs
(4.1x slower on the Llama-3-8B head) with no warning. Then the fast route rounded its fp32 dW to the
autocast dtype and autograd's cast copied it back to fp32, 1.5 GiB at the start of backward on a 128k-vocab head;
now the autograd Function gets the fp32 parameters and casts them itself (``vpce.prepare.compute_operands``).
"""

from __future__ import annotations

import pytest
import torch

import vpce
from distributed import run_ranks
from problems import leaf, make_problem
from vpce import speculation
from vpce.reference import reference, rel_err

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
    fast = entry == "ce" and budget == "auto"  # the fast route (CPU; a call this small on CUDA too)
    # float64 gradients of the same 16-bit operands
    ref = reference(p.hidden.to(dtype), p.weight.to(dtype), p.target, p.bias.to(dtype)) if fast else None
    for name, g, g2 in (("hidden", dh, dh2), ("weight", dw, dw2), ("bias", db, db2)):
        assert g.dtype == torch.float32, f"{name}.grad is {g.dtype}, expected the parameter's fp32"
        if fast and name != "hidden":
            # the fast route's fp32 accumulator, scaled: the call on 16-bit operands returns its rounding, and it
            # is no farther from the float64 gradient than that rounding
            want64 = ref.dweight if name == "weight" else ref.dbias
            assert torch.equal(g.to(dtype), g2), name
            assert rel_err(g, want64) <= rel_err(g2, want64), (name, rel_err(g, want64), rel_err(g2, want64))
        else:
            # the same 16-bit gradient, cast up (only the accumulation of two casts may differ)
            torch.testing.assert_close(g, g2.float(), rtol=0, atol=float(g2.abs().max()) * 2 ** -9, msg=name)


def _grad_fn_parents(out: torch.Tensor, leaf_tensor: torch.Tensor) -> set:
    """The names of the autograd nodes of ``out``'s graph whose next function is ``leaf_tensor``'s
    AccumulateGrad."""
    seen, todo, parents = set(), [out.grad_fn], set()
    while todo:
        fn = todo.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        for nxt, _ in fn.next_functions:
            if nxt is not None and getattr(nxt, "variable", None) is leaf_tensor:
                parents.add(fn.name())
            todo.append(nxt)
    return parents


def _autocast_call(entry, backend, h, w, y, b):
    """``(loss, the node of vpce's autograd Function, the route)`` of one call of ``entry`` (under autocast)."""
    if entry in ("ce", "ce-lean"):
        loss = vpce.linear_cross_entropy(h, w, y, b, backend=backend,
                                         memory_budget="lean" if entry == "ce-lean" else "auto")
        return loss, "LinearCrossEntropyFunctionBackward", speculation.route_of(loss)
    if entry == "log_probs":
        logp = vpce.linear_log_probs(h, w, y, b, backend=backend)
        return logp.sum(), "LinearLogProbsFunctionBackward", speculation.route_of(logp)
    if entry == "log_prob_loss":
        loss = vpce.linear_log_prob_loss(h, w, y, lambda lp, ent: -lp, b, backend=backend)
        return loss, "LogProbLossFunctionBackward", "fast" if backend == "triton" else "lean"
    gen = torch.Generator().manual_seed(7)
    t_h = torch.randn(h.shape, generator=gen).to(h.device)
    t_w = (torch.randn(w.shape, generator=gen) / w.shape[1] ** 0.5).to(w.device)
    loss = vpce.linear_distillation_loss(h, w, t_h, t_w, y, b, backend=backend)
    return loss, "LinearDistillationFunctionBackward", speculation.route_of(loss)


FP32_CASES = [("ce", "torch", torch.bfloat16), ("ce", "triton", torch.float16), ("ce-lean", "torch", torch.bfloat16),
              ("log_probs", "torch", torch.bfloat16), ("log_probs", "triton", torch.float16),
              ("log_prob_loss", "torch", torch.bfloat16), ("log_prob_loss", "triton", torch.float16),
              ("distill", "torch", torch.bfloat16), ("distill", "triton", torch.float16)]


@pytest.mark.parametrize("entry,backend,dtype", FP32_CASES, ids=[f"{e}-{b}-{str(d)[6:]}" for e, b, d in FP32_CASES])
def test_autocast_hands_the_fp32_parameters_to_the_function(entry, backend, dtype):
    """Under autocast the fp32 weight and bias go into vpce's autograd Function as they are (it casts them in its
    forward): no cast node between them and the Function in the graph, and their gradients come back in fp32. On
    the fast route (and the speculative one) that is the fp32 accumulator, not a 16-bit gradient cast up. The
    speculative route: a ``linear_log_probs`` call site's second call with the same uniform upstream gradient."""
    p = make_problem(37, 24, 101, dtype=torch.float32, bias=True, ignore_frac=0.1, seed=3)
    speculation.reset()
    try:
        for _ in range(2 if entry == "log_probs" else 1):
            h, w, b = leaf(p.hidden.to(DEV)), leaf(p.weight.to(DEV)), leaf(p.bias.to(DEV))
            with torch.autocast(DEV, dtype=dtype):
                loss, node, route = _autocast_call(entry, backend, h, w, p.target.to(DEV), b)
            assert _grad_fn_parents(loss, w) == {node}, (_grad_fn_parents(loss, w), node)
            assert _grad_fn_parents(loss, b) == {node}
            assert "ToCopyBackward0" in _grad_fn_parents(loss, h)  # hidden: cast by autocast, as before
            loss.backward()
    finally:
        speculation.reset()
    assert route == ("speculative" if (entry, backend) == ("log_probs", "triton") else
                     "lean" if entry in ("ce-lean", "log_probs") or (entry, backend) == ("log_prob_loss", "torch")
                     else "fast"), route
    assert w.grad.dtype == b.grad.dtype == torch.float32 and h.grad.dtype == torch.float32
    if route in ("fast", "speculative"):
        for g in (w.grad, b.grad):
            assert not torch.equal(g, g.to(dtype).float()), "a 16-bit gradient cast up"


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
