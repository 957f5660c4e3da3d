"""Metrics from the same pass and DFT token scaling, on both backends, against float64 torch on materialized logits.

``linear_cross_entropy(..., return_z_loss, return_token_accuracy, return_entropy, token_scaling)`` and
``linear_log_probs(..., return_top1, return_mean_logits, return_log_sum_sq_probs)``: every value against
``vpce.reference.reference_metrics`` (``torch.argmax`` of float64 logits for accuracy), the loss and gradients
of token scaling against ``vpce.reference.reference(token_scaling=True)``. Accuracy is checked exactly, on
integer-valued problems where ties are everywhere (so ties must go to the lowest global id), and on random
problems with many targets set to the argmax. The sharded cases run on 2-3 gloo ranks with uneven shards, ties
across shard boundaries included, and every rank must return the same bytes.
"""

import pytest
import torch
import torch.distributed as dist

import vpce
from distributed import run_ranks
from problems import VARIANTS, Problem, leaf, make_problem, tie_problem
from vpce.reference import reference, reference_log_probs, reference_metrics, rel_err

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
BACKENDS = [("torch", torch.float64, 1e-12), ("triton", torch.float32, 3e-5)]
ALL = dict(return_z_loss=True, return_token_accuracy=True, return_entropy=True)


def argmax_problem(n, d, rows, *, dtype, seed=0, reduction="mean", vocab_size=None, scale=3.0):
    """A random problem whose targets are the argmax for about half the tokens (accuracy far from 0 and 1)."""
    p = make_problem(n, d, rows, dtype=dtype, bias=True, ignore_frac=0.2, scale=scale, reduction=reduction,
                     seed=seed, vocab_size=vocab_size)
    v = p.vocab_size
    z = p.hidden.double() @ p.weight[:v].double().t() + p.bias[:v].double()
    gen = torch.Generator().manual_seed(seed + 1)
    flip = (torch.rand(p.target.shape, generator=gen) < 0.5) & (p.target != -100)
    p.target = torch.where(flip, z.argmax(-1), p.target)
    return p


def reduce_like_loss(x, keep, reduction):
    if reduction == "mean":
        return x.sum() / max(1, int(keep.sum()))
    return x.sum() if reduction == "sum" else x


def check_metrics(out, p, reduction, tol, **opts):
    """Every asked metric of ``out`` against the float64 oracle, reduced like the loss (unweighted)."""
    want = reference_metrics(p.hidden, p.weight, p.target, p.bias, vocab_size=p.vocab_size,
                             softcap=opts.get("softcap"), z_loss=opts.get("z_loss", 0.0))
    keep = p.target != -100
    for field, key in (("z_loss", "z_loss"), ("token_accuracy", "top1"), ("entropy", "entropy")):
        got = getattr(out, field)
        r = reduce_like_loss(want[key], keep, reduction)
        assert got is not None and not got.requires_grad and got.shape == r.shape, field
        if key == "top1":  # exact: a count of matches
            if reduction == "none":
                assert torch.equal(got.cpu().double(), r), f"top1 differs at {(got.cpu().double() != r).nonzero()}"
            else:
                assert abs(got.item() - r.item()) <= 1e-6 * max(1.0, abs(r.item())), f"{field}: {got} vs {r}"
            continue
        err = rel_err(got, r)
        assert err <= tol, f"{field}: rel err {err:.2e} > {tol:.0e}"


# (reduction, budget): the fast route (mean, sum), the lean one (mean, sum, none; ("none", "auto") is the lean
# route or, after a uniform call, the speculative one: tests/api/test_caller_reduced.py), and no gradient
ROUTES = [("mean", "auto"), ("sum", "auto"), ("mean", "lean"), ("sum", "lean"), ("none", "lean")]


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("reduction,budget", ROUTES + [(r, "no-grad") for r in ("mean", "sum", "none")],
                         ids=lambda x: x)
