"""The speculative route (``vpce.speculation``): ``reduction="none"`` and ``linear_log_probs`` at the fast route's
cost when the caller reduces the per-token outputs uniformly, exact for any upstream gradient.

Each test keeps one call site (the same weight shape and options across calls, whose history decides the route; the
fixture forgets every history between tests) and checks every
call against the float64 oracle, with ``tests/backends/test_triton_backend.py``'s tolerances: fp32 2e-5 (loss 1e-5); fp16 no
worse than torch eager's error in the same dtype (times 1.25, plus 1e-6). The route comes from
``speculation.route_of``. The chunks are the smallest (128 tokens), so that 260 tokens make three chunks in forward
and three gated blocks in backward, the last one ragged; V = 90 rows (83 real) and D = 24 leave ragged tiles. fp16
runs on the interpreter are slow (numpy's fp16 matmul): they cover a subset.
"""

import math

import pytest
import torch
import torch.nn.functional as F

import vpce
from distributed import run_ranks
from problems import VARIANTS, leaf, make_problem
from vpce import kernels, routing, speculation
from vpce.reference import describe, reference, reference_log_probs, reference_metrics, rel_err, torch_eager

pytest.importorskip("triton")
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if CUDA else [])
N, D, ROWS, VOCAB = 260, 24, 90, 83


@pytest.fixture(autouse=True)
def fresh_history(sizing):
    speculation.reset()
    sizing(fast_p_gib=1e-9, min_p_gib=1e-9)  # chunks of ROW_ALIGN = 128 tokens
    yield
    speculation.reset()


def problem(dtype, seed=3, n=N):
    return make_problem(n, D, ROWS, dtype=dtype, bias=True, vocab_size=VOCAB, ignore_frac=0.2, scale=3.0, seed=seed,
                        reduction="none")


# -- upstream gradients (float64, [N]) --------------------------------------------------------------------------

