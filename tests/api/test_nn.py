"""``vpce.nn`` against torch 2.13's own ``F.linear_cross_entropy`` and ``nn.LinearCrossEntropyLoss`` on the CPU: the
same loss and gradients to fp32 rounding for every combination of reduction, class weights, label smoothing (1.0
included) and ignored tokens, and the module with torch's state dict.

Both run in fp32 on the same inputs; the bar is 1e-5 relative (of the largest entry), and each case also checks
that leaving out the class weights or the smoothing would miss it by far more (the test can fail).
"""

import pytest
import torch
import torch.nn.functional as F

import vpce
from problems import leaf, make_problem
from vpce.reference import rel_err

TORCH_HAS_IT = hasattr(F, "linear_cross_entropy") and hasattr(torch.nn, "LinearCrossEntropyLoss")
pytestmark = pytest.mark.skipif(not TORCH_HAS_IT, reason="needs torch >= 2.13 (F.linear_cross_entropy)")
RTOL = 1e-5
V, D = 67, 24


def _rel(got, want) -> float:
    """Max abs error over the largest |want| (fp32 rounding of the largest entries)."""
    return (got.detach().double() - want.detach().double()).abs().max().item() / want.detach().abs().max().item()


def _problem(ignore: float, reduction: str, seed=0):
    p = make_problem(37, D, V, bias=True, ignore_frac=ignore, reduction=reduction, seed=seed)
    cw = torch.rand(V, generator=torch.Generator().manual_seed(seed + 1)) * 2
    return p, cw


def _run(fn, p, **kwargs):
    h, w, b = leaf(p.hidden), leaf(p.weight), leaf(p.bias)
    loss = fn(h, w, p.target, linear_bias=b, **kwargs)
    (loss * p.grad.to(loss.dtype)).sum().backward()
    return loss.detach(), h.grad, w.grad, b.grad


