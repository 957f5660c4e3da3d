"""The distillation's Triton backend (``vpce.backends.triton.distill_forward``) against the float64 oracle and the
torch backend.

Without CUDA the kernels run through Triton's CPU interpreter (``conftest`` sets ``TRITON_INTERPRET=1``): fp32 and
fp16 on tiny odd shapes with several 32-column vocab tiles and a ragged last tile, several token chunks with a
one-token last one, every divergence and option, both routes and both orders of the lean backward. fp32 must be
within 1e-5 (loss) / 2e-5 (gradients) of float64 and no worse than the torch backend's own fp32 error by more than
rounding. With CUDA the same tests run on the GPU, plus bf16 at a larger shape against torch eager's errors on the
same inputs. (Sharded: ``test_distillation_tp.py``.)
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

import vpce
from problems import leaf
from test_distillation import errors, make_pair, oracle
from vpce.reference import reference_distillation, rel_err

triton = pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")

DIVERGENCES = [("forward_kl", None), ("reverse_kl", None), ("jsd", 0.5), ("jsd", 0.0), ("jsd", 1.0)]
DIV_IDS = ["fkl", "rkl", "jsd0.5", "jsd-beta0", "jsd-beta1"]
VARIANTS = {
    "plain": {},
    "all": {"temperature": 1.7, "temperature_squared": True, "softcap": 3.0, "teacher_softcap": 5.0, "bias": True,
            "ce_weight": 0.3, "token_weight": True},
    "ce-cap": {"ce_weight": 0.5, "softcap": 4.0, "bias": True},  # the cross-entropy sharing the student's tiles
    "no-target": {"no_target": True, "temperature": 0.8},
}
# 33 tokens over 97 real vocab rows (of 101): 4 vocab tiles of 32 columns (the last with one) under the interpreter;
# with BUDGET 32 tokens per chunk (2 chunks, the last of one token) and 64-column blocks in the lean backward
SHAPE = dict(n=(3, 11), d_s=13, d_t=19, rows=101, vocab_size=97)
BUDGET = 2.35e-5


def to_dev(x) -> SimpleNamespace:
    return SimpleNamespace(**{k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in vars(x).items()})


def run(x, backend="triton", **opts):
    """``linear_distillation_loss`` on ``DEV`` and backward with ``x.grad``: (loss, dX, dW, db) on the CPU."""
    g = to_dev(x)
    h, w, b = leaf(g.hidden), leaf(g.weight), leaf(g.bias)
    target = opts.pop("target", g.target)
    opts = {k: v.to(DEV) if isinstance(v, torch.Tensor) else v for k, v in opts.items()}
    loss = vpce.linear_distillation_loss(h, w, g.t_hidden, g.t_weight, target, b, g.t_bias, backend=backend,
                                         vocab_size=x.vocab_size, **opts)
    (loss * g.grad.to(loss.dtype)).sum().backward()
    return tuple(None if t is None else t.cpu() for t in (loss, h.grad, w.grad, None if b is None else b.grad))


def options(x, variant: dict, **opts) -> dict:
    out = {k: v for k, v in variant.items() if k not in ("bias", "token_weight", "no_target")}
    if variant.get("token_weight"):
        out["token_weight"] = x.token_weight
    if variant.get("no_target"):
        out["target"] = None
    return {**out, **opts}


def check_fp32(x, **opts):
    """fp32 Triton within 1e-5 / 2e-5 of float64 and within rounding of the torch backend's own error."""
    got = errors(run(x, **opts), oracle(x, **opts))
    torch_errs = errors(run(x, backend="torch", **opts), oracle(x, **opts))
    for name, err in got.items():
        tol = 1e-5 if name == "loss" else 2e-5
        assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e} ({opts})"
        assert err <= 3 * torch_errs[name] + 1e-6, f"{name}: {err:.2e} vs the torch backend's {torch_errs[name]:.2e}"


# every option set for the three kernels' divergences; beta 0 and 1 (the KLs, scaled as the JSD defines them) once
CASES = [(d, b, v) for d, b in DIVERGENCES[:3] for v in VARIANTS] + [(d, b, "all") for d, b in DIVERGENCES[3:]]
CASE_IDS = [f"{i}-{v}" for i, (_, _, v) in zip([i for i in DIV_IDS[:3] for _ in VARIANTS] + DIV_IDS[3:], CASES)]