def uniform(p, c, seed=0):
    """``c`` on every non-ignored token, something else (random, even NaN) on the ignored ones: not counted."""
    other = torch.randn(p.target.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 5
    other[::7] = math.nan
    return torch.where(p.target != -100, torch.tensor(c, dtype=torch.float64), other)


def per_token(p, seed=1):
    """GRPO-style: a different value on every token (advantages of mixed sign)."""
    return torch.randn(p.target.shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def partly(p, c, lo=140, hi=150):
    """Uniform but for tokens ``lo:hi`` (inside the second chunk): one gated block differs."""
    g = uniform(p, c)
    g[lo:hi] = torch.linspace(-1, 2, hi - lo, dtype=torch.float64)
    return g


# -- one call site ----------------------------------------------------------------------------------------------

def eager_log_probs(hidden, weight, bias, target, g, vocab, temperature=1.0, softcap=None):
    """``linear_log_probs`` as a user writes it in the inputs' dtype (the 16-bit error bar)."""
    h, w, b = (x.detach().clone().requires_grad_() for x in (hidden, weight, bias))
    z = F.linear(h, w[:vocab], b[:vocab]).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    logq = torch.log_softmax(z / temperature, -1)
    keep = target != -100
    logp = torch.where(keep, logq.gather(-1, torch.where(keep, target, 0)[:, None]).squeeze(-1), 0)
    grads = torch.autograd.grad((logp * torch.where(keep, g, 0).float()).sum(), [h, w, b])
    return [logp.detach(), *grads]


class Site:
    """One call site: the same weight and bias tensors at every call. ``entry``: ``"ce"`` (``reduction="none"``)
    or ``"logprob"``; ``opts``: its keyword options (``token_weight``/``class_weight`` as float64 CPU tensors)."""

    def __init__(self, p, entry, frozen=False, **opts):
        self.p, self.entry, self.opts = p, entry, opts
        self.w = p.weight.to(DEV).detach().clone().requires_grad_(not frozen)
        self.b = None if p.bias is None else leaf(p.bias.to(DEV))

    def __call__(self, g, retain=False, **extra):
        p = self.p
        h = leaf(p.hidden.to(DEV))
        self.w.grad = None
        if self.b is not None:
            self.b.grad = None
        opts = {k: v.to(DEV, torch.float32) if isinstance(v, torch.Tensor) else v for k, v in self.opts.items()}
        opts.update(extra)
        if self.entry == "ce":
            out = vpce.linear_cross_entropy(h, self.w, p.target.to(DEV), self.b, backend="triton",
                                            vocab_size=p.vocab_size, reduction="none", **opts)
        else:
            out = vpce.linear_log_probs(h, self.w, p.target.to(DEV), self.b, backend="triton",
                                        vocab_size=p.vocab_size, **opts)
        first = out[0] if isinstance(out, tuple) else out
        first = first.loss if hasattr(first, "loss") else first
        route = speculation.route_of(first)
        first.backward(g.to(DEV, first.dtype), retain_graph=retain)
        grads = [h.grad, self.w.grad, None if self.b is None else self.b.grad]
        self.last, self.out = (first, h), out
        return route, [None if x is None else x.detach().cpu() for x in (first, *grads)]

    def oracle(self, g):
        p = self.p
        if self.entry == "ce":
            kw = {k: v for k, v in self.opts.items() if not k.startswith("return_")}
            ref = reference(p.hidden, p.weight, p.target, p.bias, grad=g, vocab_size=p.vocab_size, reduction="none",
                            **kw)
            return [ref.loss, ref.dhidden, ref.dweight, ref.dbias]
        kw = {k: self.opts[k] for k in ("temperature", "softcap") if k in self.opts}
        logp, _, ref = reference_log_probs(p.hidden, p.weight, p.target, p.bias, g_logp=g, vocab_size=p.vocab_size,
                                           **kw)
        return [logp, ref.dhidden, ref.dweight, ref.dbias]

    def eager(self, g):
        p = self.p
        if self.entry == "ce":
            kw = {k: v for k, v in self.opts.items() if k in ("label_smoothing", "z_loss", "softcap", "class_weight")}
            e = torch_eager(p.hidden, p.weight, p.target, p.bias, grad=g, vocab_size=p.vocab_size, reduction="none",
                            **kw)
            return [e.loss, e.dhidden, e.dweight, e.dbias]
        kw = {k: self.opts[k] for k in ("temperature", "softcap") if k in self.opts}
        return eager_log_probs(p.hidden, p.weight, p.bias, p.target, g, VOCAB, **kw)

    def check(self, got, g, what=""):
        """Every output against the oracle (``check`` of tests/backends/test_triton_backend.py); a frozen weight's or bias's
        gradient must be None."""
        want = self.oracle(g)
        base = self.eager(g) if self.p.hidden.dtype != torch.float32 else [None] * 4
        frozen = {"dW": not self.w.requires_grad, "db": self.b is None or not self.b.requires_grad}
        for name, x, r, e in zip(("out", "dX", "dW", "db"), got, want, base):
            if frozen.get(name):
                assert x is None, f"{what}: {name} of a frozen tensor"
                continue
            err = rel_err(x, r)
            if self.p.hidden.dtype == torch.float32:
                tol = 1e-5 if name == "out" else 2e-5
            elif name == "out":
                tol = max(1e-5, 4 * rel_err(e, r) + 1e-6)
            else:
                tol = 1.25 * rel_err(e, r) + 1e-6
            assert err <= tol, f"{what} {name}: rel err {err:.3e} > {tol:.3e} ({describe(x, r)})"


CE_CASES = {
    "ce-plain": {},
    "ce-all": VARIANTS["all"],
    "ce-class-weight": {"label_smoothing": 0.1, "class_weight": "rand"},
    "ce-token-weight": {"z_loss": 1e-3, "token_weight": "rand"},
    "ce-token-scaling": {"token_scaling": True, "softcap": 6.0},
    "ce-metrics": {"return_token_accuracy": True, "return_entropy": True, "label_smoothing": 0.1},
}
LP_CASES = {
    "lp-plain": {},
    "lp-T0.7-cap4": {"temperature": 0.7, "softcap": 4.0},
    "lp-extras": {"return_top1": True, "return_mean_logits": True, "return_log_sum_sq_probs": True},
}
FP16 = {"ce-all", "ce-class-weight", "ce-metrics", "lp-T0.7-cap4", "lp-extras"}  # (torch_eager has no token weights)


def site_of(case, dtype, **kw):
    p = problem(dtype)
    opts = dict(CE_CASES.get(case, LP_CASES.get(case)))
    gen = torch.Generator().manual_seed(11)
    if opts.get("class_weight") == "rand":
        opts["class_weight"] = torch.rand(ROWS, generator=gen, dtype=torch.float64) * 2
    if opts.get("token_weight") == "rand":
        opts["token_weight"] = torch.rand(N, generator=gen, dtype=torch.float64) * 2
    return Site(p, "ce" if case.startswith("ce") else "logprob", **kw, **opts)


# -- (a), (e): the first call is lean, the next one speculative; both exact ------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", [*CE_CASES, *LP_CASES])
def test_uniform_history_takes_the_speculative_route(dtype, case):
    if dtype != torch.float32 and case not in FP16:
        pytest.skip("fp32 only (the interpreter's fp16 is slow; torch_eager has no token weights)")
    site = site_of(case, dtype)
    g1, g2 = uniform(site.p, 0.37), uniform(site.p, -1.0 / 241, seed=5)  # (the reciprocal of a count, as SFT's mean)
    route, got = site(g1)
    assert route == "lean", "a call site's first call takes the lean route"
    site.check(got, g1, "first call")
    route, got = site(g2)
    assert route == "speculative", "after a uniform upstream gradient the next call speculates"
    site.check(got, g2, "speculative")
    if case in ("ce-metrics", "lp-extras"):  # the detached per-token metrics of the same pass
        p = site.p
        ref = reference_metrics(p.hidden, p.weight, p.target, p.bias, vocab_size=p.vocab_size)
        if case == "ce-metrics":
            pairs = [(site.out.token_accuracy, ref["top1"]), (site.out.entropy, ref["entropy"])]
        else:
            pairs = [(site.out[1].double(), ref["top1"]), (site.out[2], ref["mean_logits"]),
                     (site.out[3], ref["log_sum_sq_probs"])]
        tol = 2e-5 if dtype == torch.float32 else 2e-2
        for i, (x, r) in enumerate(pairs):
            x = x.detach().cpu().double()
            if i == 0:  # the argmax can flip on a near tie in 16 bits
                assert (x != r).float().mean() <= (0 if dtype == torch.float32 else 0.02), "top1"
            else:
                assert rel_err(x, r) <= tol, f"metric {i}: {describe(x, r)}"


# -- (b), (c): a misprediction, and a partly uniform gradient: exact through the gated recompute ------------------

@pytest.mark.parametrize("dtype,case", [(torch.float32, "ce-all"), (torch.float32, "ce-class-weight"),
                                        (torch.float32, "lp-T0.7-cap4"), (torch.float16, "ce-all")],
                         ids=lambda x: str(x))
def test_misprediction_is_exact_and_the_next_call_goes_lean(dtype, case):
    site = site_of(case, dtype)
    site(uniform(site.p, 0.5))
    g = per_token(site.p)
    route, got = site(g)
    assert route == "speculative"
    site.check(got, g, "mispredicted")
    route, got = site(g)
    assert route == "lean", "a non-uniform upstream gradient sends the next call to the lean route"
    site.check(got, g, "after the misprediction")


@pytest.mark.parametrize("dtype,case,where", [
    *((torch.float32, case, where) for case in ("ce-plain", "lp-plain")
      for where in ("one-block", "first-token", "zero-weights")),
    (torch.float16, "ce-plain", "one-block")], ids=lambda x: str(x))
def test_partly_uniform_gradient_is_exact(dtype, case, where):
    """Only some tokens differ: in one gated block; at the first non-ignored token (which gives ``c``); or a mask
    that zeroes a third of the non-ignored tokens (``(logp * mask).sum()`` with a mask other than the ignored ones)."""
    site = site_of(case, dtype)
    site(uniform(site.p, 1.0))
    if where == "one-block":
        g = partly(site.p, 0.8)
    elif where == "first-token":
        g = uniform(site.p, 0.8)
        g[int((site.p.target != -100).nonzero()[0])] = -3.0
    else:
        g = torch.where(torch.arange(N) % 3 == 0, 0.0, uniform(site.p, 0.8))
    route, got = site(g)
    assert route == "speculative"
    site.check(got, g, where)


def test_blocks_without_a_non_zero_upstream_gradient_are_skipped(monkeypatch):
    """On a misprediction dW is recomputed for the token blocks (chunks) that hold a non-zero upstream gradient
    only, the others' device flags being 0; with a uniform gradient every block is skipped. Counted through the
    gated launcher's flags; the results exact."""
    site = site_of("ce-plain", torch.float32)
    site(uniform(site.p, 1.0))
    seen = []
    real = kernels.gated_weight_grad_

    def spy(dw, db, p, x, flag):
        seen.append(int(flag.item()))
        return real(dw, db, p, x, flag)

    monkeypatch.setattr(kernels, "gated_weight_grad_", spy)
    g = torch.where((torch.arange(N) >= 140) & (torch.arange(N) < 150), per_token(site.p), 0.0)  # the 2nd chunk
    route, got = site(g)
    assert route == "speculative" and seen == [0, 1, 0], seen
    site.check(got, g)
    seen.clear()
    route, _ = site(uniform(site.p, 0.25))
    assert route == "lean" and seen == []  # the lean route has no gated kernels
    route, got = site(uniform(site.p, 0.25))
    assert route == "speculative" and seen == [0, 0, 0]  # uniform: every block skipped
    site.check(got, uniform(site.p, 0.25))


# -- (d): NaN and inf in the upstream gradient, as the lean route ---------------------------------------------------

@pytest.mark.parametrize("case,bad,where", [
    ("ce-all", math.nan, ("at a kept token", "everywhere it counts", "at an ignored token")),
    ("lp-plain", math.nan, ("at a kept token",)),
    ("ce-all", math.inf, ("at a kept token", "everywhere it counts"))], ids=["ce-nan", "lp-nan", "ce-inf"])
def test_non_finite_upstream_gradient_matches_the_lean_route(case, bad, where, monkeypatch):
    """A NaN in ``g`` gives the lean route's NaN pattern (a kept token's row of dX, all of dW and db; nothing from
    an ignored token), and an inf the same non-finite entries."""
    site = site_of(case, torch.float32)
    keep = site.p.target != -100
    kept = keep.nonzero()[:, 0]
    cases = {"at a kept token": (uniform(site.p, 0.5), int(kept[5])),
             "everywhere it counts": (torch.where(keep, bad, 0.0), None),
             "at an ignored token": (uniform(site.p, 0.5), int((~keep).nonzero()[0]))}
    cases = {name: cases[name] for name in where}
    results = {}
    monkeypatch.setattr(speculation.Record, "predict", lambda self: True)  # as after a uniform history, every call
    for speculate in (True, False):
        for name, (g, at) in cases.items():
            g = g.clone()
            if at is not None:
                g[at] = bad
            route, got = site(g) if speculate else site(g, memory_budget="lean")
            assert route == ("speculative" if speculate else "lean")
            results[speculate, name] = got
    for name in cases:
        for what, a, b in zip(("out", "dX", "dW", "db"), results[True, name], results[False, name]):
            if math.isnan(bad):
                assert torch.equal(torch.isnan(a), torch.isnan(b)), f"{name}: {what}'s NaN pattern differs from lean's"
            # an infinite g_i: the lean route's row is inf - inf = NaN where the speculative one's is +-inf times
            # the unit row; the same entries are not finite
            assert torch.equal(torch.isfinite(a), torch.isfinite(b)), f"{name}: {what} not finite elsewhere"
            fin = torch.isfinite(b)
            assert rel_err(a[fin], b[fin]) <= 2e-5, f"{name}: {what} {describe(a[fin], b[fin])}"
    if "at an ignored token" in cases:
        assert not torch.isnan(results[True, "at an ignored token"][1]).any()


# -- the general case: never uniform, always lean after the first call --------------------------------------------

@pytest.mark.parametrize("case", ["ce-plain", "lp-plain"])
def test_per_token_gradients_stay_on_the_lean_route(case):
    """GRPO-style advantages never speculate; a change to a uniform pattern does after one lean call."""
    site = site_of(case, torch.float32)
    for seed in range(2):
        g = per_token(site.p, seed)
        route, got = site(g)
        assert route == "lean"
        site.check(got, g)
    assert site(uniform(site.p, 2.0))[0] == "lean"  # it learns from the previous (non-uniform) backward
    assert site(uniform(site.p, 2.0))[0] == "speculative"


def test_not_eligible_calls_stay_lean():
    """``memory_budget="lean"``, and the torch backend."""
    p = problem(torch.float32)
    g = uniform(p, 1.0)
    lean = Site(p, "ce", memory_budget="lean")
    lean_lp = Site(p, "logprob", memory_budget="lean")
    for _ in range(2):
        assert lean(g)[0] == "lean" and lean_lp(g)[0] == "lean"
    with pytest.raises(ValueError, match="memory_budget: expected one of"):
        vpce.linear_log_probs(p.hidden, p.weight, p.target, memory_budget="small")
    torch_site = Site(make_problem(40, 16, 30, dtype=torch.float64, reduction="none"), "ce")
    for _ in range(2):
        h, w = leaf(torch_site.p.hidden.to(DEV)), torch_site.w
        out = vpce.linear_cross_entropy(h, w, torch_site.p.target.to(DEV), backend="torch", reduction="none")
        assert speculation.route_of(out) == "lean"
        out.backward(torch.ones_like(out))


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
def test_entropy_logged_speculates_and_an_entropy_gradient_recomputes(frozen):
    """``return_entropy=True`` with the entropy only logged (TRL's SFT) speculates; a backward that brings an
    entropy gradient gets exact gradients from the recompute, and the call site goes lean."""
    p = problem(torch.float32)
    site = Site(p, "logprob", frozen=frozen, return_entropy=True)
    site.b.requires_grad_(not frozen)
    g = uniform(p, 0.5)
    routes = []
    for _ in range(2):
        route, got = site(g)  # backward through log_probs only: the entropy gets no gradient
        routes.append(route)
        site.check(got, g, "entropy logged")
    assert routes == (["speculative"] * 2 if frozen else ["lean", "speculative"])
    g_ent = per_token(p, seed=5)
    ref_logp, ref_ent, ref = reference_log_probs(p.hidden, p.weight, p.target, p.bias, g_logp=g, g_ent=g_ent,
                                                 vocab_size=p.vocab_size)
    keep = p.target != -100
    for want_route in (("speculative", "lean") if not frozen else ("speculative", "speculative")):
        h = leaf(p.hidden.to(DEV))
        site.w.grad = site.b.grad = None
        logp, ent = vpce.linear_log_probs(h, site.w, p.target.to(DEV), site.b, backend="triton",
                                          vocab_size=p.vocab_size, return_entropy=True)
        assert speculation.route_of(logp) == want_route
        assert rel_err(ent.detach().cpu()[keep], ref_ent[keep]) <= 1e-5
        torch.autograd.backward([logp, ent], [g.to(DEV, torch.float32), g_ent.to(DEV, torch.float32)])
        assert rel_err(h.grad.cpu(), ref.dhidden) <= 2e-5
        if not frozen:
            assert rel_err(site.w.grad.cpu(), ref.dweight) <= 2e-5
            assert rel_err(site.b.grad.cpu(), ref.dbias) <= 2e-5
    assert rel_err(logp.detach().cpu(), ref_logp) <= 1e-5


def test_a_weight_gathered_anew_at_every_step_still_speculates():
    """FSDP2 and TRL hand over a freshly gathered weight at every step: another storage, the same call site."""
    p = problem(torch.float32)
    g = uniform(p, 0.5)
    _, _, ref = reference_log_probs(p.hidden, p.weight, p.target, g_logp=g, vocab_size=p.vocab_size)
    routes, weights = [], []
    for _ in range(3):
        weights.append(leaf(p.weight.to(DEV)))  # all kept alive: three different storages
        h = leaf(p.hidden.to(DEV))
        out = vpce.linear_log_probs(h, weights[-1], p.target.to(DEV), backend="triton", vocab_size=p.vocab_size)
        routes.append(speculation.route_of(out))
        out.backward(g.to(DEV, torch.float32))
        assert rel_err(h.grad.cpu(), ref.dhidden) <= 2e-5 and rel_err(weights[-1].grad.cpu(), ref.dweight) <= 2e-5
    assert len({w.data_ptr() for w in weights}) == 3
    assert routes == ["lean", "speculative", "speculative"]


# -- a frozen lm_head: nothing to speculate on, dX exact for any upstream gradient ----------------------------------

@pytest.mark.parametrize("dtype,case", [(torch.float32, "ce-all"), (torch.float32, "lp-T0.7-cap4"),
                                        (torch.float16, "ce-all")], ids=lambda x: str(x))
def test_frozen_weight_always_forms_dx_in_forward(dtype, case):
    site = site_of(case, dtype, frozen=True)
    site.b.requires_grad_(False)
    for seed in range(2):
        g = per_token(site.p, seed)
        route, got = site(g)
        assert route == "speculative", "only dX needed: the first call too"
        site.check(got, g, "frozen")


def test_bias_gradient_alone_is_speculated_on():
    site = site_of("ce-all", torch.float32, frozen=True)  # bias trainable
    assert site(uniform(site.p, 1.0))[0] == "lean"
    for g in (uniform(site.p, 0.5), per_token(site.p)):
        route, got = site(g)
        assert route == "speculative"
        site.check(got, g)


# -- autograd semantics ------------------------------------------------------------------------------------------

def test_log_probs_memory_budget_sizes_the_chunk(monkeypatch):
    """A number is the speculative route's ``P`` chunk in GiB: 256 tokens here, so two gated blocks (one ragged)."""
    site = site_of("lp-plain", torch.float32, memory_budget=256 * VOCAB * 4 / 2**30)
    assert site(uniform(site.p, 0.5))[0] == "lean"
    flags = []
    real = kernels.gated_weight_grad_
    monkeypatch.setattr(kernels, "gated_weight_grad_", lambda *a: flags.append(int(a[-1].item())) or real(*a))
    g = partly(site.p, 0.5)
    route, got = site(g)
    assert route == "speculative" and flags == [1, 1], flags
    site.check(got, g)


def test_second_backward_and_accumulation():
    """``retain_graph=True``: the second backward of a speculative call recomputes (the lean route) and equals the
    first; ``.grad`` accumulates over micro-batches as usual."""
    site = site_of("ce-all", torch.float32)
    site(uniform(site.p, 1.0))
    g = uniform(site.p, 0.5)
    route, got = site(g, retain=True)
    assert route == "speculative"
    out, h = site.last
    first = [x.clone() for x in (h.grad, site.w.grad, site.b.grad)]
    out.backward(g.float().to(DEV), retain_graph=False)
    for name, a, b in zip(("dX", "dW", "db"), (h.grad, site.w.grad, site.b.grad), first):
        assert rel_err(a.cpu(), 2 * b.cpu()) <= 2e-5, f"{name} after two backward passes"


def test_accumulate_main_grad():
    p = problem(torch.float32)
    w = torch.nn.Parameter(p.weight.to(DEV))
    w.main_grad = torch.zeros(w.shape, dtype=torch.float32, device=DEV)
    g = uniform(p, 0.5)
    routes = []
    for _ in range(2):
        out = vpce.linear_cross_entropy(leaf(p.hidden.to(DEV)), w, p.target.to(DEV), vocab_size=p.vocab_size,
                                        backend="triton", reduction="none", accumulate_main_grad=True)
        routes.append(speculation.route_of(out))
        out.backward(g.float().to(DEV))
    assert routes == ["lean", "speculative"]
    want = reference(p.hidden, p.weight, p.target, grad=2 * g, vocab_size=p.vocab_size, reduction="none").dweight
    assert rel_err(w.main_grad.cpu(), want) <= 2e-5
    assert w.grad is None


def test_empty_and_all_ignored_batches():
    p = problem(torch.float32)
    site = Site(p, "ce")
    site(uniform(p, 1.0))
    q = problem(torch.float32)
    q.target = torch.full_like(q.target, -100)
    site.p = q
    route, got = site(uniform(q, 1.0))
    assert route == "speculative" and all(x.abs().max() == 0 for x in got)
    site.p = p


def test_bench_rows(monkeypatch):
    """The bench's caller-reduced rows on the Triton backend: the primed rows' checked call is speculative (their
    throwaway call shares the weight's storage), the GRPO-shaped row stays lean."""
    from types import SimpleNamespace

    from vpce.bench import methods

    monkeypatch.setattr(methods, "device_backend", lambda env: "triton")
    env = SimpleNamespace(device=torch.device(DEV), vpce_layout=lambda: {})
    p = make_problem(140, D, ROWS, dtype=torch.float32, seed=2)
    for name, want in (("vpce-logprobs-primed", "speculative"), ("vpce-none-mean", "speculative"),
                       ("vpce-logprobs-grpo", "lean")):
        speculation.reset()
        fn = methods.METHODS[name].build(env)
        h, w = leaf(p.hidden.to(DEV)), leaf(p.weight.to(DEV))
        for _ in range(2):
            loss = fn(h, w, p.target.to(DEV))
            assert speculation.route_of(loss) == want, name
            loss.backward()


# -- the gated kernels on their own ------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
def test_gated_kernels_do_nothing_on_a_zero_flag(dtype):
    gen = torch.Generator().manual_seed(0)
    k, v, d = 45, 70, 37
    p = torch.randn(k, v, generator=gen).to(dtype).to(DEV)
    x = torch.randn(k, d, generator=gen).to(dtype).to(DEV)
    dw, db = torch.randn(v, d, generator=gen).to(DEV), torch.randn(v, generator=gen).to(DEV)
    dw0, db0 = dw.clone(), db.clone()
    off, on = (torch.tensor([f], dtype=torch.int32, device=DEV) for f in (0, 1))
    kernels.gated_weight_grad_(dw, db, p, x, off)
    kernels.gated_scale_(dw, torch.zeros((), device=DEV), off)
    assert torch.equal(dw, dw0) and torch.equal(db, db0)
    kernels.gated_weight_grad_(dw, db, p, x, on)
    want = dw0.double() + p.double().t() @ x.double()
    assert rel_err(dw, want) < 1e-6 and rel_err(db, db0.double() + p.double().sum(0)) < 1e-6
    dw[3, 4] = math.nan
    kernels.gated_scale_(dw, torch.zeros((), device=DEV), on)
    assert torch.isnan(dw[3, 4]) and (dw.nan_to_num() == 0).all()
    gz = torch.full((k, v), 7.0, dtype=dtype, device=DEV)
    ones = torch.ones(k, device=DEV)
    kernels.logits_tiles(x, p.t().contiguous()[:v], None, torch.zeros(k, dtype=torch.int32, device=DEV), p=gz,
                         rows=(ones, ones, ones * 0.5), coef=(ones, None, -ones, None), flag=off)
    assert (gz == 7.0).all(), "a zero flag leaves the gradient buffer untouched"
    g = torch.randn(k, generator=gen).to(DEV)
    assert torch.equal(kernels.row_scale_cast(dw0, torch.ones(v, device=DEV), dtype), dw0.to(dtype))
    got = kernels.row_scale_cast(x.float(), g, dtype)
    assert torch.equal(got, (x.float() * g[:, None]).to(dtype))


def test_split_upstream():
    keep = torch.tensor([False, True, True, False, True])
    u, c, gk = speculation.split_upstream(torch.tensor([9.0, 2.0, 2.0, math.nan, 2.0]), keep)
    assert bool(u) and c == 2.0 and torch.equal(gk, torch.tensor([0.0, 2.0, 2.0, 0.0, 2.0]))
    for g in ([9.0, 2.0, 2.5, 0.0, 2.0], [0.0, math.nan, math.nan, 0.0, math.nan],
              [0.0, math.inf, math.inf, 0, math.inf]):
        assert not bool(speculation.split_upstream(torch.tensor(g), keep)[0]), g
    u, c, _ = speculation.split_upstream(torch.tensor([1.0, 2.0]), torch.tensor([False, False]))
    assert bool(u) and c == 0.0
    flags = speculation.block_flags(torch.tensor([0.0, 0.0, 1.0, 0.0, math.nan]), 2)
    assert flags.tolist() == [0, 1, 1]


# -- (f): a group never speculates ---------------------------------------------------------------------------------

def _group_main(rank, world):
    import torch.distributed as dist

    speculation.reset()
    sizes = [50, 40]
    p = make_problem(40, 16, sum(sizes), dtype=torch.float32, bias=True, vocab_size=sum(sizes) - 3, ignore_frac=0.2,
                     reduction="none", seed=7)
    start = sum(sizes[:rank])
    w, b = leaf(p.weight[start:start + sizes[rank]]), leaf(p.bias[start:start + sizes[rank]])
    g = uniform(p, 0.5)
    out = []
    for entry in ("ce", "logprob", "ce", "logprob"):
        h = leaf(p.hidden)
        w.grad = b.grad = None
        kw = dict(group=dist.group.WORLD, vocab_size=p.vocab_size, backend="triton")
        if entry == "ce":
            y = vpce.linear_cross_entropy(h, w, p.target, b, reduction="none", label_smoothing=0.1, **kw)
            ref = reference(p.hidden, p.weight, p.target, p.bias, grad=g, vocab_size=p.vocab_size,
                            reduction="none", label_smoothing=0.1)
            want = (ref.loss, ref.dhidden, ref.dweight, ref.dbias)
        else:
            y = vpce.linear_log_probs(h, w, p.target, b, **kw)
            logp, _, ref = reference_log_probs(p.hidden, p.weight, p.target, p.bias, g_logp=g,
                                               vocab_size=p.vocab_size)
            want = (logp, ref.dhidden, ref.dweight, ref.dbias)
        route = speculation.route_of(y)
        y.backward(g.float())
        rows = slice(start, start + sizes[rank])
        errs = [rel_err(y, want[0]), rel_err(h.grad, want[1]), rel_err(w.grad, want[2][rows]),
                rel_err(b.grad, want[3][rows])]
        out.append((entry, route, max(errs)))
    return out


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU (the interpreter)")
def test_a_group_never_speculates():
    for rank, res in enumerate(run_ranks(_group_main, 2, timeout=300)):
        for entry, route, err in res:
            assert route == "lean", f"rank {rank} {entry}: route {route}"
            assert err <= 2e-5, f"rank {rank} {entry}: rel err {err:.2e}"


# ---------------------------------------------------------------------------------------------------- GPU only

gpu_only = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


@gpu_only
@pytest.mark.parametrize("entry", ["ce", "logprob"])
def test_gpu_no_host_sync(entry):
    """``torch.cuda.set_sync_debug_mode("error")`` around every call of a site: the lean first call, the
    speculative calls (uniform, then a misprediction), and the lean call after it; the decision is read from
    pinned memory behind an event (synchronized between calls here, outside the checked region, so that each
    backward's outcome is known to the next forward)."""
    p = make_problem(1000, 64, 3001, dtype=torch.bfloat16, bias=True, ignore_frac=0.1, reduction="none", seed=2)
    site = Site(p, entry)
    routes = []
    for g in (uniform(p, 1.0), uniform(p, 0.5), per_token(p), uniform(p, 1.0)):
        h = leaf(p.hidden.cuda())
        t, gg = p.target.cuda(), g.float().cuda()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            if entry == "ce":
                out = vpce.linear_cross_entropy(h, site.w, t, site.b, reduction="none", vocab_start=0,
                                                vocab_size=p.vocab_size)
            else:
                out = vpce.linear_log_probs(h, site.w, t, site.b, vocab_start=0, vocab_size=p.vocab_size)
            routes.append(speculation.route_of(out))
            out.backward(gg)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
    assert routes == ["lean", "speculative", "speculative", "lean"], routes


@gpu_only
@pytest.mark.parametrize("entry", ["ce", "logprob"])
def test_gpu_large_exact_and_bitwise_deterministic(entry, sizing):
    """bf16 on a GPU with several chunks (and gated blocks): a uniform call and a misprediction, each against the
    float64 oracle with torch eager's error bar (as tests/backends/test_triton_backend.py), and each twice: bitwise equal."""
    sizing(fast_p_gib=0.05)  # about 1300 tokens per chunk: 7 chunks
    p = make_problem(9000, 512, 20011, dtype=torch.bfloat16, bias=True, ignore_frac=0.1, scale=3.0,
                     reduction="none", seed=4)
    site = Site(p, entry)
    gpu = lambda x: x.cuda()  # noqa: E731
    for name, g in (("uniform", uniform(p, 1.0 / 9000)), ("per-token", per_token(p))):
        runs = []
        for _ in range(2):
            site(uniform(p, 1.0))
            torch.cuda.synchronize()  # the uniform history is read before the next call
            route, got = site(g)
            assert route == "speculative", name
            runs.append(got)
        for x, y in zip(*runs):
            assert torch.equal(x, y), f"{name}: not bitwise deterministic"
        args = tuple(map(gpu, (p.hidden, p.weight, p.target, p.bias)))
        if entry == "ce":
            ref = reference(*args, grad=gpu(g), vocab_size=p.vocab_size, reduction="none")
            want = (ref.loss, ref.dhidden, ref.dweight, ref.dbias)
            e = torch_eager(*args, grad=gpu(g), vocab_size=p.vocab_size, reduction="none")
            base = (e.loss, e.dhidden, e.dweight, e.dbias)
        else:
            logp, _, ref = reference_log_probs(*args, g_logp=gpu(g), vocab_size=p.vocab_size)
            want = (logp, ref.dhidden, ref.dweight, ref.dbias)
            h, w, t, b = args
            base = eager_log_probs(h, w, b, t, gpu(g), p.vocab_size)
        for i, (what, x, r) in enumerate(zip(("out", "dX", "dW", "db"), runs[0], want)):
            r = r.cpu()
            e = rel_err(base[i].cpu(), r)
            tol = max(1e-5, 4 * e + 1e-6) if what == "out" else 1.25 * e + 1e-6
            err = rel_err(x, r)
            assert err <= tol, f"{name} {what}: rel err {err:.3e} > {tol:.3e}"


@gpu_only
def test_gpu_auto_falls_back_to_lean_where_memory_is_short(monkeypatch):
    p = make_problem(512, 64, 1001, dtype=torch.bfloat16, ignore_frac=0.1, reduction="none", seed=5)
    site = Site(p, "ce")
    g = uniform(p, 1.0)
    assert site(g)[0] == "lean"
    torch.cuda.synchronize()
    with monkeypatch.context() as m:
        m.setattr(routing, "_fits", lambda need, device: False)
        assert site(g)[0] == "lean", "the speculative route holds the fast route's buffers: not where they do not fit"
    torch.cuda.synchronize()
    assert site(g)[0] == "speculative"


@gpu_only
@pytest.mark.parametrize("entry", ["ce", "logprob"])
def test_gpu_cuda_graph_replays_the_speculative_route(entry):
    """A training step captured on the speculative route replays exactly for any upstream gradient: uniform (held
    gradients scaled) and per-token (the gated recompute), bitwise equal to the same steps run eagerly."""
    p = make_problem(2048, 256, 8003, dtype=torch.bfloat16, bias=True, ignore_frac=0.1, reduction="none", seed=6)
    x, y = p.hidden.cuda().requires_grad_(), p.target.cuda()
    w, b = p.weight.cuda().requires_grad_(), p.bias.cuda().requires_grad_()
    g_static = torch.zeros(y.shape, device="cuda")
    g_uniform, g_tokens = uniform(p, 0.25).float().cuda(), per_token(p).float().cuda()

    def step():
        if entry == "ce":
            out = vpce.linear_cross_entropy(x, w, y, b, reduction="none", vocab_start=0, vocab_size=p.vocab_size)
        else:
            out = vpce.linear_log_probs(x, w, y, b, vocab_start=0, vocab_size=p.vocab_size)
        out.backward(g_static)
        return speculation.route_of(out)

    def run(g):
        x.grad = w.grad = b.grad = None
        g_static.copy_(g)
        route = step()
        torch.cuda.synchronize()
        return route, [t.grad.clone() for t in (x, w, b)]

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # the kernels compiled and a uniform history, outside the capture
            run(g_uniform)
        want = {"uniform": run(g_uniform), "per-token": run(g_tokens)}
        assert [r for r, _ in want.values()] == ["speculative", "speculative"]
        assert run(g_uniform)[0] == "lean"  # after the per-token backward; it reports a uniform one again
        assert run(g_uniform)[0] == "speculative"  # (a capture does not poll: the decision must be made already)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    x.grad = w.grad = b.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        route = step()
    assert route == "speculative"
    for name, g in (("uniform", g_uniform), ("per-token", g_tokens)):
        g_static.copy_(g)
        graph.replay()
        torch.cuda.synchronize()
        for what, got, ref in zip(("dX", "dW", "db"), (x.grad, w.grad, b.grad), want[name][1]):
            assert torch.equal(got, ref), f"{name}: {what} replayed differs from the eager step"


# -- deterministic mode: the route, and so the bits, follow the inputs alone -------------------------------------

@pytest.fixture
def deterministic(monkeypatch):
    """``torch.use_deterministic_algorithms(True)`` for one test (with the cuBLAS workspace setting torch asks for
    under that mode), restored after."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(was)


def assert_same_bits(runs, what):
    for i, (_, got) in enumerate(runs[1:], 1):
        for name, x, y in zip(("out", "dX", "dW", "db"), got, runs[0][1]):
            assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), \
                f"{what}: call {i}'s {name} differs from the first call's ({describe(x, y)})"


@pytest.mark.parametrize("entry", ["ce", "logprob"])
@pytest.mark.parametrize("kind", ["uniform", "per-token"])
def test_deterministic_mode_bits_follow_the_inputs(entry, kind, deterministic):
    """Under deterministic mode every call at a site takes the same route whatever the site's history: 5 calls with
    the same inputs and upstream gradient, then one after a call with the other kind of gradient, give the same
    bits, and they are exact. (Outside the mode a site's first call took the lean route and the next ones the
    speculative route, which rounds differently.)"""
    p = problem(torch.float32)
    g, other = (uniform(p, 0.25), per_token(p)) if kind == "uniform" else (per_token(p), uniform(p, 1.0))
    site = Site(p, entry)
    runs = [site(g) for _ in range(5)]
    site(other)
    runs.append(site(g))
    assert [r for r, _ in runs] == ["speculative"] * 6
    assert_same_bits(runs, kind)
    site.check(runs[0][1], g, kind)
    assert speculation._SITES == {}, "deterministic mode keeps no history"


@gpu_only
@pytest.mark.parametrize("entry", ["ce-none", "logprob", "ce-mean"])
@pytest.mark.parametrize("kind", ["uniform", "per-token"])
@pytest.mark.parametrize("sync", [False, True], ids=["no-sync", "sync"])
def test_gpu_deterministic_mode_repeated_calls(entry, kind, sync, deterministic, sizing):
    """bf16 on a GPU, several chunks: 5 calls at one call site under deterministic mode, with and without a device
    sync between steps, bitwise equal (outputs and gradients), for uniform and per-token upstream gradients
    (``mean``: a scalar upstream gradient, and a per-token ``token_weight``)."""
    sizing(fast_p_gib=0.05)  # several chunks
    p = make_problem(4000, 256, 20011, dtype=torch.bfloat16, bias=True, ignore_frac=0.1, scale=3.0,
                     reduction="none", seed=9)
    g = uniform(p, 1.0 / 4000) if kind == "uniform" else per_token(p)
    if entry == "ce-mean":
        tw = per_token(p, seed=3).abs().float().cuda() if kind == "per-token" else None
        w, b = leaf(p.weight.cuda()), leaf(p.bias.cuda())

        def call():
            h = leaf(p.hidden.cuda())
            w.grad = b.grad = None
            out = vpce.linear_cross_entropy(h, w, p.target.cuda(), b, vocab_size=p.vocab_size, token_weight=tw)
            (out * 0.75).backward()
            return speculation.route_of(out), [x.detach().cpu() for x in (out, h.grad, w.grad, b.grad)]
    else:
        site = Site(p, "ce" if entry == "ce-none" else "logprob")
        call = lambda: site(g)  # noqa: E731
    runs = []
    for _ in range(5):
        runs.append(call())
        if sync:
            torch.cuda.synchronize()
    assert len({r for r, _ in runs}) == 1, [r for r, _ in runs]
    assert_same_bits(runs, f"{entry} {kind}")
