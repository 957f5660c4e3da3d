"""vpce.linear_distillation_loss on one process: every divergence and option against the float64 oracle
(``vpce.reference.reference_distillation``), the oracle against TRL's and Liger's published definitions, 16-bit
and fp32 errors against what plain torch gets in the same dtype, and the contract (errors, no teacher gradient,
empty batches, routes, determinism)."""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import vpce
from problems import leaf
from vpce.reference import distillation_per_token, reference_distillation, rel_err

DIVERGENCES = [("forward_kl", None), ("reverse_kl", None), ("jsd", 0.5), ("jsd", 0.2), ("jsd", 0.0), ("jsd", 1.0)]
DIV_IDS = ["fkl", "rkl", "jsd0.5", "jsd0.2", "jsd-beta0", "jsd-beta1"]
VARIANTS = {
    "plain": {},
    "temperature": {"temperature": 2.0, "temperature_squared": True},
    "caps-bias": {"softcap": 3.0, "teacher_softcap": 5.0, "bias": True},
    "ce-mix": {"ce_weight": 0.3, "temperature": 0.7},
    "token-weight": {"token_weight": True},
    "no-target": {"no_target": True},
}


def make_pair(n, d_s, d_t, rows, *, dtype=torch.float64, vocab_size=None, bias=False, ignore_frac=0.2, scale=1.0,
              teacher_scale=None, reduction="mean", seed=0):
    """Student and teacher heads over the same ``rows`` (``vocab_size`` real), targets with a fraction ignored,
    token weights and an upstream gradient (per token for ``none``)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (n,) if isinstance(n, int) else tuple(n)
    v = rows if vocab_size is None else vocab_size
    f64 = dict(generator=gen, dtype=torch.float64)
    ts = scale if teacher_scale is None else teacher_scale
    x = SimpleNamespace(
        hidden=torch.randn(*shape, d_s, **f64), weight=torch.randn(rows, d_s, **f64) * (scale / d_s**0.5),
        t_hidden=torch.randn(*shape, d_t, **f64), t_weight=torch.randn(rows, d_t, **f64) * (ts / d_t**0.5),
        bias=torch.randn(rows, **f64) if bias else None, t_bias=torch.randn(rows, **f64) if bias else None)
    target = torch.randint(0, v, shape, generator=gen)
    drop = torch.rand(shape, generator=gen) < ignore_frac
    x.target = torch.where(drop, torch.full_like(target, -100), target)
    x.token_weight = torch.rand(shape, **f64) + 0.5
    x.grad = torch.randn(shape, **f64) if reduction == "none" else torch.randn((), **f64) + 2.0
    for name in ("hidden", "weight", "t_hidden", "t_weight", "bias", "t_bias"):
        t = getattr(x, name)
        setattr(x, name, None if t is None else t.to(dtype))
    x.vocab_size = v
    return x


def run(x, *, backward=True, **opts):
    """vpce's loss and gradients on leaf copies of ``x``: (loss, dX, dW, db)."""
    h, w, b = leaf(x.hidden), leaf(x.weight), leaf(x.bias)
    loss = vpce.linear_distillation_loss(h, w, x.t_hidden, x.t_weight, opts.pop("target", x.target), b, x.t_bias,
                                         vocab_size=x.vocab_size, **opts)
    if backward:
        (loss * x.grad.to(loss.dtype)).sum().backward()
    return loss, h.grad, w.grad, None if b is None else b.grad


def oracle(x, dtype=torch.float64, **opts):
    opts.pop("memory_budget", None)
    return reference_distillation(x.hidden, x.weight, x.t_hidden, x.t_weight, opts.pop("target", x.target), x.bias,
                                  x.t_bias, grad=x.grad, vocab_size=x.vocab_size, dtype=dtype, **opts)


def errors(got, ref) -> dict:
    loss, dx, dw, db = got
    out = {"loss": rel_err(loss, ref.loss), "dX": rel_err(dx, ref.dhidden), "dW": rel_err(dw, ref.dweight)}
    if db is not None:
        out["db"] = rel_err(db, ref.dbias)
    return out