@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("divergence,beta,variant", CASES, ids=CASE_IDS)
def test_matches_oracle(divergence, beta, variant, reduction):
    """fp32, 20 % of tokens ignored; ``mean`` takes the fast route (2 chunks), ``none`` the lean one with a random
    upstream gradient per token (2 chunks forward, 2 vocab blocks backward)."""
    v = VARIANTS[variant]
    x = make_pair(SHAPE["n"], SHAPE["d_s"], SHAPE["d_t"], SHAPE["rows"], vocab_size=SHAPE["vocab_size"],
                  dtype=torch.float32, bias=v.get("bias", False), reduction=reduction, scale=3.0,
                  seed=len(variant) + 7 * len(reduction))
    check_fp32(x, **options(x, v, divergence=divergence, beta=beta, reduction=reduction, memory_budget=BUDGET))


@pytest.mark.parametrize("divergence,beta", DIVERGENCES[:3], ids=DIV_IDS[:3])
def test_sum_and_lean_mean(divergence, beta):
    """``sum`` on the fast route with the default chunk (one), and ``mean`` on the lean route."""
    x = make_pair(SHAPE["n"], SHAPE["d_s"], SHAPE["d_t"], SHAPE["rows"], vocab_size=SHAPE["vocab_size"],
                  dtype=torch.float32, bias=True, scale=3.0, seed=3)
    opts = options(x, VARIANTS["all"], divergence=divergence, beta=beta)
    check_fp32(x, reduction="sum", **opts)
    check_fp32(x, reduction="mean", memory_budget="lean", **opts)


@pytest.mark.parametrize("budget", [1e-5, "lean"], ids=["vocab-blocks", "whole-vocab"])
def test_lean_token_major(budget, sizing):
    """More tokens than vocab rows: the lean backward walks token blocks (22 tokens each here), with the vocab in
    two blocks (dX summed in an fp32 block accumulator) or in one (dX in one GEMM)."""
    sizing(lean_token_block=22)
    x = make_pair(50, 9, 14, 45, vocab_size=43, dtype=torch.float32, bias=True, reduction="none", scale=3.0, seed=4)
    check_fp32(x, divergence="jsd", beta=0.3, reduction="none", ce_weight=0.2, softcap=4.0, temperature=1.3,
               memory_budget=budget)


def test_fp16_no_worse_than_torch():
    """fp16 logits buffers and an fp16 gradient (the route the GPU runs in bf16): errors no worse than plain torch's
    in fp16 on the same inputs (``F.linear`` in fp16, fp32 loss, autograd)."""
    x = make_pair(40, 32, 48, 157, dtype=torch.float16, scale=2.0, seed=1)
    for divergence, beta in DIVERGENCES[:3]:
        opts = dict(divergence=divergence, beta=beta, temperature=1.3, ce_weight=0.2)
        ours = errors(run(x, **opts), oracle(x, **opts))
        eager = oracle(x, dtype=torch.float16, **opts)
        theirs = errors((eager.loss, eager.dhidden, eager.dweight, None), oracle(x, **opts))
        for name in ours:
            assert ours[name] <= 1.5 * theirs[name] + 3e-7, \
                f"{divergence} {name}: {ours[name]:.2e} vs torch's {theirs[name]:.2e}"


def test_confident_logits():
    """Peaked softmaxes (logit spread 30) on both heads with the cross-entropy term: within 2e-5 and no worse than
    the torch backend beyond rounding."""
    x = make_pair(24, 16, 24, 70, dtype=torch.float32, scale=30.0, seed=2)
    for divergence, beta in DIVERGENCES[:3]:
        check_fp32(x, divergence=divergence, beta=beta, ce_weight=0.3)


@pytest.mark.parametrize("kl", [0, 1, 2])
def test_combined_heads_equal_the_torch_combine(kl):
    """``kernels.combine_distill_heads`` (one launch) against ``vpce.formulas.distill``' torch ops, on 1-3 ranks: random
    statistics, a rank whose rows are all padding (max -inf), a row NaN on one rank (NaN out), a poison scalar."""
    from vpce import kernels
    from vpce.formulas.distill import _combine_heads

    gen = torch.Generator().manual_seed(kl)
    for world in (1, 3):
        r, c = 5, 37
        every = torch.randn(world, r, c, generator=gen) * 4
        every[:, (1, 3)] = every[:, (1, 3)].abs() + 0.5  # sums of exp
        if world > 1:
            every[1, (0, 2)] = -math.inf  # an all-padding shard: max -inf, sums 0
            every[1, (1, 3, 4)] = 0.0
        every[0, 2, 7] = math.nan
        for poison in (None, torch.zeros(()), torch.full((), math.nan)):
            want = _combine_heads(every, kl=kl, poison=poison)
            got = kernels.combine_distill_heads(every.to(DEV), kl=kl, poison=None if poison is None else poison.to(DEV))
            for i, (g, w) in enumerate(zip(got, want)):
                if w is None:
                    assert g is None, (world, i)
                    continue
                g = g.cpu()
                assert torch.equal(torch.isnan(g), torch.isnan(w)), f"world={world} kl={kl} out {i}: NaN pattern"
                fin = ~torch.isnan(w)
                assert torch.allclose(g[fin], w[fin], rtol=2e-6, atol=1e-6), f"world={world} kl={kl} out {i}"


