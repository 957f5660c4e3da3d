"""Per-token loss weights and Megatron-style main_grad accumulation, on both backends, against the oracle.

The Triton backend runs through the CPU interpreter where there is no CUDA (fp32 here); the torch backend in
float64 with tight bounds. Distributed cases run on gloo ranks.
"""

import pytest
import torch

import vpce
from distributed import run_ranks
from vpce.reference import reference, rel_err
from problems import VARIANTS, leaf, make_problem

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BACKENDS = [("torch", torch.float64, 1e-12), ("triton", torch.float32, 2e-5)]


def weights_for(p, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.rand(p.target.shape, generator=gen, dtype=torch.float64) * 2


# (reduction, memory_budget): the fast route (mean, sum) and the lean one (mean, sum, none; ("none", "auto") is the
# lean route or, after a uniform call, the speculative one, which tests/api/test_caller_reduced.py covers)
ROUTES = [("mean", "auto"), ("sum", "auto"), ("mean", "lean"), ("sum", "lean"), ("none", "lean")]


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("reduction,budget", ROUTES, ids=lambda x: x)
@pytest.mark.parametrize("variant", ["plain", "all"])
def test_token_weight(backend, dtype, tol, reduction, budget, variant):
    p = make_problem(41, 24, 97, dtype=dtype, bias=True, ignore_frac=0.25, reduction=reduction, seed=3)
    tw = weights_for(p)
    h, w, b = (leaf(x.to(DEV)) for x in (p.hidden, p.weight, p.bias))
    loss = vpce.linear_cross_entropy(h, w, p.target.to(DEV), b, token_weight=tw.to(DEV, dtype), backend=backend,
                                     reduction=reduction, memory_budget=budget, **VARIANTS[variant])
    (loss * p.grad.to(DEV, loss.dtype)).sum().backward()
    ref = reference(p.hidden, p.weight, p.target, p.bias, grad=p.grad, reduction=reduction, token_weight=tw,
                    **VARIANTS[variant])
    for name, got, want in (("loss", loss, ref.loss), ("dX", h.grad, ref.dhidden), ("dW", w.grad, ref.dweight),
                            ("db", b.grad, ref.dbias)):
        err = rel_err(got, want)
        assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"


def test_token_weight_zero_sum_is_zero_and_errors():
    p = make_problem(9, 8, 20)
    h, w = leaf(p.hidden), leaf(p.weight)
    loss = vpce.linear_cross_entropy(h, w, p.target, token_weight=torch.zeros(9))
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0
    with pytest.raises(ValueError, match=r"token_weight: expected shape \(9,\)"):
        vpce.linear_cross_entropy(h, w, p.target, token_weight=torch.ones(8))
    with pytest.raises(TypeError, match="token_weight: expected a floating dtype"):
        vpce.linear_cross_entropy(h, w, p.target, token_weight=torch.ones(9, dtype=torch.int64))
    with pytest.raises(ValueError, match="does not require grad"):
        vpce.linear_cross_entropy(h, w, p.target, token_weight=torch.ones(9, requires_grad=True))


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("budget", ["auto", "lean"])
@pytest.mark.parametrize("ddp_flag", [False, True], ids=["plain-param", "megatron-ddp-param"])
def test_main_grad_accumulation(backend, dtype, tol, budget, ddp_flag):
    """Two micro-batches add their fp32 weight gradients into weight.main_grad (padding rows stay 0)."""
    a = make_problem(23, 16, 60, dtype=dtype, vocab_size=55, ignore_frac=0.2, seed=1)
    b = make_problem(17, 16, 60, dtype=dtype, vocab_size=55, ignore_frac=0.2, seed=2)
    w = torch.nn.Parameter(a.weight.to(DEV))
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=DEV)
    if ddp_flag:
        w.grad_added_to_main_grad = False
    for prob, k in ((a, 3.0), (b, -0.5)):
        h = leaf(prob.hidden.to(DEV))
        loss = vpce.linear_cross_entropy(h, w, prob.target.to(DEV), vocab_size=55, backend=backend,
                                         memory_budget=budget, accumulate_main_grad=True)
        (loss * k).backward()
    want = (reference(a.hidden, a.weight, a.target, grad=torch.tensor(3.0), vocab_size=55).dweight
            + reference(b.hidden, a.weight, b.target, grad=torch.tensor(-0.5), vocab_size=55).dweight)
    err = rel_err(w.main_grad, want)
    assert err <= max(tol, 2e-6), f"main_grad rel err {err:.2e}"
    assert w.main_grad[55:].abs().max() == 0
    if ddp_flag:
        assert w.grad_added_to_main_grad is True and w.grad is not None and w.grad.shape == w.shape
    else:
        assert w.grad is None


def test_main_grad_requires_the_buffer():
    p = make_problem(5, 8, 20)
    with pytest.raises(ValueError, match="accumulate_main_grad: expected weight.main_grad"):
        vpce.linear_cross_entropy(p.hidden, leaf(p.weight), p.target, accumulate_main_grad=True)


def _weighted_tp_main(rank, world, backend):
    import torch.distributed as dist

    sizes = [30, 19, 26][:world]
    dtype = torch.float64 if backend == "torch" else torch.float32
    p = make_problem((3 * world, 2), 16, sum(sizes), dtype=dtype, vocab_size=sum(sizes) - 3, ignore_frac=0.2,
                     seed=5)
    tw = weights_for(p, 1)
    start = sum(sizes[:rank])
    out = []
    for sp in (False, True):
        h = leaf(p.hidden[rank * 3:(rank + 1) * 3] if sp else p.hidden)
        w = leaf(p.weight[start:start + sizes[rank]])
        loss = vpce.linear_cross_entropy(h, w, p.target, token_weight=tw.to(dtype), group=dist.group.WORLD,
                                         sequence_parallel=sp, vocab_size=p.vocab_size, backend=backend,
                                         label_smoothing=0.1)
        (loss * 2.5).backward()
        ref = reference(p.hidden, p.weight, p.target, grad=torch.tensor(2.5), vocab_size=p.vocab_size,
                        token_weight=tw, label_smoothing=0.1)
        want_dx = ref.dhidden[rank * 3:(rank + 1) * 3] if sp else ref.dhidden
        out.append(max(rel_err(loss, ref.loss), rel_err(h.grad, want_dx),
                       rel_err(w.grad, ref.dweight[start:start + sizes[rank]])))
    return out


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_token_weight_vocab_parallel(backend):
    tol = 1e-11 if backend == "torch" else 2e-5
    for rank, errs in enumerate(run_ranks(_weighted_tp_main, 3, backend)):
        assert max(errs) < tol, f"rank {rank}: errs {errs}"