def test_metrics_match_oracle(backend, dtype, tol, reduction, budget):
    p = argmax_problem(45, 24, 131, dtype=dtype, seed=5, reduction=reduction, vocab_size=127)
    opts = dict(z_loss=1e-2, softcap=6.0, label_smoothing=0.1)
    h, w, b = (leaf(x.to(DEV)) for x in (p.hidden, p.weight, p.bias))
    with torch.set_grad_enabled(budget != "no-grad"):
        out = vpce.linear_cross_entropy(h, w, p.target.to(DEV), b, vocab_size=p.vocab_size, backend=backend,
                                        reduction=reduction, memory_budget="auto" if budget == "no-grad" else budget,
                                        **ALL, **opts)
    assert isinstance(out, vpce.CrossEntropyOutput)
    ref = reference(p.hidden, p.weight, p.target, p.bias, grad=p.grad, reduction=reduction,
                    vocab_size=p.vocab_size, **opts)
    assert rel_err(out.loss, ref.loss) <= tol  # the loss is what it is without metrics
    check_metrics(out, p, reduction, tol, **opts)
    if budget != "no-grad":
        (out.loss * p.grad.to(DEV, out.loss.dtype)).sum().backward()
        for name, got, want in (("dX", h.grad, ref.dhidden), ("dW", w.grad, ref.dweight), ("db", b.grad, ref.dbias)):
            assert rel_err(got, want) <= tol, f"{name}: rel err {rel_err(got, want):.2e}"


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("softcap", [None, 20.0], ids=["plain", "softcap"])
def test_accuracy_ties_go_to_the_lowest_id(backend, dtype, tol, softcap):
    """Integer logits, ties everywhere: accuracy per token equals ``torch.argmax == target`` exactly, where the
    target is the lowest, the highest or a middle id of a tied maximum (only the lowest counts)."""
    p = tie_problem(60, 6, 83, dtype=dtype, seed=2)
    want = reference_metrics(p.hidden, p.weight, p.target, p.bias, softcap=softcap)["top1"]
    assert 0.2 < want.mean() < 0.7  # the problem does exercise both outcomes
    for extra in (dict(reduction="none"), dict(reduction="none", memory_budget="lean")):
        out = vpce.linear_cross_entropy(leaf(p.hidden.to(DEV)), leaf(p.weight.to(DEV)), p.target.to(DEV),
                                        p.bias.to(DEV), softcap=softcap, backend=backend, return_token_accuracy=True,
                                        **extra)
        assert out.z_loss is None and out.entropy is None
        got = out.token_accuracy.cpu().double()
        assert torch.equal(got, want), f"{extra}: differs at {(got != want).nonzero().flatten().tolist()}"
    top1 = vpce.linear_log_probs(p.hidden.to(DEV), p.weight.to(DEV), p.target.to(DEV), p.bias.to(DEV),
                                 softcap=softcap, backend=backend, return_top1=True)[1]
    assert top1.dtype == torch.bool and torch.equal(top1.cpu().double(), want)


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("reduction,budget", ROUTES, ids=lambda x: x)
@pytest.mark.parametrize("variant", ["plain", "all"])
@pytest.mark.parametrize("scale", [1.0, 30.0], ids=["spread", "confident"])
def test_token_scaling(backend, dtype, tol, reduction, budget, variant, scale):
    """DFT: loss_i * p_t.detach(); gradients exact, with per-token weights (mean divides by their sum)."""
    p = argmax_problem(41, 24, 97, dtype=dtype, seed=3, reduction=reduction, scale=scale)
    gen = torch.Generator().manual_seed(9)
    tw = torch.rand(p.target.shape, generator=gen, dtype=torch.float64) * 2
    h, w, b = (leaf(x.to(DEV)) for x in (p.hidden, p.weight, p.bias))
    loss = vpce.linear_cross_entropy(h, w, p.target.to(DEV), b, token_weight=tw.to(DEV, dtype), backend=backend,
                                     reduction=reduction, memory_budget=budget, token_scaling=True,
                                     **VARIANTS[variant])
    (loss * p.grad.to(DEV, loss.dtype)).sum().backward()
    ref = reference(p.hidden, p.weight, p.target, p.bias, grad=p.grad, reduction=reduction, token_weight=tw,
                    token_scaling=True, **VARIANTS[variant])
    for name, got, want in (("loss", loss, ref.loss), ("dX", h.grad, ref.dhidden), ("dW", w.grad, ref.dweight),
                            ("db", b.grad, ref.dbias)):
        err = rel_err(got, want)
        assert err <= tol, f"{name}: rel err {err:.2e} > {tol:.0e}"


