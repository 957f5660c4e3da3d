"""``class_weight``: per-class loss weights with ``torch.nn.functional.cross_entropy(weight=...)``'s semantics
(label smoothing included), on both backends and routes, sharded on gloo ranks, against the float64 oracle.

The oracle writes torch's definition out (``vpce.reference``); ``test_oracle_is_torchs_definition`` holds it to
torch's own ``F.cross_entropy`` in float64. The torch backend runs in float64 (tight bounds), the Triton one
through the CPU interpreter where there is no CUDA (fp32).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import vpce
from distributed import run_ranks
from problems import leaf, make_problem
from test_confident_tokens import confident_problem
from vpce.reference import reference, rel_err, torch_eager

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BACKENDS = [("torch", torch.float64, 1e-12), ("triton", torch.float32, 2e-5)]
OPTIONS = {
    "plain": {},
    "smooth": {"label_smoothing": 0.2},
    "all": {"label_smoothing": 0.3, "z_loss": 1e-2, "softcap": 4.0, "logit_scale": 1.7},
}


def class_weights(rows: int, seed: int = 0) -> torch.Tensor:
    """In [0, 2), with a few zeros (classes switched off)."""
    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(rows, generator=gen, dtype=torch.float64) * 2
    w[::7] = 0
    return w


def _errors(pairs):
    return {name: rel_err(got, want) for name, got, want in pairs}


@pytest.mark.parametrize("eps", [0.0, 0.3, 1.0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_oracle_is_torchs_definition(eps, reduction):
    """The oracle's class-weighted loss and gradients are torch's own ``F.cross_entropy(weight=...)``'s."""
    p = make_problem(31, 12, 53, dtype=torch.float64, bias=True, ignore_frac=0.3, reduction=reduction, seed=4)
    cw = class_weights(53)
    ref = reference(p.hidden, p.weight, p.target, p.bias, grad=p.grad, reduction=reduction, label_smoothing=eps,
                    class_weight=cw)
    h, w, b = leaf(p.hidden), leaf(p.weight), leaf(p.bias)
    loss = F.cross_entropy(F.linear(h, w, b), p.target, weight=cw, label_smoothing=eps, reduction=reduction)
    (loss * p.grad).sum().backward()
    errs = _errors((("loss", loss, ref.loss), ("dX", h.grad, ref.dhidden), ("dW", w.grad, ref.dweight),
                    ("db", b.grad, ref.dbias)))
    assert max(errs.values()) < 1e-13, errs


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("reduction,budget", [("mean", "auto"), ("sum", "auto"), ("none", "auto"),
                                              ("mean", "lean")])