@pytest.mark.parametrize("ignore", [0.0, 0.3], ids=["none-ignored", "30pct-ignored"])
@pytest.mark.parametrize("eps", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("weighted", [False, True], ids=["unweighted", "class-weights"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_function_matches_torch(reduction, weighted, eps, ignore):
    p, cw = _problem(ignore, reduction)
    kwargs = dict(weight=cw if weighted else None, reduction=reduction, label_smoothing=eps)
    got = _run(vpce.nn.linear_cross_entropy, p, **kwargs)
    want = _run(F.linear_cross_entropy, p, **kwargs)
    for name, a, b in zip(("loss", "dX", "dW", "db"), got, want):
        assert _rel(a, b) <= RTOL, f"{name}: rel err {_rel(a, b):.2e} > {RTOL:.0e}"
    # controls: the weights and the smoothing each change the result by far more than the bar
    if weighted:
        other = _run(F.linear_cross_entropy, p, **{**kwargs, "weight": None})
        assert _rel(other[1], want[1]) > 100 * RTOL, "class weights hardly change dX: weak test"
    if eps:
        other = _run(F.linear_cross_entropy, p, **{**kwargs, "label_smoothing": 0.0})
        assert _rel(other[1], want[1]) > 100 * RTOL, "smoothing hardly changes dX: weak test"


def test_triton_backend_matches_torch():
    """The Triton kernels (the CPU interpreter here) on a few of the same cases."""
    for reduction, eps in (("mean", 1.0), ("sum", 0.3), ("none", 0.3)):
        p, cw = _problem(0.3, reduction, seed=2)
        kwargs = dict(weight=cw, reduction=reduction, label_smoothing=eps)
        got = _run(vpce.nn.linear_cross_entropy, p, backend="triton", **kwargs)
        want = _run(F.linear_cross_entropy, p, **kwargs)
        for name, a, b in zip(("loss", "dX", "dW", "db"), got, want):
            assert _rel(a, b) <= RTOL, f"{reduction} eps={eps} {name}: rel err {_rel(a, b):.2e}"


@pytest.mark.parametrize("bias", [False, True])
def test_module_matches_torch_and_shares_its_state_dict(bias):
    torch.manual_seed(0)
    cw = torch.rand(V) + 0.5
    kwargs = dict(bias=bias, weight=cw, reduction="mean", ignore_index=5, label_smoothing=0.2)
    theirs = torch.nn.LinearCrossEntropyLoss(D, V, **kwargs)
    mine = vpce.nn.LinearCrossEntropyLoss(D, V, **kwargs)
    mine.load_state_dict(theirs.state_dict())  # strict: the same keys (linear.weight, linear.bias, weight)
    assert set(mine.state_dict()) == set(theirs.state_dict())
    x = torch.randn(29, D)
    t = torch.randint(0, V, (29,))
    t[::4] = 5
    out = []
    for m in (mine, theirs):
        h = leaf(x)
        loss = m(h, t)
        loss.backward()
        out.append((loss.detach(), h.grad, m.linear.weight.grad) + ((m.linear.bias.grad,) if bias else ()))
    for name, a, b in zip(("loss", "dX", "dW", "db"), *out):
        assert _rel(a, b) <= RTOL, f"{name}: rel err {_rel(a, b):.2e}"


def test_defaults_and_unbatched_input():
    """``ignore_index=None`` is -100; an unbatched ``[in_features]`` input with a 0-d target works as in torch."""
    p, _ = _problem(0.0, "mean")
    t = p.target.clone()
    t[:5] = -100
    got = vpce.nn.linear_cross_entropy(p.hidden, p.weight, t)
    want = F.linear_cross_entropy(p.hidden, p.weight, t)
    assert _rel(got, want) <= RTOL
    for reduction in ("mean", "none"):
        got = vpce.nn.linear_cross_entropy(p.hidden[0], p.weight, p.target[0], reduction=reduction)
        want = F.linear_cross_entropy(p.hidden[0], p.weight, p.target[0], reduction=reduction)
        assert got.shape == want.shape == () and _rel(got, want) <= RTOL


def test_vpce_extras_are_keyword_only_options():
    """vpce's own options pass through (here z_loss and a padded vocab); torch's names are required for torch's
    arguments."""
    p, cw = _problem(0.2, "mean")
    got = vpce.nn.linear_cross_entropy(p.hidden, p.weight, p.target % 60, weight=cw, vocab_size=60, z_loss=1e-2)
    want = vpce.linear_cross_entropy(p.hidden, p.weight, p.target % 60, class_weight=cw, vocab_size=60, z_loss=1e-2)
    assert rel_err(got, want) == 0
    with pytest.raises(TypeError, match="class_weight: expected torch's name for it here, weight="):
        vpce.nn.linear_cross_entropy(p.hidden, p.weight, p.target, class_weight=cw)
    with pytest.raises(TypeError, match="tempreature: expected a keyword among"):
        vpce.nn.linear_cross_entropy(p.hidden, p.weight, p.target, tempreature=2.0)
    with pytest.raises(TypeError, match="token_weight"):
        vpce.nn.LinearCrossEntropyLoss(D, V, token_weight=torch.ones(3))


def test_options_are_accepted():
    """torch's chunking options: accepted; allow_retain_graph=True gives a backward that may run twice."""
    p, _ = _problem(0.0, "mean")
    opts = torch.nn.LinearCrossEntropyOptions(allow_retain_graph=True, batch_chunk_size=8)
    h = leaf(p.hidden)
    loss = vpce.nn.linear_cross_entropy(h, p.weight, p.target, options=opts)
    loss.backward(retain_graph=True)
    first = h.grad.clone()
    loss.backward()
    assert torch.allclose(h.grad, 2 * first)
    assert _rel(loss, F.linear_cross_entropy(p.hidden, p.weight, p.target, options=opts)) <= RTOL
    with pytest.raises(ValueError, match="memory_budget: expected 'lean'"):
        vpce.nn.linear_cross_entropy(p.hidden, p.weight, p.target, options=opts, memory_budget="fast")
    with pytest.raises(TypeError, match="options: expected None or a torch.nn.LinearCrossEntropyOptions"):
        vpce.nn.linear_cross_entropy(p.hidden, p.weight, p.target, options={"batch_chunk_size": 8})


def test_unsupported_inputs_are_named():
    p, _ = _problem(0.0, "mean")
    probs = torch.softmax(torch.randn(37, V), -1)
    with pytest.raises(TypeError, match="class-probability .* vpce.linear_distillation_loss"):
        vpce.nn.linear_cross_entropy(p.hidden, p.weight, probs)
    with pytest.raises(ValueError, match="K-dimensional loss is not supported"):
        vpce.nn.linear_cross_entropy(p.hidden, p.weight.reshape(V, 1, D), p.target)
    with pytest.raises(ValueError, match="out_features: expected \\(\\)"):
        vpce.nn.LinearCrossEntropyLoss(D, V, out_features=(4,))
    with pytest.raises(ValueError, match=r"weight: expected a tensor of shape \(67,\)"):
        vpce.nn.LinearCrossEntropyLoss(D, V, weight=torch.ones(3))
    with pytest.raises(ValueError, match="label_smoothing: expected <= 1.0"):
        vpce.nn.LinearCrossEntropyLoss(D, V, label_smoothing=1.5)