def test_edge_cases():
    """Empty batch and every token ignored (0 with zero gradients), a teacher bias of -inf on some columns (finite
    and exact), NaN in the teacher (propagates), bitwise-equal reruns, no-grad equal to the loss with grad."""
    for n, frac, red in ((0, 0.0, "mean"), (0, 0.0, "none"), (6, 1.0, "mean"), (6, 1.0, "none")):
        x = make_pair(n, 5, 7, 37, dtype=torch.float32, ignore_frac=frac, reduction=red, seed=5)
        loss, dx, dw, _ = run(x, divergence="jsd", reduction=red, ce_weight=0.5)
        assert loss.shape == ((n,) if red == "none" else ()), (n, red)
        assert (loss == 0).all() and (dx == 0).all() and (dw == 0).all(), (n, red)

    x = make_pair(20, 6, 5, 70, dtype=torch.float32, bias=True, seed=6)
    x.t_bias[::3] = -math.inf
    for divergence, beta in (("forward_kl", None), ("jsd", 0.5)):
        opts = dict(divergence=divergence, beta=beta)
        got = run(x, **opts)
        assert torch.isfinite(got[0]), divergence
        for name, err in errors(got, oracle(x, **opts)).items():
            assert err <= 2e-5, f"masked teacher {divergence}: {name} rel err {err:.2e}"

    x = make_pair(20, 6, 5, 70, dtype=torch.float32, seed=7)
    first = run(x, divergence="jsd", ce_weight=0.2, memory_budget=BUDGET)
    again = run(x, divergence="jsd", ce_weight=0.2, memory_budget=BUDGET)
    assert all(torch.equal(a, b) for a, b in zip(first[:3], again[:3])), "reruns differ"
    g = to_dev(x)
    with torch.no_grad():
        plain = vpce.linear_distillation_loss(g.hidden, g.weight, g.t_hidden, g.t_weight, g.target,
                                              divergence="jsd", ce_weight=0.2, backend="triton", memory_budget=BUDGET)
    assert plain.grad_fn is None and torch.equal(plain.cpu(), first[0])

    x.t_weight[2, 1] = math.nan
    for divergence in ("forward_kl", "jsd"):
        loss, dx, *_ = run(x, divergence=divergence)
        assert torch.isnan(loss) and torch.isnan(dx).any(), divergence


# ------------------------------------------------------------------------------------------------------------
# GPU: bf16 at a larger shape, against torch eager on the same inputs