@pytest.mark.parametrize("variant", list(OPTIONS))
def test_matches_oracle(backend, dtype, tol, reduction, budget, variant):
    """Padded vocab (rows past vocab_size and their weights ignored), a bias, 20 % ignored tokens."""
    p = make_problem((5, 7), 16, 70, dtype=dtype, vocab_size=66, bias=True, ignore_frac=0.2, reduction=reduction,
                     seed=1)
    cw = class_weights(70)
    h, w, b = (leaf(x.to(DEV)) for x in (p.hidden, p.weight, p.bias))
    loss = vpce.linear_cross_entropy(h, w, p.target.to(DEV), b, backend=backend, reduction=reduction,
                                     memory_budget=budget, vocab_size=66, class_weight=cw.to(DEV, dtype),
                                     **OPTIONS[variant])
    (loss * p.grad.to(DEV, loss.dtype)).sum().backward()
    ref = reference(p.hidden, p.weight, p.target, p.bias, grad=p.grad, reduction=reduction, vocab_size=66,
                    class_weight=cw, **OPTIONS[variant])
    errs = _errors((("loss", loss, ref.loss), ("dX", h.grad, ref.dhidden), ("dW", w.grad, ref.dweight),
                    ("db", b.grad, ref.dbias)))
    assert max(errs.values()) <= tol, errs
    unweighted = reference(p.hidden, p.weight, p.target, p.bias, grad=p.grad, reduction=reduction, vocab_size=66,
                           **OPTIONS[variant])
    assert rel_err(unweighted.dhidden, ref.dhidden) > 1e3 * tol, "the weights hardly change dX: weak test"


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_with_token_weight(backend, dtype, tol):
    """Token and class weights multiply: each token's loss by ``tw_n``, and ``mean`` divides by the sum of
    ``tw_n w_{t_n}``."""
    p = make_problem(23, 16, 64, dtype=dtype, ignore_frac=0.2, seed=2)  # 64 rows: whole tiles (EVEN_N)
    cw = class_weights(64, 1)
    tw = torch.rand(23, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 2
    h, w = leaf(p.hidden.to(DEV)), leaf(p.weight.to(DEV))
    loss = vpce.linear_cross_entropy(h, w, p.target.to(DEV), backend=backend, label_smoothing=0.1,
                                     token_weight=tw.to(DEV, dtype), class_weight=cw.to(DEV, dtype))
    loss.backward()
    ref = reference(p.hidden, p.weight, p.target, label_smoothing=0.1, token_weight=tw, class_weight=cw)
    errs = _errors((("loss", loss, ref.loss), ("dX", h.grad, ref.dhidden), ("dW", w.grad, ref.dweight)))
    assert max(errs.values()) <= tol, errs


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("budget", ["auto", "lean"])
def test_bf16_on_gpu_no_worse_than_torch(budget):
    """bf16 Triton at a size with several tiles, chunks and (lean) vocab blocks, class weights with smoothing, soft
    cap and logit scale: errors against float64 no worse than torch's own bf16 ``F.linear`` + fp32
    ``cross_entropy(weight=...)``."""
    opts = dict(label_smoothing=0.1, softcap=30.0, logit_scale=0.8, z_loss=1e-4)
    p = make_problem(8192, 256, 32000, dtype=torch.bfloat16, vocab_size=31990, ignore_frac=0.1, seed=8)
    cw = class_weights(32000, 9)
    h, w = leaf(p.hidden.cuda()), leaf(p.weight.cuda())
    loss = vpce.linear_cross_entropy(h, w, p.target.cuda(), vocab_size=31990, memory_budget=budget,
                                     class_weight=cw.cuda().float(), **opts)
    loss.backward()
    ref = reference(p.hidden, p.weight, p.target, vocab_size=31990, class_weight=cw, **opts)
    own = torch_eager(p.hidden.cuda(), p.weight.cuda(), p.target.cuda(), vocab_size=31990, class_weight=cw,
                      **opts)
    for name, mine, theirs, want in (("loss", loss, own.loss, ref.loss), ("dX", h.grad, own.dhidden, ref.dhidden),
                                     ("dW", w.grad, own.dweight, ref.dweight)):
        a, b = rel_err(mine, want), rel_err(theirs, want)
        assert a <= 1.2 * b + 1e-5, f"{name}: rel err {a:.2e} > 1.2 x torch's {b:.2e}"


def test_without_smoothing_class_weight_is_a_token_weight():
    """Without label smoothing, ``class_weight=w`` is ``token_weight=w[target]`` (the z-loss included): the
    interplay documented in docs/api.md."""
    p = make_problem(19, 8, 30, dtype=torch.float64, ignore_frac=0.2, seed=5)
    cw = class_weights(30, 2)
    tw = cw[p.target.clamp(min=0)]
    got = vpce.linear_cross_entropy(p.hidden, p.weight, p.target, z_loss=1e-2, class_weight=cw)
    want = vpce.linear_cross_entropy(p.hidden, p.weight, p.target, z_loss=1e-2, token_weight=tw)
    assert rel_err(got, want) < 1e-14


@pytest.mark.parametrize("backend,dtype", [("torch", torch.float32), ("triton", torch.float32)])
def test_confident_tokens(backend, dtype):
    """Target probability 1 - 1e-5: per-token loss and gradients no worse than 2x torch's own fp32
    ``F.cross_entropy(weight=...)`` against float64."""
    h, w, t, grad = confident_problem(48, 72, 61, 1e-5, dtype)
    cw = class_weights(61, 3) + 0.5
    hl, wl = leaf(h.to(DEV)), leaf(w.to(DEV))
    out = vpce.linear_cross_entropy(hl, wl, t.to(DEV), reduction="none", backend=backend,
                                    class_weight=cw.to(DEV, dtype))
    (out * grad.to(DEV, out.dtype)).sum().backward()
    ref = reference(h, w, t, reduction="none", grad=grad, class_weight=cw)
    th, tw_ = leaf(h.to(DEV)), leaf(w.to(DEV))
    own = F.cross_entropy(F.linear(th, tw_).float(), t.to(DEV), weight=cw.to(DEV, torch.float32), reduction="none")
    (own * grad.to(DEV, own.dtype)).sum().backward()
    for name, a, b, want in (("loss", out, own, ref.loss), ("dX", hl.grad, th.grad, ref.dhidden),
                             ("dW", wl.grad, tw_.grad, ref.dweight)):
        mine, theirs = rel_err(a, want), rel_err(b, want)
        assert mine <= 2 * theirs + 1e-6, f"{name}: rel err {mine:.2e} > 2 x torch's {theirs:.2e}"


def test_zero_total_weight_gives_zero_not_nan():
    """Documented difference: torch's ``mean`` over targets whose weights sum to 0 is NaN; vpce's is 0 with zero
    gradients (as with every token ignored)."""
    p = make_problem(9, 8, 20, seed=6)
    cw = torch.ones(20)
    cw[p.target] = 0
    h, w = leaf(p.hidden), leaf(p.weight)
    loss = vpce.linear_cross_entropy(h, w, p.target, class_weight=cw)
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0
    assert torch.isnan(F.cross_entropy(p.hidden @ p.weight.T, p.target, weight=cw))


@pytest.mark.parametrize("value,exc,words", [
    (torch.ones(19), ValueError, ["class_weight", "(20,)", "(19,)"]),
    (torch.ones(20, dtype=torch.int64), TypeError, ["class_weight", "floating", "int64"]),
    (torch.ones(20, requires_grad=True), ValueError, ["class_weight", "requires_grad=True"]),
    (torch.ones(20, device="meta"), ValueError, ["class_weight", "device cpu", "meta"]),
    ([1.0] * 20, TypeError, ["class_weight", "Tensor", "list"]),
])
def test_bad_class_weight_is_named(value, exc, words):
    p = make_problem(6, 8, 20)
    with pytest.raises(exc) as info:
        vpce.linear_cross_entropy(p.hidden, p.weight, p.target, class_weight=value)
    assert all(w in str(info.value) for w in words), (words, str(info.value))


# -- vocab parallel on gloo ranks ----------------------------------------------------------------------------------

SHARDS = {2: [31, 26], 4: [23, 30, 22, 20]}  # the last rank's rows are all padding at world 4
VOCAB = {2: 53, 4: 72}


def _sharded_main(rank, world, backends):
    sizes, vocab = SHARDS[world], VOCAB[world]
    rows = sum(sizes)
    start = sum(sizes[:rank])
    cw_full = class_weights(rows, 7)
    out = []
    for backend in backends:
        dtype = torch.float64 if backend == "torch" else torch.float32
        for name, sp, opts in (("mean-smooth", False, dict(label_smoothing=0.2)),
                               ("sp-none-all", True, dict(reduction="none", **OPTIONS["all"]))):
            red = opts.get("reduction", "mean")
            p = make_problem((3 * world, 2), 16, rows, dtype=dtype, vocab_size=vocab, bias=True, ignore_frac=0.2,
                             reduction=red, seed=11)
            h = leaf(p.hidden[rank * 3:(rank + 1) * 3] if sp else p.hidden)
            w, b = leaf(p.weight[start:start + sizes[rank]]), leaf(p.bias[start:start + sizes[rank]])
            loss = vpce.linear_cross_entropy(h, w, p.target, b, group=dist.group.WORLD, sequence_parallel=sp,
                                             vocab_size=vocab, backend=backend,
                                             class_weight=cw_full[start:start + sizes[rank]].to(dtype), **opts)
            (loss * p.grad.to(loss.dtype)).sum().backward()
            oracle = {k: v for k, v in opts.items() if k != "memory_budget"}
            ref = reference(p.hidden, p.weight, p.target, p.bias, grad=p.grad, vocab_size=vocab,
                            class_weight=cw_full, **oracle)
            want_dx = ref.dhidden[rank * 3:(rank + 1) * 3] if sp else ref.dhidden
            mine = slice(start, start + sizes[rank])
            out.append((backend, name, max(rel_err(loss, ref.loss), rel_err(h.grad, want_dx),
                                           rel_err(w.grad, ref.dweight[mine]), rel_err(b.grad, ref.dbias[mine]))))
    return out


@pytest.mark.skipif(CUDA, reason="gloo ranks on the CPU (the Triton kernels through the interpreter)")
@pytest.mark.parametrize("world", [2, 4])
def test_vocab_parallel(world):
    """Uneven shards, padded vocab (at 4 ranks one rank holds only padding), replicated hidden states on the fast
    route and sequence-parallel ones on the lean route (``none``) with smoothing, z-loss, soft cap and logit scale:
    every rank's loss, dX and own dW/db rows equal the oracle's on the whole vocab, on both backends."""
    backends = ("torch", "triton")
    tol = {"torch": 1e-11, "triton": 2e-5}
    for rank, res in enumerate(run_ranks(_sharded_main, world, backends, timeout=240)):
        for backend, name, err in res:
            assert err <= tol[backend], f"rank {rank} {backend} {name}: rel err {err:.2e}"
