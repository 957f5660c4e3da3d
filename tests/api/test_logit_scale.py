"""``logit_scale``: the logits times a constant before the soft cap (and the temperature), on both backends and
routes, against the float64 oracle; it folds into the cap and the temperature, so the kernels are unchanged.

The torch backend runs in float64 (tight bounds), the Triton one through the CPU interpreter where there is no CUDA
(fp32). The sharded case is in tests/api/test_class_weight.py, together with the class weights.
"""

import math

import pytest
import torch

import vpce
from problems import VARIANTS, leaf, make_problem
from vpce.reference import reference, reference_log_probs, rel_err

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BACKENDS = [("torch", torch.float64, 1e-12), ("triton", torch.float32, 2e-5)]
SCALE = 2.5


def _check(pairs, tol):
    for name, got, want in pairs:
        err = rel_err(got, want)
        assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("reduction,budget", [("mean", "auto"), ("sum", "lean"), ("none", "auto")])
@pytest.mark.parametrize("variant", ["plain", "all"])
def test_matches_oracle(backend, dtype, tol, reduction, budget, variant):
    """Scaled logits with the soft cap, label smoothing and z-loss: loss, dX, dW, db (fast and lean routes)."""
    p = make_problem(29, 16, 70, dtype=dtype, bias=True, ignore_frac=0.2, reduction=reduction, seed=1)
    h, w, b = (leaf(x.to(DEV)) for x in (p.hidden, p.weight, p.bias))
    loss = vpce.linear_cross_entropy(h, w, p.target.to(DEV), b, backend=backend, reduction=reduction,
                                     memory_budget=budget, logit_scale=SCALE, **VARIANTS[variant])
    (loss * p.grad.to(DEV, loss.dtype)).sum().backward()
    ref = reference(p.hidden, p.weight, p.target, p.bias, grad=p.grad, reduction=reduction, logit_scale=SCALE,
                    **VARIANTS[variant])
    _check((("loss", loss, ref.loss), ("dX", h.grad, ref.dhidden), ("dW", w.grad, ref.dweight),
            ("db", b.grad, ref.dbias)), tol)
    unscaled = reference(p.hidden, p.weight, p.target, p.bias, grad=p.grad, reduction=reduction,
                         **VARIANTS[variant])
    assert rel_err(unscaled.dhidden, ref.dhidden) > 1e3 * tol, "the scale hardly changes dX: weak test"


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_log_probs(backend, dtype, tol):
    """log p_t and the entropy of softmax(cap(s x) / T), gradients for upstream gradients on both."""
    p = make_problem(29, 16, 70, dtype=dtype, bias=True, ignore_frac=0.2, reduction="none", seed=2)
    h, w, b = (leaf(x.to(DEV)) for x in (p.hidden, p.weight, p.bias))
    opts = dict(logit_scale=0.7, softcap=2.0, temperature=1.3)
    logp, ent = vpce.linear_log_probs(h, w, p.target.to(DEV), b, backend=backend, return_entropy=True, **opts)
    g_ent = torch.linspace(-1, 1, 29, dtype=torch.float64)
    ((logp * p.grad.to(DEV, logp.dtype)).sum() + (ent * g_ent.to(DEV, ent.dtype)).sum()).backward()
    r_logp, r_ent, ref = reference_log_probs(p.hidden, p.weight, p.target, p.bias, g_logp=p.grad, g_ent=g_ent,
                                             **opts)
    _check((("log p", logp, r_logp), ("entropy", ent, r_ent), ("dX", h.grad, ref.dhidden),
            ("dW", w.grad, ref.dweight), ("db", b.grad, ref.dbias)), tol)


def test_scale_equals_scaled_weights():
    """Without a soft cap, ``logit_scale=s`` is the loss of the weight and bias times s (a second route to the
    same number, independent of the oracle)."""
    p = make_problem(13, 8, 30, dtype=torch.float64, bias=True, seed=3)
    got = vpce.linear_cross_entropy(p.hidden, p.weight, p.target, p.bias, logit_scale=SCALE, label_smoothing=0.1)
    want = vpce.linear_cross_entropy(p.hidden, p.weight * SCALE, p.target, p.bias * SCALE, label_smoothing=0.1)
    assert rel_err(got, want) < 1e-14


@pytest.mark.parametrize("value,exc,words", [
    (0.0, ValueError, ["logit_scale", "> 0.0", "0.0"]),
    (-2.0, ValueError, ["logit_scale", "> 0.0", "-2.0"]),
    (math.inf, ValueError, ["logit_scale", "finite", "inf"]),
    (math.nan, ValueError, ["logit_scale", "NaN"]),
    ("2", TypeError, ["logit_scale", "real number", "str"]),
])
def test_bad_scale_is_named(value, exc, words):
    p = make_problem(6, 8, 20)
    for call in (vpce.linear_cross_entropy, vpce.linear_log_probs):
        with pytest.raises(exc) as info:
            call(p.hidden, p.weight, p.target, logit_scale=value)
        assert all(w in str(info.value) for w in words), (words, str(info.value))
    with pytest.raises(exc):
        vpce.LinearCrossEntropy(logit_scale=value)