def test_token_scaling_is_trl_dft():
    """The same number TRL's SFT computes for ``loss_type="dft"`` from per-token log-probs."""
    p = argmax_problem(30, 16, 70, dtype=torch.float64, seed=4)
    logp = vpce.linear_log_probs(p.hidden, p.weight, p.target, p.bias)
    keep = p.target != -100
    dft = (-logp * logp.exp()).sum() / keep.sum()
    got = vpce.linear_cross_entropy(p.hidden, p.weight, p.target, p.bias, token_scaling=True)
    assert rel_err(got, dft) < 1e-13


def test_metrics_not_weighted_and_defaults_unchanged():
    p = argmax_problem(33, 16, 70, dtype=torch.float64, seed=6)
    tw = torch.rand(33, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    plain = vpce.linear_cross_entropy(p.hidden, p.weight, p.target, p.bias)
    assert isinstance(plain, torch.Tensor)  # nothing asked: the loss alone, as before
    out = vpce.linear_cross_entropy(p.hidden, p.weight, p.target, p.bias, token_weight=tw, return_entropy=True)
    assert out.z_loss is None and out.token_accuracy is None
    want = reference_metrics(p.hidden, p.weight, p.target, p.bias)["entropy"]
    assert rel_err(out.entropy, want.sum() / (p.target != -100).sum()) < 1e-12
    every_ignored = vpce.linear_cross_entropy(p.hidden, p.weight, torch.full_like(p.target, -100), **ALL)
    assert all(float(x) == 0.0 for x in every_ignored)
    empty = vpce.linear_cross_entropy(p.hidden[:0], p.weight, p.target[:0], reduction="none", **ALL)
    assert all(x.shape == (0,) for x in empty)
    m = vpce.LinearCrossEntropy(return_token_accuracy=True, token_scaling=True)
    assert m(p.hidden, p.weight, p.target).token_accuracy is not None


def test_bad_metric_arguments():
    p = make_problem(5, 8, 20)
    for name in ("return_z_loss", "return_token_accuracy", "return_entropy", "token_scaling"):
        with pytest.raises(TypeError, match=f"{name}: expected a bool, got int"):
            vpce.linear_cross_entropy(p.hidden, p.weight, p.target, **{name: 1})
    for name in ("return_top1", "return_mean_logits", "return_log_sum_sq_probs"):
        with pytest.raises(TypeError, match=f"{name}: expected a bool, got str"):
            vpce.linear_log_probs(p.hidden, p.weight, p.target, **{name: "yes"})


@pytest.mark.parametrize("backend,dtype,tol", BACKENDS, ids=[b[0] for b in BACKENDS])
def test_log_prob_extras(backend, dtype, tol):
    """TRL's per-token fields: (log_probs, entropy, is_top1, mean_logits, log_sum_sq_probs), only those asked, in
    that order; the gradients of log_probs and entropy unchanged by the extras."""
    p = argmax_problem(39, 24, 150, dtype=dtype, seed=8, vocab_size=141)
    gen = torch.Generator().manual_seed(2)
    gl, ge = (torch.randn(p.target.shape, generator=gen, dtype=torch.float64) for _ in range(2))
    kw = dict(temperature=0.7, softcap=5.0, vocab_size=141, backend=backend)
    h, w, b = (leaf(x.to(DEV)) for x in (p.hidden, p.weight, p.bias))
    out = vpce.linear_log_probs(h, w, p.target.to(DEV), b, return_entropy=True, return_top1=True,
                                return_mean_logits=True, return_log_sum_sq_probs=True, **kw)
    logp, ent, top1, mean, lss = out
    ((logp * gl.to(DEV, logp.dtype)).sum() + (ent * ge.to(DEV, ent.dtype)).sum()).backward()
    r_logp, r_ent, ref = reference_log_probs(p.hidden, p.weight, p.target, p.bias, g_logp=gl, g_ent=ge,
                                             temperature=0.7, softcap=5.0, vocab_size=141)
    want = reference_metrics(p.hidden, p.weight, p.target, p.bias, temperature=0.7, softcap=5.0, vocab_size=141)
    for name, got, r in (("logp", logp, r_logp), ("entropy", ent, r_ent), ("mean_logits", mean, want["mean_logits"]),
                         ("log_sum_sq_probs", lss, want["log_sum_sq_probs"]), ("dX", h.grad, ref.dhidden),
                         ("dW", w.grad, ref.dweight), ("db", b.grad, ref.dbias)):
        assert rel_err(got, r) <= tol, f"{name}: rel err {rel_err(got, r):.2e}"
    assert top1.dtype == torch.bool and torch.equal(top1.cpu().double(), want["top1"])
    assert 0.3 < want["top1"][p.target != -100].mean() < 0.8
    assert not (top1.requires_grad or mean.requires_grad or lss.requires_grad)
    # only the fields asked for, in order; log_probs alone and (log_probs, entropy) as before
    with torch.no_grad():
        assert isinstance(vpce.linear_log_probs(p.hidden.to(DEV), p.weight.to(DEV), p.target.to(DEV), **kw),
                          torch.Tensor)
        two = vpce.linear_log_probs(p.hidden.to(DEV), p.weight.to(DEV), p.target.to(DEV), return_mean_logits=True,
                                    return_top1=True, **kw)
    assert len(two) == 3 and two[1].dtype == torch.bool and two[2].dtype != torch.bool


# -- vocab parallel: 2-3 gloo ranks, uneven shards, ties across shard boundaries -----------------------------------

def _tp_metrics(rank, world, backend):
    dtype = torch.float64 if backend == "torch" else torch.float32
    sizes = [23, 9, 31][:world]
    start, rows = sum(sizes[:rank]), sizes[rank]
    out = {}
    # integer logits: ties within and across shards (a tie at a shard boundary: the lower rank's column wins)
    p = tie_problem(16 * world, 5, sum(sizes), dtype=dtype, seed=11 + world)
    shard = lambda x: leaf(x[start:start + rows])  # noqa: E731
    for name, kw in (("fast", {}), ("lean", dict(memory_budget="lean")), ("none", dict(reduction="none"))):
        r = vpce.linear_cross_entropy(leaf(p.hidden), shard(p.weight), p.target, shard(p.bias), backend=backend,
                                      group=dist.group.WORLD, **ALL, **kw)
        out[f"tie-{name}"] = [x.detach() for x in r]
    lp = vpce.linear_log_probs(p.hidden, p.weight[start:start + rows], p.target, p.bias[start:start + rows],
                               backend=backend, group=dist.group.WORLD, return_top1=True, return_mean_logits=True,
                               return_log_sum_sq_probs=True, return_entropy=True)
    out["tie-logprobs"] = [x.detach() for x in lp]
    # random logits, half the targets the argmax; token scaling with gradients; sequence parallel
    q = argmax_problem(6 * world, 13, sum(sizes), dtype=dtype, seed=21, vocab_size=sum(sizes) - 4)
    for sp in (False, True):
        for kw in (dict(reduction="mean"), dict(reduction="none", memory_budget="lean")):
            h = leaf(q.hidden[rank * 6:(rank + 1) * 6] if sp else q.hidden)
            w, b = shard(q.weight), shard(q.bias)
            r = vpce.linear_cross_entropy(h, w, q.target, b, backend=backend, group=dist.group.WORLD,
                                          sequence_parallel=sp, vocab_size=q.vocab_size, token_scaling=True,
                                          z_loss=1e-2, softcap=6.0, **ALL, **kw)
            grad = q.grad if kw["reduction"] == "mean" else torch.linspace(-1, 2, q.target.numel())
            (r.loss * grad.to(dtype)).sum().backward()
            key = f"dft-sp{int(sp)}-{kw['reduction']}"
            out[key] = [x.detach() for x in r] + [h.grad, w.grad, b.grad, grad]
    # numpy arrays travel back to the parent by value (tensors would by shared memory, gone with the process)
    return {k: [x.numpy() for x in v] for k, v in out.items()}


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vocab_parallel(world, backend):
    tol = 1e-11 if backend == "torch" else 3e-5
    sizes = [23, 9, 31][:world]
    results = [{k: [torch.from_numpy(x) for x in v] for k, v in res.items()}
               for res in run_ranks(_tp_metrics, world, backend, timeout=240)]
    for key in results[0]:
        for rank in range(1, world):  # identical on every rank: the same bytes combined in the same order
            for i, (a, b) in enumerate(zip(results[0][key][:4], results[rank][key][:4])):
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{key}[{i}] rank {rank}"
    dtype = torch.float64 if backend == "torch" else torch.float32
    p = tie_problem(16 * world, 5, sum(sizes), dtype=dtype, seed=11 + world)
    want = reference_metrics(p.hidden, p.weight, p.target, p.bias)
    keep = p.target != -100
    z = p.hidden.double() @ p.weight.double().t() + p.bias.double()
    owner = torch.bucketize(torch.arange(sum(sizes)), torch.tensor(sizes).cumsum(0), right=True)
    first = z.argmax(-1)  # the lowest id among the maxima
    across = keep & (z.gather(1, p.target.clamp(min=0)[:, None]).squeeze(1) == z.amax(-1)) & \
        (owner[first] < owner[p.target.clamp(min=0)])
    assert across.sum() >= 2, "the problem must have targets tied with a maximum on a lower rank"
    for name, red in (("fast", "mean"), ("lean", "mean"), ("none", "none")):
        got = results[0][f"tie-{name}"]
        acc = reduce_like_loss(want["top1"], keep, red)
        assert torch.equal(got[2].double(), acc) if red == "none" else abs(float(got[2]) - float(acc)) < 1e-6, name
        assert rel_err(got[3], reduce_like_loss(want["entropy"], keep, red)) <= tol
    _, ent, top1, mean, lss = results[0]["tie-logprobs"]
    assert torch.equal(top1.double(), want["top1"])
    for got, key in ((ent, "entropy"), (mean, "mean_logits"), (lss, "log_sum_sq_probs")):
        assert rel_err(got, want[key]) <= tol, key
    q = argmax_problem(6 * world, 13, sum(sizes), dtype=dtype, seed=21, vocab_size=sum(sizes) - 4)
    wantq = reference_metrics(q.hidden, q.weight, q.target, q.bias, vocab_size=q.vocab_size, softcap=6.0, z_loss=1e-2)
    keep = q.target != -100
    for sp in (0, 1):
        for red in ("mean", "none"):
            for rank, res in enumerate(results):
                loss, zl, acc, ent, dh, dw, db, grad = res[f"dft-sp{sp}-{red}"]
                ref = reference(q.hidden, q.weight, q.target, q.bias, grad=grad.double(), reduction=red,
                                vocab_size=q.vocab_size, token_scaling=True, z_loss=1e-2, softcap=6.0)
                start, rows = sum(sizes[:rank]), sizes[rank]
                want_dx = ref.dhidden[rank * 6:(rank + 1) * 6] if sp else ref.dhidden
                for name, got, r in (("loss", loss, ref.loss), ("dX", dh, want_dx),
                                     ("dW", dw, ref.dweight[start:start + rows]),
                                     ("db", db, ref.dbias[start:start + rows]),
                                     ("z_loss", zl, reduce_like_loss(wantq["z_loss"], keep, red)),
                                     ("entropy", ent, reduce_like_loss(wantq["entropy"], keep, red))):
                    assert rel_err(got, r) <= tol, f"sp={sp} {red} rank {rank} {name}: {rel_err(got, r):.2e}"
                assert torch.allclose(acc.double(), reduce_like_loss(wantq["top1"], keep, red).double(), atol=1e-6)


def boundary_tie_problem(sizes, *, dtype, n=64, d=257, seed=5) -> tuple[Problem, torch.Tensor]:
    """Random logits with two equal lm_head rows (weight and bias) on each side of every shard boundary, large
    enough to be the argmax of most tokens: a tie across ranks that the lower id must win (new special tokens are
    often initialised to one vector). Targets: the lower id of the tie, the upper one, the argmax, or random; some
    ignored. Returns the problem and the boundary's lower ids.

    The values are random but on a coarse dyadic grid (sixteenths of the hidden states, 128ths of the weights),
    so that every logit is exact in fp32 and fp64 whatever order the GEMM sums in: the tie is a tie on every
    machine. With real-valued random inputs a CPU BLAS that blocks the two ranks' GEMMs differently (an AMD EPYC
    machine) rounded the two equal rows' logits one ulp apart, and the float64 argmax followed."""
    gen = torch.Generator().manual_seed(seed)
    v = sum(sizes)

    def grid(*shape, denominator):  # |value| <= 2 in steps of 1 / denominator: at most 19 bits in any logit here
        return torch.randint(-32, 33, shape, generator=gen, dtype=torch.float64) * (2.0 / denominator)

    hidden = grid(n, d, denominator=32)
    weight = grid(v, d, denominator=256)
    bias = grid(v, denominator=256)
    lower = torch.tensor(sizes).cumsum(0)[:-1] - 1
    for i in lower.tolist():
        weight[i] = weight[i + 1] = grid(d, denominator=32)
        bias[i] = bias[i + 1] = 0.5
    z = hidden @ weight.t() + bias
    top = z.argmax(-1)
    pick = torch.rand(n, generator=gen)
    target = torch.where(pick < 0.6, top, torch.randint(0, v, (n,), generator=gen))
    target = torch.where(torch.isin(top, lower) & (pick < 0.25), top + 1, target)  # the tie's upper id: never top-1
    target[::9] = -100
    grad = torch.linspace(-1.0, 2.0, n, dtype=torch.float64)
    return Problem(hidden.to(dtype), weight.to(dtype), target, bias.to(dtype), grad, v), lower


def _tp_boundary_ties(rank, world, backend, sizes):
    dtype = torch.float64 if backend == "torch" else torch.float32
    p, _ = boundary_tie_problem(sizes, dtype=dtype)
    start, rows = sum(sizes[:rank]), sizes[rank]
    out = {}
    for name, grad, kw in (("fast", True, dict(reduction="mean")), ("fast-sum", True, dict(reduction="sum")),
                           ("lean", True, dict(memory_budget="lean")), ("none", True, dict(reduction="none")),
                           ("no-grad", False, dict(reduction="none"))):
        h = p.hidden.clone().requires_grad_(grad)
        w = p.weight[start:start + rows].clone().requires_grad_(grad)
        b = p.bias[start:start + rows].clone().requires_grad_(grad)
        r = vpce.linear_cross_entropy(h, w, p.target, b, backend=backend, group=dist.group.WORLD,
                                      return_token_accuracy=True, **kw)
        if grad:
            (r.loss * (p.grad.to(dtype) if kw.get("reduction") == "none" else 1.0)).sum().backward()
        out[name] = r.token_accuracy.detach().numpy()
    for grad in (False, True):
        h = p.hidden.clone().requires_grad_(grad)
        w = p.weight[start:start + rows].clone().requires_grad_(grad)
        lp, top1 = vpce.linear_log_probs(h, w, p.target, p.bias[start:start + rows], backend=backend,
                                         group=dist.group.WORLD, return_top1=True)
        if grad:
            (lp * p.grad.to(dtype)).sum().backward()
        out[f"log-probs-grad{int(grad)}"] = top1.numpy()
    return out


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
@pytest.mark.parametrize("sizes", [[102, 101], [40, 31, 47]], ids=["2-ranks", "3-ranks"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_accuracy_ties_across_the_shard_boundary(backend, sizes):
    """Two equal rows on each side of every shard boundary (random values, not integers): the tie's lower id is
    the argmax, on every route, with and without gradients, as float64 ``torch.argmax`` says. (The fast route with
    gradients once compared its fp32 target logit with the other rank's rounded logits, and lost such ties.)"""
    p, lower = boundary_tie_problem(sizes, dtype=torch.float64)
    want = reference_metrics(p.hidden, p.weight, p.target, p.bias)["top1"]
    keep = p.target != -100
    top = (p.hidden @ p.weight.t() + p.bias).argmax(-1)
    at_tie = keep & torch.isin(top, lower)
    assert int((at_tie & (p.target == top)).sum()) >= 3 and int((at_tie & (p.target == top + 1)).sum()) >= 2, \
        "the problem must have targets on both ids of a boundary tie"
    results = run_ranks(_tp_boundary_ties, len(sizes), backend, sizes, timeout=240)
    for name, got in results[0].items():
        for rank in range(1, len(sizes)):
            assert (results[rank][name] == got).all(), f"{name}: rank {rank} differs from rank 0"
        got = torch.from_numpy(got).double()
        if name in ("fast", "fast-sum", "lean"):
            r = reduce_like_loss(want, keep, "sum" if name == "fast-sum" else "mean")
            assert abs(float(got) - float(r)) <= 1e-6 * max(1.0, float(r)), f"{name}: {float(got)} vs {float(r)}"
        else:
            assert torch.equal(got, want), f"{name}: differs at {(got != want).nonzero().flatten().tolist()}"