def variant_opts(x, variant: dict) -> dict:
    opts = {k: v for k, v in variant.items() if k not in ("bias", "token_weight", "no_target")}
    if variant.get("token_weight"):
        opts["token_weight"] = x.token_weight
    if variant.get("no_target"):
        opts["target"] = None
    return opts


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("variant", list(VARIANTS), ids=list(VARIANTS))
@pytest.mark.parametrize("divergence,beta", DIVERGENCES, ids=DIV_IDS)
def test_matches_oracle(divergence, beta, variant, reduction):
    """float64 on odd shapes (student D=13, teacher D=19, 40 rows of which 37 are real), 20 % ignored."""
    v = VARIANTS[variant]
    x = make_pair((3, 7), 13, 19, 40, vocab_size=37, bias=v.get("bias", False), reduction=reduction, scale=3.0,
                  seed=len(variant) + 7 * len(reduction))
    opts = dict(divergence=divergence, beta=beta, reduction=reduction, **variant_opts(x, v))
    got = run(x, **opts)
    assert got[0].dtype == torch.float64 and got[0].shape == (() if reduction != "none" else (3, 7))
    for name, err in errors(got, oracle(x, **opts)).items():
        assert err < 1e-11, f"{name}: rel err {err:.2e}"


@pytest.mark.parametrize("divergence,beta", DIVERGENCES[:4], ids=DIV_IDS[:4])
@pytest.mark.parametrize("memory_budget", [1e-7, 2e-5, "lean", "fast"], ids=["1-token-chunks", "few-chunks", "lean",
                                                                            "fast"])
def test_chunks_and_routes(divergence, beta, memory_budget):
    """Chunks of one token, a few chunks, the lean route (recompute) and the fast route all give the oracle."""
    x = make_pair(29, 11, 6, 53, bias=True, seed=5)
    opts = dict(divergence=divergence, beta=beta, ce_weight=0.25, temperature=1.5, softcap=4.0,
                memory_budget=memory_budget)
    for name, err in errors(run(x, **opts), oracle(x, **opts)).items():
        assert err < 1e-11, f"{name}: rel err {err:.2e}"


def test_definitions_match_trl_and_liger():
    """The oracle's per-token divergence equals TRL's ``generalized_jsd_loss`` (``F.kl_div`` on the mixture's
    ``logsumexp``; beta 0 / 1 the forward / reverse KL) and Liger's JSD (``beta P Y + (1 - beta) Q X - M log M``),
    both written from their documented formulas; and vpce's ``mean`` equals TRL's ``batchmean`` over labelled
    tokens."""
    gen = torch.Generator().manual_seed(0)
    zs, zt = torch.randn(9, 31, generator=gen, dtype=torch.float64) * 3, torch.randn(9, 31, generator=gen,
                                                                                      dtype=torch.float64) * 3
    T = 1.7
    s, u = torch.log_softmax(zs / T, -1), torch.log_softmax(zt / T, -1)
    for beta in (0.0, 0.3, 0.5, 1.0):
        if beta == 0:
            trl = F.kl_div(s, u, reduction="none", log_target=True).sum(-1)
        elif beta == 1:
            trl = F.kl_div(u, s, reduction="none", log_target=True).sum(-1)
        else:
            mix = torch.logsumexp(torch.stack([s + math.log(1 - beta), u + math.log(beta)]), dim=0)
            trl = (beta * F.kl_div(mix, u, reduction="none", log_target=True)
                   + (1 - beta) * F.kl_div(mix, s, reduction="none", log_target=True)).sum(-1)
        ours = distillation_per_token(s, u, "jsd", beta)
        assert torch.allclose(ours, trl, rtol=1e-12, atol=1e-14), f"beta={beta}: {ours} vs TRL {trl}"
        if 0 < beta < 1:
            P, Q = u.exp(), s.exp()
            M = beta * P + (1 - beta) * Q
            liger = (beta * P * u + (1 - beta) * Q * s - M * M.log()).sum(-1)
            assert torch.allclose(ours, liger, rtol=1e-12, atol=1e-14), f"beta={beta}: vs Liger {liger}"
    assert torch.allclose(distillation_per_token(s, u, "forward_kl", None), distillation_per_token(s, u, "jsd", 0.0))
    assert torch.allclose(distillation_per_token(s, u, "reverse_kl", None), distillation_per_token(s, u, "jsd", 1.0))

    # vpce end to end against TRL's batchmean on logits it builds itself (labels -100 masked)
    x = make_pair(17, 8, 12, 29, seed=9)
    zs = x.hidden @ x.weight.t()
    zt = x.t_hidden @ x.t_weight.t()
    s, u = torch.log_softmax(zs / T, -1), torch.log_softmax(zt / T, -1)
    mix = torch.logsumexp(torch.stack([s + math.log(1 - 0.4), u + math.log(0.4)]), dim=0)
    jsd = (0.4 * F.kl_div(mix, u, reduction="none", log_target=True)
           + 0.6 * F.kl_div(mix, s, reduction="none", log_target=True)).sum(-1)
    mask = x.target != -100
    trl = jsd[mask].sum() / mask.sum()
    ours = vpce.linear_distillation_loss(x.hidden, x.weight, x.t_hidden, x.t_weight, x.target, divergence="jsd",
                                         beta=0.4, temperature=T)
    assert rel_err(ours, trl) < 1e-12, f"vpce {ours.item()} vs TRL batchmean {trl.item()}"