@gpu_only
@pytest.mark.parametrize("divergence,beta", DIVERGENCES[:3], ids=DIV_IDS[:3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cuda_bf16_no_worse_than_torch(divergence, beta, reduction):
    """bf16, several chunks and ragged tiles (V = 8000 - 37 real rows): loss within 1e-5 of float64 where torch's
    is, gradients no worse than torch eager's (``F.linear`` in bf16, fp32 loss, autograd) by more than 1.5x;
    bitwise-equal reruns; the peak extra memory well under one fp32
    ``[N, V]`` logits tensor."""
    from vpce.memory import PeakMemory

    x = make_pair(2048, 256, 384, 8000, vocab_size=8000 - 37, dtype=torch.bfloat16, bias=True, scale=4.0,
                  reduction=reduction, seed=14)
    opts = dict(divergence=divergence, beta=beta, reduction=reduction, temperature=1.5, ce_weight=0.1,
                softcap=30.0, memory_budget=0.01)
    with PeakMemory("cuda") as pm:
        got = run(x, backend="triton", **opts)
    again = run(x, backend="triton", **opts)
    assert all(torch.equal(a, b) for a, b in zip(got, again) if a is not None), "reruns differ"
    ref = oracle(x, **opts)
    g = to_dev(x)
    eager = reference_distillation(g.hidden, g.weight, g.t_hidden, g.t_weight, g.target, g.bias, g.t_bias,
                                   grad=g.grad, vocab_size=x.vocab_size, dtype=torch.bfloat16,
                                   **{k: v for k, v in opts.items() if k != "memory_budget"})
    ours = errors(got, ref)
    theirs = errors((eager.loss, eager.dhidden, eager.dweight, eager.dbias), ref)
    for name in ours:
        assert ours[name] <= 1.5 * theirs[name] + 1e-6, f"{name}: {ours[name]:.2e} vs torch's {theirs[name]:.2e}"
    logits_bytes = 2048 * 8000 * 4
    assert pm.peak < logits_bytes, f"peak extra {pm.peak / 2**20:.1f} MiB >= one fp32 logits tensor"


@gpu_only
@pytest.mark.parametrize("divergence,beta", DIVERGENCES[:3], ids=DIV_IDS[:3])
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("variant", ["plain", "options"])
def test_cuda_bf16_arithmetic_on_the_same_logits(divergence, beta, reduction, variant):
    """vpce's own arithmetic, apart from the logits' GEMM: its loss is within fp32's resolution of float64 math on
    the bf16 logits cuBLAS writes (``F.linear``, the bias in its epilogue), 5e-7 (a few ulps of the fp32 sums; the
    JSD with ``log m`` taken directly was 1.5e-6 off), or no further than torch eager's loss on those logits.
    Against float64 of the exact inputs both inherit the GEMM's error, mostly the tensor cores' accumulation
    (docs/benchmarks.md, run 2b1e21c), which this separates out. The float64 math on given logits is the oracle
    with the logits as the hidden states and an identity head (every logit one exact product). One H200: vpce
    1e-9 to 2.6e-7, torch eager 1e-9 to 1.3e-7 here (V = 7963; at V = 128256 torch eager's error is the
    larger)."""
    x = make_pair(2048, 256, 384, 8000, vocab_size=8000 - 37, dtype=torch.bfloat16, bias=True, scale=4.0,
                  reduction=reduction, seed=15)
    opts = dict(divergence=divergence, beta=beta, reduction=reduction)
    if variant == "options":
        opts.update(temperature=1.5, ce_weight=0.1, softcap=30.0, teacher_softcap=20.0, token_weight=x.token_weight)
    got = run(x, backend="triton", memory_budget=0.01, **opts)[0]
    g, v = to_dev(x), x.vocab_size
    logits = [torch.nn.functional.linear(h, w[:v], b[:v]).double()
              for h, w, b in ((g.hidden, g.weight, g.bias), (g.t_hidden, g.t_weight, g.t_bias))]
    eye = torch.eye(v, dtype=torch.float64, device=DEV)
    dev_opts = {k: t.to(DEV) if isinstance(t, torch.Tensor) else t for k, t in opts.items()}
    on_logits = reference_distillation(logits[0], eye, logits[1], eye, g.target, grad=g.grad, **dev_opts).loss
    eager = reference_distillation(g.hidden, g.weight, g.t_hidden, g.t_weight, g.target, g.bias, g.t_bias,
                                   grad=g.grad, vocab_size=v, dtype=torch.bfloat16, **dev_opts).loss
    ours, theirs = rel_err(got, on_logits), rel_err(eager, on_logits)
    print(f"{divergence} {reduction} {variant}: vpce {ours:.2e}, torch eager {theirs:.2e} from float64 on the "
          f"same logits")
    assert ours <= max(theirs, 5e-7), f"vpce {ours:.2e} vs torch eager {theirs:.2e} from float64 on the same logits"


@gpu_only
def test_cuda_int64_offsets():
    """A chunk whose ``[C, V]`` logits pass 2**31 elements (bf16: 4 GiB per head): the kernels' offsets are
    int64. Checked against the torch backend on the last tokens' loss."""
    free, _ = torch.cuda.mem_get_info()
    n, d, v = 16640, 64, 131072  # 2.18e9 logits per head
    if free < 3 * n * v * 2:
        pytest.skip("needs about 13 GiB of free GPU memory")
    x = make_pair(n, d, d, v, dtype=torch.bfloat16, reduction="none", seed=16)
    g = to_dev(x)
    with torch.no_grad():
        got = vpce.linear_distillation_loss(g.hidden, g.weight, g.t_hidden, g.t_weight, g.target, reduction="none",
                                            divergence="jsd", backend="triton", memory_budget=9.0)
    tail = slice(n - 64, n)
    want = vpce.linear_distillation_loss(g.hidden[tail], g.weight, g.t_hidden[tail], g.t_weight, g.target[tail],
                                         reduction="none", divergence="jsd", backend="torch")
    assert rel_err(got[tail], want) < 1e-2, f"tail rows: rel err {rel_err(got[tail], want):.2e}"