def _low_precision_errors(dtype, scale, divergence, beta, seed):
    x = make_pair(24, 32, 48, 157, dtype=dtype, bias=False, scale=scale, teacher_scale=scale, seed=seed)
    opts = dict(divergence=divergence, beta=beta, temperature=1.3, ce_weight=0.2)
    ours = errors(run(x, **opts), oracle(x, **opts))
    eager = oracle(x, dtype=dtype, **opts)
    theirs = errors((eager.loss, eager.dhidden, eager.dweight, None), oracle(x, **opts))
    return ours, theirs


@pytest.mark.parametrize("divergence,beta", DIVERGENCES[:3], ids=DIV_IDS[:3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_low_precision_no_worse_than_torch(dtype, divergence, beta):
    """fp32 within 2e-4 of float64; in fp32 and bf16 the errors are no worse than plain torch's (``F.linear`` in
    the dtype, fp32 loss, autograd) on the same inputs (the gradient by at most one rounding step more)."""
    ours, theirs = _low_precision_errors(dtype, 1.0, divergence, beta, seed=1)
    for name in ours:
        if dtype == torch.float32:
            assert ours[name] <= 2e-4, f"{name}: fp32 rel err {ours[name]:.2e}"
        assert ours[name] <= 1.5 * theirs[name] + 3e-7, f"{name}: {ours[name]:.2e} vs torch's {theirs[name]:.2e}"


@pytest.mark.parametrize("divergence,beta", DIVERGENCES[:3], ids=DIV_IDS[:3])
def test_confident_logits(divergence, beta):
    """Peaked softmaxes (logit spread 30) on both heads, fp32: no worse than plain fp32 torch (within 1.5x and
    a few ulps), within 2e-4."""
    ours, theirs = _low_precision_errors(torch.float32, 30.0, divergence, beta, seed=2)
    for name in ours:
        assert ours[name] <= 1.5 * theirs[name] + 3e-7 and ours[name] <= 2e-4, \
            f"{name}: {ours[name]:.2e} vs torch's {theirs[name]:.2e}"


def test_teacher_gets_no_gradient():
    """Teacher tensors that require grad are used detached: no gradient reaches them, nothing else changes."""
    x = make_pair(10, 8, 12, 21, bias=True, seed=3)
    th, tw, tb = leaf(x.t_hidden), leaf(x.t_weight), leaf(x.t_bias)
    h, w = leaf(x.hidden), leaf(x.weight)
    loss = vpce.linear_distillation_loss(h, w, th, tw, x.target, None, tb, divergence="jsd")
    (loss * x.grad).backward()
    assert th.grad is None and tw.grad is None and tb.grad is None
    want = oracle(SimpleNamespace(**{**vars(x), "bias": None}), divergence="jsd")
    assert rel_err(loss, want.loss) < 1e-12 and rel_err(h.grad, want.dhidden) < 1e-11


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_empty_and_all_ignored(reduction):
    """An empty batch gives 0 (``none``: empty); all tokens ignored gives 0 with zero gradients on the graph."""
    for n, frac in ((0, 0.0), (6, 1.0)):
        x = make_pair(n, 5, 7, 11, ignore_frac=frac, reduction=reduction, seed=4)
        loss, dx, dw, _ = run(x, divergence="jsd", reduction=reduction, ce_weight=0.5)
        assert loss.shape == ((n,) if reduction == "none" else ())
        assert (loss == 0).all() and (dx == 0).all() and (dw == 0).all()


def test_second_backward_lean_only_and_no_grad():
    x = make_pair(9, 6, 4, 13, seed=6)
    h, w = leaf(x.hidden), leaf(x.weight)
    loss = vpce.linear_distillation_loss(h, w, x.t_hidden, x.t_weight, x.target)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="memory_budget='lean'"):
        loss.backward()
    h2 = leaf(x.hidden)
    lean = vpce.linear_distillation_loss(h2, x.weight, x.t_hidden, x.t_weight, x.target, memory_budget="lean")
    lean.backward(retain_graph=True)
    once = h2.grad.clone()
    lean.backward()
    assert torch.allclose(h2.grad, 2 * once, rtol=1e-14) and rel_err(once, h.grad) < 1e-13
    with torch.no_grad():
        plain = vpce.linear_distillation_loss(h, w, x.t_hidden, x.t_weight, x.target)
    assert plain.grad_fn is None and plain == loss.detach()


def test_3d_int32_targets_frozen_weight_and_determinism():
    """``[B, S, D]`` inputs with int32 targets, a frozen student weight (only dX), bitwise-equal reruns."""
    x = make_pair((2, 5), 7, 9, 19, dtype=torch.float32, reduction="none", seed=8)
    x.target = x.target.to(torch.int32)
    outs = []
    for _ in range(2):
        h = leaf(x.hidden)
        loss = vpce.linear_distillation_loss(h, x.weight, x.t_hidden, x.t_weight, x.target, divergence="jsd",
                                             reduction="none", ce_weight=0.1, memory_budget=1e-6)
        loss.backward(x.grad.float())
        outs.append((loss, h.grad))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    ref = oracle(x, divergence="jsd", reduction="none", ce_weight=0.1)
    assert rel_err(outs[0][0], ref.loss) < 2e-6 and rel_err(outs[0][1], ref.dhidden) < 2e-5


@pytest.mark.parametrize("divergence,beta", [("forward_kl", None), ("jsd", 0.5)], ids=["fkl", "jsd"])
def test_teacher_masked_columns(divergence, beta):
    """A teacher bias of -inf on some columns (q = 0 there) gives a finite loss and the exact gradients."""
    x = make_pair(8, 6, 5, 23, bias=True, seed=10)
    x.t_bias[::3] = -math.inf
    opts = dict(divergence=divergence, beta=beta)
    got = run(x, **opts)
    assert torch.isfinite(got[0])
    for name, err in errors(got, oracle(x, **opts)).items():
        assert err < 1e-11, f"{name}: rel err {err:.2e}"


def test_nan_propagates():
    x = make_pair(6, 4, 4, 9, seed=11)
    x.t_weight[2, 1] = math.nan
    loss, dx, *_ = run(x)
    assert torch.isnan(loss) and torch.isnan(dx).any()


def _call(x, **over):
    args = dict(hidden=x.hidden, weight=x.weight, teacher_hidden=x.t_hidden, teacher_weight=x.t_weight,
                target=x.target)
    args.update({k: v for k, v in over.items() if k in args or k in ("bias", "teacher_bias")})
    opts = {k: v for k, v in over.items() if k not in args and k not in ("bias", "teacher_bias")}
    return vpce.linear_distillation_loss(**args, **opts)


ERRORS = [
    (dict(divergence="kl"), ValueError, ["divergence", "'forward_kl'", "'kl'"]),
    (dict(beta=0.5), ValueError, ["beta", "None", "divergence='forward_kl'"]),
    (dict(divergence="jsd", beta=1.5), ValueError, ["beta", "[0, 1]", "1.5"]),
    (dict(divergence="jsd", beta="x"), TypeError, ["beta", "real number", "str"]),
    (dict(temperature=0.0), ValueError, ["temperature", "> 0.0", "0.0"]),
    (dict(temperature_squared=1), TypeError, ["temperature_squared", "bool", "int"]),
    (dict(ce_weight=1.2), ValueError, ["ce_weight", "[0, 1]", "1.2"]),
    (dict(ce_weight=0.5, target=None), ValueError, ["target", "hard labels", "None"]),
    (dict(reduction="batchmean"), ValueError, ["reduction", "'mean'", "'batchmean'"]),
    (dict(teacher_softcap=-1.0), ValueError, ["teacher_softcap", "> 0.0", "-1.0"]),
    (dict(backend="cuda"), ValueError, ["backend", "'triton'", "'cuda'"]),
    (dict(backend="triton"), TypeError, ["hidden", "backend 'triton'", "torch.float64"]),
    (dict(memory_budget="small"), ValueError, ["memory_budget", "'lean'", "'small'"]),
    (dict(teacher_hidden="h"), TypeError, ["teacher_hidden", "torch.Tensor", "str"]),
    (dict(teacher_weight=torch.zeros(13, 5, dtype=torch.float64)), ValueError,
     ["teacher_weight", "(13, 9)", "(13, 5)"]),
    (dict(teacher_weight=torch.zeros(12, 9, dtype=torch.float64)), ValueError,
     ["teacher_weight", "(13, 9)", "(12, 9)"]),
    (dict(teacher_hidden=torch.zeros(5, 9, dtype=torch.float64)), ValueError,
     ["teacher_hidden", "[6, D_teacher]", "(5, 9)"]),
    (dict(teacher_hidden=torch.zeros(6, 9, dtype=torch.float32)), TypeError,
     ["teacher_hidden", "torch.float64", "torch.float32"]),
    (dict(teacher_bias=torch.zeros(12, dtype=torch.float64)), ValueError, ["teacher_bias", "(13,)", "(12,)"]),
    # the device before the dtype: a teacher on another device is no autocast cast (a CPU teacher under CUDA
    # autocast stays fp32) and its error names the device
    (dict(teacher_hidden=torch.zeros(6, 9, dtype=torch.float32, device="meta")), ValueError,
     ["teacher_hidden", "device cpu", "meta"]),
    (dict(token_weight=torch.ones(5, dtype=torch.float64)), ValueError, ["token_weight", "(6,)", "(5,)"]),
    (dict(target=torch.tensor([0, 1, 2, 3, 4, 13])), ValueError, ["target", "[0, 13)", "13"]),
    (dict(weight=torch.zeros(13, 4, dtype=torch.float64)), ValueError, ["weight", "[V_local, 7]", "(13, 4)"]),
]


@pytest.mark.parametrize("over,exc,words", ERRORS, ids=[", ".join(e[0]) + f"-{i}" for i, e in enumerate(ERRORS)])
def test_errors_name_argument_expected_and_got(over, exc, words):
    if over.get("backend") == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("the Triton backend takes CPU tensors only under the interpreter (else: hidden's device error)")
    x = make_pair(6, 7, 9, 13, ignore_frac=0.0, seed=12)
    with pytest.raises(exc) as info:
        _call(x, **over)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"


def test_autocast_casts_both_heads():
    """Under CPU autocast (bf16), fp32 student and teacher tensors compute as if passed in bf16; the student's
    gradients come back in fp32: dX the bf16 one cast up, dW and db (the fast route's fp32 accumulators, scaled)
    unrounded, the bf16 call's gradients their rounding and no nearer the float64 gradients of the bf16 operands."""
    x = make_pair(7, 6, 10, 17, dtype=torch.float32, bias=True, seed=13)
    bf16 = lambda t: None if t is None else t.to(torch.bfloat16)  # noqa: E731
    opts = dict(divergence="jsd", ce_weight=0.3)
    out = []
    for auto in (True, False):
        cast = (lambda t: t) if auto else bf16
        h, w, b = leaf(cast(x.hidden)), leaf(cast(x.weight)), leaf(cast(x.bias))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=auto):
            loss = vpce.linear_distillation_loss(h, w, cast(x.t_hidden), cast(x.t_weight), x.target, b,
                                                 cast(x.t_bias), **opts)
        loss.backward()
        out.append((loss, h.grad, w.grad, b.grad))
    assert all(g.dtype == torch.float32 for g in out[0][1:]) and torch.equal(out[0][0], out[1][0])
    assert torch.equal(out[0][1], out[1][1].float())
    ref = reference_distillation(*map(bf16, (x.hidden, x.weight, x.t_hidden, x.t_weight)), x.target, bf16(x.bias),
                                 bf16(x.t_bias), **opts)
    for got, want, want64 in zip(out[0][2:], out[1][2:], (ref.dweight, ref.dbias)):
        assert torch.equal(got.bfloat16(), want) and not torch.equal(got, want.float())
        assert rel_err(got, want64) <= rel_err(want, want64), (rel_err(got, want64), rel_err(want, want64))


CUDA = torch.cuda.is_available()


@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("divergence,beta", DIVERGENCES[:3], ids=DIV_IDS[:3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_auto_backend_bf16(divergence, beta, reduction):
    """On CUDA ``backend="auto"`` runs the Triton backend (``test_distillation_triton.py`` has more): bf16 errors no
    worse than plain torch's on the GPU, the logits never held beyond a chunk (peak extra memory well under one
    [N, V] fp32 logits tensor)."""
    from vpce.memory import PeakMemory

    x = make_pair(2048, 256, 384, 8000, dtype=torch.bfloat16, bias=True, scale=4.0, reduction=reduction, seed=14)
    dev = lambda t: None if t is None else t.cuda()  # noqa: E731
    g = SimpleNamespace(**{k: dev(v) if isinstance(v, torch.Tensor) else v for k, v in vars(x).items()})
    opts = dict(divergence=divergence, beta=beta, reduction=reduction, temperature=1.5, ce_weight=0.1,
                memory_budget=0.01)
    with PeakMemory("cuda") as pm:
        got = run(g, **opts)
    ref = oracle(x, **opts)
    ours = errors(got, ref)
    eager = reference_distillation(g.hidden, g.weight, g.t_hidden, g.t_weight, g.target, g.bias, g.t_bias,
                                   grad=g.grad, vocab_size=g.vocab_size, dtype=torch.bfloat16,
                                   **{k: v for k, v in opts.items() if k != "memory_budget"})
    theirs = errors((eager.loss, eager.dhidden, eager.dweight, eager.dbias), ref)
    for name in ours:
        assert ours[name] <= 1.5 * theirs[name] + 1e-6, f"{name}: {ours[name]:.2e} vs torch's {theirs[name]:.2e}"
    logits_bytes = 2048 * 8000 * 4
    assert pm.peak < logits_bytes, f"peak extra {pm.peak / 2**20:.1f} MiB >= one fp32 logits tensor"


def _peak(n, divergence, beta, reduction, d, v, budget):
    from vpce.memory import PeakMemory

    x = make_pair(n, d, d, v, dtype=torch.float32, bias=True, reduction=reduction, seed=n)
    h, w, b = leaf(x.hidden), leaf(x.weight), leaf(x.bias)
    with PeakMemory("cpu") as pm:
        loss = vpce.linear_distillation_loss(h, w, x.t_hidden, x.t_weight, x.target, b, x.t_bias,
                                             divergence=divergence, beta=beta, reduction=reduction, ce_weight=0.1,
                                             memory_budget=budget)
        (loss * x.grad.float()).sum().backward()
    return pm.peak


@pytest.mark.parametrize("divergence,beta,reduction", [("forward_kl", None, "mean"), ("jsd", 0.5, "none")],
                         ids=["fkl-fast", "jsd-lean"])
def test_peak_memory_flat_in_n(divergence, beta, reduction):
    """Forward and backward never hold ``[N, V]``: the peak extra memory (CPU, every storage an operator creates)
    is the chunk budget plus weight-sized terms, and grows by O(D) bytes per token, not O(V)."""
    d, v, budget = 16, 1500, 1.0 / 1024
    ns = (64, 256)
    peaks = [_peak(n, divergence, beta, reduction, d, v, budget) for n in ns]
    weight_terms = 4 * v * d * 4           # dW fp32 accumulator, dW, and slack for one more copy of each
    per_token = 2 * d * 4 + 128            # dX in fp32 and in the input dtype, per-token statistics
    for n, p in zip(ns, peaks):
        bound = weight_terms + 1.5 * budget * 2**30 + n * per_token
        assert p <= bound, f"N={n}: peak {p / 2**20:.2f} MiB > bound {bound / 2**20:.2f} MiB (peaks {peaks})"
    assert peaks[1] < ns[1] * v * 4, f"peak {peaks[1] / 2**20:.2f} MiB >= one head's [N, V] fp32 logits"
    growth = (peaks[1] - peaks[0]) / (ns[1] - ns[0])
    assert growth <= per_token, f"peak grows by {growth:.0f} B/token, more than O(D) ({per_token} B): {peaks}"
