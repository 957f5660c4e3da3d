"""Post-training losses (``vpce.post_training``): ``linear_log_prob_loss`` in its three scopes, GRPO (every loss type,
token and sequence importance sampling, KL, clip-higher, two-sided clipping, [B] and [B, T] advantages) and DPO
(sigmoid, hinge, IPO; the reference as log-probs or as a head), against float64 torch on materialized logits with
TRL 1.16's formulas written out here (``GRPOTrainer._compute_loss``, ``DPOTrainer._compute_loss``). Both backends
(Triton through the interpreter on CPU), one process and 2-3 gloo ranks with uneven shards; every rank must return
the same bytes.
"""

import pytest
import torch
import torch.distributed as dist

import vpce
from distributed import run_ranks
from vpce.reference import rel_err, trl_dpo, trl_grpo

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
# (backend, dtype, loss tolerance, gradient tolerance)
BACKENDS = [("torch", torch.float64, 1e-10, 1e-10), ("triton", torch.float32, 2e-5, 5e-5)]
B, T, D, V = 4, 23, 20, 157


def problem(seed=0, b=B, t=T, d=D, v=V):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(b, t, d, generator=gen, dtype=torch.float64)
    w = torch.randn(v, d, generator=gen, dtype=torch.float64) * 0.4
    bias = torch.randn(v, generator=gen, dtype=torch.float64) * 0.1
    y = torch.randint(0, v, (b, t), generator=gen)
    prompt = torch.randint(1, t // 3, (b,), generator=gen)
    pad = torch.randint(0, t // 4, (b,), generator=gen)
    cols = torch.arange(t)
    y = torch.where((cols < prompt[:, None]) | (cols >= t - pad[:, None]), -100, y)
    return h, w, bias, y, gen


def materialized(h, w, bias, y, temperature=1.0):
    """float64 per-token log-probs and entropy from the whole logits (0 at ignored tokens)."""
    z = (h.double() @ w.double().t() + bias.double()) / temperature
    lq = z.log_softmax(-1)
    keep = y != -100
    logp = torch.where(keep, lq.gather(-1, y.clamp(min=0)[..., None])[..., 0], 0)
    ent = torch.where(keep, -(lq.exp() * lq).sum(-1), 0)
    return logp, ent


def leaves(dtype, *xs):
    return [x.to(DEV, dtype).detach().clone().requires_grad_() for x in xs]


def check(what, got, want, tol):
    err = rel_err(got.detach().cpu().double(), want.detach().double())
    assert err <= tol, f"{what}: rel err {err:.2e} > {tol:.0e}"


# -- the general form ----------------------------------------------------------------------------------------------

def loss_token(logp, entropy, adv):
    return -logp * adv + 0.05 * entropy * entropy


def loss_sequence(logp, entropy, adv):  # a sequence-level term: each row's mean log-prob times its advantage
    return -(logp.sum(-1) / (logp != 0).sum(-1).clamp(min=1)) * adv[:, 0] - 0.01 * entropy.sum(-1)


def loss_batch(logp, entropy, adv):  # a scalar of everything at once
    return -(logp * adv).sum() / (logp != 0).sum().clamp(min=1) + torch.logsumexp(entropy.flatten(), 0) * 0.1


@pytest.mark.parametrize("backend,dtype,tol,gtol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("scope,fn", [("token", loss_token), ("sequence", loss_sequence), ("batch", loss_batch)],
                         ids=["token", "sequence", "batch"])
@pytest.mark.parametrize("budget", ["auto", "lean"])
def test_general_form(backend, dtype, tol, gtol, scope, fn, budget):
    h, w, bias, y, gen = problem(seed=1)
    adv = torch.randn(B, T, generator=gen, dtype=torch.float64)
    hx, wx, bx = leaves(dtype, h, w, bias)
    loss, logp, ent = vpce.linear_log_prob_loss(hx, wx, y.to(DEV), fn, bx, inputs={"adv": adv.to(DEV, dtype)},
                                                scope=scope, use_entropy=True, temperature=0.7, backend=backend,
                                                memory_budget=budget, return_outputs=True)
    assert loss.shape == () and loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    (loss * 1.5).backward()
    hr, wr, br = (x.clone().requires_grad_() for x in (h, w, bias))
    lp_r, ent_r = materialized(hr, wr, br, y, temperature=0.7)
    out = fn(lp_r, ent_r, adv)
    want = torch.where(y != -100, out, 0).sum() if out.shape == lp_r.shape else out.sum()
    (want * 1.5).backward()
    check("loss", loss, want, tol)
    check("log_probs", logp, lp_r, tol)
    check("entropy", ent, ent_r, tol)
    for name, x, r in (("dX", hx, hr), ("dW", wx, wr), ("db", bx, br)):
        check(name, x.grad, r.grad, gtol)


def test_general_form_per_token_result_dropped_and_frozen_weight():
    """A per-token result is dropped at ignored tokens even where loss_fn is not 0 there; a frozen weight gives only
    dX; no gradient needed gives the loss alone."""
    h, w, bias, y, _ = problem(seed=2)
    hx = h.clone().requires_grad_()
    loss = vpce.linear_log_prob_loss(hx, w, y, lambda lp, ent: lp * 0 + 1.0, backend="torch")
    assert float(loss) == float((y != -100).sum())
    loss = vpce.linear_log_prob_loss(hx, w, y, lambda lp, ent: -lp, backend="torch")
    loss.backward()
    hr = h.clone().requires_grad_()
    (-materialized(hr, w, torch.zeros(V, dtype=torch.float64), y)[0].sum()).backward()
    check("dX", hx.grad, hr.grad, 1e-10)
    with torch.no_grad():
        got = vpce.linear_log_prob_loss(h, w, y, lambda lp, ent: -lp, backend="torch")
    check("no-grad loss", got, loss, 1e-12)


def test_general_form_bad_arguments():
    h, w, bias, y, _ = problem()
    fn = lambda lp, ent: -lp  # noqa: E731
    with pytest.raises(TypeError, match="loss_fn"):
        vpce.linear_log_prob_loss(h, w, y, "nope")
    with pytest.raises(ValueError, match="scope"):
        vpce.linear_log_prob_loss(h, w, y, fn, scope="row")
    with pytest.raises(ValueError, match="inputs\\['adv'\\]"):
        vpce.linear_log_prob_loss(h, w, y, fn, inputs={"adv": torch.zeros(B)})
    with pytest.raises(ValueError, match="target: expected \\[B, T\\]"):
        vpce.linear_log_prob_loss(h.reshape(-1, D), w, y.reshape(-1), fn, scope="sequence")
    with pytest.raises(TypeError, match="loss_fn: expected it to return a torch.Tensor"):
        vpce.linear_log_prob_loss(h, w, y, lambda lp, ent: 1.0, backend="torch")


# -- GRPO: TRL 1.16 GRPOTrainer._compute_loss, written out -----------------------------------------------------------

GRPO_CASES = {  # id: keyword arguments of linear_grpo_loss
    "dapo": dict(loss_type="dapo", beta=0.04),
    "grpo-seq-adv": dict(loss_type="grpo", adv="B"),
    "bnpo-clip-higher": dict(loss_type="bnpo", epsilon_high=0.28),
    "dr_grpo-max-len": dict(loss_type="dr_grpo", max_completion_length=30, beta=0.1),
    "dapo-two-sided": dict(loss_type="dapo", delta=1.3, num_items_in_batch=70),
    "cispo": dict(loss_type="cispo", epsilon_high=1.2),
    "gspo": dict(loss_type="dapo", importance_sampling_level="sequence", adv="B"),
    "gspo-token-adv-kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04),
    "current-policy": dict(loss_type="dapo", old=False),
}


def grpo_inputs(case: dict, seed=3):
    h, w, bias, y, gen = problem(seed=seed)
    adv = torch.randn(B, generator=gen, dtype=torch.float64) if case.get("adv") == "B" else \
        torch.randn(B, T, generator=gen, dtype=torch.float64)
    logp, _ = materialized(h, w, bias, y)
    # old log-probs off by up to +-0.6 per token and +-0.5 per sequence: ratios outside [1 - eps, 1 + eps] on many
    # tokens and sequences (active clipping at both levels)
    shift = torch.tensor([-0.5, 0.5, -0.5, 0.5], dtype=torch.float64)[:, None]
    noise = (torch.rand(B, T, generator=gen, dtype=torch.float64) - 0.5) * 1.2
    old = logp + noise + shift if case.get("old", True) else None
    ref = logp + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3
    return h, w, bias, y, adv, old, ref


def grpo_kwargs(case: dict):
    """``linear_grpo_loss``'s keywords of a case; the KL term without the importance ratio (``trl_grpo``'s; the
    bias-corrected one: tests/post_training/test_rl_grpo.py)."""
    return {"use_bias_correction_kl": False, **{k: v for k, v in case.items() if k not in ("adv", "old")}}


def grpo_reference(case, h, w, bias, y, adv, old, ref):
    hr, wr, br = (x.clone().requires_grad_() for x in (h, w, bias))
    logp, ent = materialized(hr, wr, br, y)
    mask = (y != -100).double()
    kw = grpo_kwargs(case)
    out = trl_grpo(logp, old, ref, adv, mask, ent.detach(), beta=kw.get("beta", 0.0), eps_low=0.2,
                   eps_high=kw.get("epsilon_high", 0.2), delta=kw.get("delta"), loss_type=kw["loss_type"],
                   level=kw.get("importance_sampling_level", "token"),
                   max_completion_length=kw.get("max_completion_length", T),
                   num_items_in_batch=kw.get("num_items_in_batch", mask.sum()))
    out[0].backward()
    return out, (hr.grad, wr.grad, br.grad)


@pytest.mark.parametrize("backend,dtype,tol,gtol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("case", list(GRPO_CASES), ids=list(GRPO_CASES))
def test_grpo_matches_trl(backend, dtype, tol, gtol, case):
    c = GRPO_CASES[case]
    h, w, bias, y, adv, old, ref = grpo_inputs(c)
    (loss, kl, clip, ent), grads = grpo_reference(c, h, w, bias, y, adv, old, ref)
    assert 0.02 < float(clip) < 0.9 or case == "current-policy", f"clipping must be active: {float(clip)}"
    hx, wx, bx = leaves(dtype, h, w, bias)
    to = lambda x: None if x is None else x.to(DEV, dtype)  # noqa: E731
    out = vpce.linear_grpo_loss(hx, wx, y.to(DEV), to(adv), bx, old_log_probs=to(old), ref_log_probs=to(ref),
                                backend=backend, **grpo_kwargs(c))
    assert isinstance(out, vpce.GRPOOutput) and not out.clip_ratio.requires_grad
    out.loss.backward()
    check("loss", out.loss, loss, tol)
    check("clip_ratio", out.clip_ratio, clip, tol)
    check("entropy", out.entropy, ent, tol)
    assert (out.kl is None) == (kl is None)
    if kl is not None:
        check("kl", out.kl, kl, tol)
    for name, x, r in zip(("dX", "dW", "db"), (hx, wx, bx), grads):
        check(name, x.grad, r, gtol)


def test_grpo_bad_arguments():
    h, w, bias, y, adv, old, ref = grpo_inputs({})
    with pytest.raises(ValueError, match="loss_type"):
        vpce.linear_grpo_loss(h, w, y, adv, loss_type="ppo")
    with pytest.raises(ValueError, match="importance_sampling_level"):
        vpce.linear_grpo_loss(h, w, y, adv, importance_sampling_level="batch")
    with pytest.raises(ValueError, match="advantages"):
        vpce.linear_grpo_loss(h, w, y, adv[:, :3])
    with pytest.raises(ValueError, match="ref_log_probs"):
        vpce.linear_grpo_loss(h, w, y, adv, beta=0.1)


# -- DPO: TRL 1.16 DPOTrainer._compute_loss, written out --------------------------------------------------------------

@pytest.mark.parametrize("backend,dtype,tol,gtol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo"])
@pytest.mark.parametrize("ref_as", ["log-probs", "head"])
def test_dpo_matches_trl(backend, dtype, tol, gtol, loss_type, ref_as):
    h, w, bias, y, gen = problem(seed=5)
    beta = 0.1 if loss_type != "hinge" else 0.02  # hinge active on some pairs, not all
    h_ref = torch.randn(B, T, 16, generator=gen, dtype=torch.float64)
    w_ref = torch.randn(V, 16, generator=gen, dtype=torch.float64) * 0.4
    ref_tok, _ = materialized(h_ref, w_ref, torch.zeros(V, dtype=torch.float64), y)
    ref_c, ref_r = ref_tok.sum(1).chunk(2)
    hr, wr, br = (x.clone().requires_grad_() for x in (h, w, bias))
    loss, cr, rr = trl_dpo(materialized(hr, wr, br, y)[0], ref_c, ref_r, (y != -100).double(), beta, loss_type)
    loss.backward()
    hx, wx, bx = leaves(dtype, h, w, bias)
    ref = dict(ref_hidden=h_ref.to(DEV, dtype), ref_weight=w_ref.to(DEV, dtype)) if ref_as == "head" else \
        dict(ref_chosen_log_probs=ref_c.to(DEV, dtype), ref_rejected_log_probs=ref_r.to(DEV, dtype))
    out = vpce.linear_dpo_loss(hx, wx, y.to(DEV), bias=bx, beta=beta, loss_type=loss_type, backend=backend, **ref)
    out.loss.backward()
    check("loss", out.loss, loss, tol)
    check("chosen_rewards", out.chosen_rewards, cr, tol)
    check("rejected_rewards", out.rejected_rewards, rr, tol)
    for name, x, r in (("dX", hx, hr), ("dW", wx, wr), ("db", bx, br)):
        check(name, x.grad, r.grad, gtol)


# -- vocab parallel: 2-3 gloo ranks, uneven shards ---------------------------------------------------------------

def _tp_post_training(rank, world, backend, sizes):
    dtype = torch.float64 if backend == "torch" else torch.float32
    start, rows = sum(sizes[:rank]), sizes[rank]
    g = dist.group.WORLD
    out = {}
    for case in ("dapo", "gspo-token-adv-kl", "cispo"):
        c = GRPO_CASES[case]
        h, w, bias, y, adv, old, ref = grpo_inputs(c)
        hx = h.to(dtype).requires_grad_()
        wx = w[start:start + rows].to(dtype).requires_grad_()
        bx = bias[start:start + rows].to(dtype).requires_grad_()
        to = lambda x: None if x is None else x.to(dtype)  # noqa: E731
        r = vpce.linear_grpo_loss(hx, wx, y, to(adv), bx, old_log_probs=to(old), ref_log_probs=to(ref),
                                  backend=backend, group=g, **grpo_kwargs(c))
        r.loss.backward()
        out[case] = [r.loss, r.clip_ratio, r.entropy, hx.grad, wx.grad, bx.grad]
    h, w, bias, y, gen = problem(seed=5)
    hx = h.to(dtype).requires_grad_()
    wx = w[start:start + rows].to(dtype).requires_grad_()
    ref_c = torch.randn(B // 2, generator=gen, dtype=torch.float64).to(dtype) - 30
    ref_r = torch.randn(B // 2, generator=gen, dtype=torch.float64).to(dtype) - 30
    r = vpce.linear_dpo_loss(hx, wx, y, ref_c, ref_r, backend=backend, group=g)
    r.loss.backward()
    out["dpo"] = [r.loss, r.chosen_rewards, hx.grad, wx.grad]
    return {k: [x.detach().numpy() for x in v] for k, v in out.items()}


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
@pytest.mark.parametrize("sizes", [[80, 77], [50, 31, 76]], ids=["2-ranks", "3-ranks"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_vocab_parallel(backend, sizes):
    tol, gtol = (1e-10, 1e-10) if backend == "torch" else (2e-5, 5e-5)
    results = run_ranks(_tp_post_training, len(sizes), backend, sizes, timeout=240)
    for key, got in results[0].items():
        for rank in range(1, len(sizes)):  # the loss, metrics and dX: the same bytes on every rank
            for i in (0, 1, 2):
                assert (results[rank][key][i] == got[i]).all(), f"{key}[{i}]: rank {rank} differs from rank 0"
    for case in ("dapo", "gspo-token-adv-kl", "cispo"):
        c = GRPO_CASES[case]
        h, w, bias, y, adv, old, ref = grpo_inputs(c)
        (loss, _, clip, ent), (dx, dw, db) = grpo_reference(c, h, w, bias, y, adv, old, ref)
        for rank, res in enumerate(results):
            got = [torch.from_numpy(x) for x in res[case]]
            s, n = sum(sizes[:rank]), sizes[rank]
            for name, x, r, t in (("loss", got[0], loss, tol), ("clip", got[1], clip, tol), ("entropy", got[2], ent, tol),
                                  ("dX", got[3], dx, gtol), ("dW", got[4], dw[s:s + n], gtol),
                                  ("db", got[5], db[s:s + n], gtol)):
                check(f"{case} rank {rank} {name}", x, r, t)
    h, w, bias, y, gen = problem(seed=5)
    ref_c = torch.randn(B // 2, generator=gen, dtype=torch.float64) - 30
    ref_r = torch.randn(B // 2, generator=gen, dtype=torch.float64) - 30
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, cr, _ = trl_dpo(materialized(hr, wr, torch.zeros(V, dtype=torch.float64), y)[0], ref_c, ref_r,
                          (y != -100).double(), 0.1, "sigmoid")
    loss.backward()
    for rank, res in enumerate(results):
        got = [torch.from_numpy(x) for x in res["dpo"]]
        s, n = sum(sizes[:rank]), sizes[rank]
        check(f"dpo rank {rank} loss", got[0], loss, tol)
        check(f"dpo rank {rank} chosen_rewards", got[1], cr, tol)
        check(f"dpo rank {rank} dX", got[2], hr.grad, gtol)
        check(f"dpo rank {rank} dW", got[3], wr.grad[s:s + n], gtol)


@pytest.mark.skipif(CUDA, reason="the hopper extra's facts stood in on the CPU interpreter")
@pytest.mark.parametrize("scope,fn,entropy,softcap", [
    ("token", lambda lp, ent, adv: -lp * adv + 0.3 * lp * lp, None, None),
    ("token", lambda lp, ent, adv: -lp * adv + 0.3 * lp * lp, None, 3.0),
    ("token", loss_token, "loss", None),
    ("token", lambda lp, ent, adv: -lp * adv, "output", None),
    ("sequence", lambda lp, ent, adv: -lp.sum(-1) * adv[:, 0], "output", 3.0)],
    ids=["token", "token-softcap", "token-entropy", "token-entropy-output", "sequence-entropy-output-softcap"])
@pytest.mark.parametrize("chunks", ["one", "several"])
def test_fused_form_finishes_as_the_cross_entropy(monkeypatch, sizing, scope, fn, entropy, softcap, chunks):
    """The fused form's fast route takes the cross-entropy's finish (``routing.finish_fast``): with the ``hopper``
    extra's facts stood in (this CPU has no sm_90 GPU), the logits GEMM's epilogue takes the statistics (a torch
    stand-in of quack's GEMM, counted) where the loss needs no statistic but the log-sum-exp and the target logit,
    and the last chunk's dW GEMM (with one chunk, dX's too) waits for backward (fp32 here, so torch's GEMM finishes
    it, counted). An entropy that ``loss_fn`` takes keeps the statistics pass; one that is only an output (GRPO's
    metric) comes from the gradient pass. Against the float64 oracle, with a soft cap and without."""
    from problems import stats_epilogue_stand_in
    from vpce import post_training, routing
    from vpce.backends import grads
    from vpce.backends.triton import softmax

    calls, deferred = [], []
    monkeypatch.setattr(routing, "extra_facts", lambda h, w: routing.Extra(gemms=True, epilogue=True))
    monkeypatch.setattr(softmax, "logits_with_stats", stats_epilogue_stand_in(calls))
    for name in ("add_product", "mm_out"):  # backward's GEMMs of what forward left (dW's last chunk, dX's one chunk)
        real = getattr(grads, name)
        monkeypatch.setattr(grads, name, lambda *a, real=real, name=name: deferred.append(name) or real(*a))
    if chunks == "several":
        sizing(fast_p_gib=1e-9, min_p_gib=1e-9)  # P chunks of the fewest tokens
    b, t, v = 8, 40, 160  # P's rows 16-byte aligned in fp32; several: chunks of 128 tokens (ROW_ALIGN), 3 of them
    h, w, _, y, gen = problem(seed=4, b=b, t=t, v=v)
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    hx, wx = leaves(torch.float32, h, w)
    args = post_training.LogProbLossArgs(loss_fn=fn, scope=scope, use_entropy=entropy == "loss",
                                         entropy_stats=entropy is not None, softcap=softcap)
    loss, logp, ent = post_training._log_prob_loss(hx, wx, y.to(DEV), None, args, backend="triton",
                                                   inputs={"adv": adv.to(DEV, torch.float32)})
    (loss * 1.5).backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    z = hr @ wr.t()
    z = z if softcap is None else softcap * torch.tanh(z / softcap)
    lq = z.log_softmax(-1)
    keep = y != -100
    lp_r = torch.where(keep, lq.gather(-1, y.clamp(min=0)[..., None])[..., 0], 0)
    ent_r = torch.where(keep, -(lq.exp() * lq).sum(-1), 0)
    out = fn(lp_r, ent_r, adv)
    want = torch.where(keep, out, 0).sum() if out.shape == lp_r.shape else out.sum()
    (want * 1.5).backward()
    check("loss", loss, want, 2e-5)
    check("log_probs", logp, lp_r, 2e-5)
    if entropy is not None:
        check("entropy", ent, ent_r, 2e-5)
    for name, x, r in (("dX", hx, hr), ("dW", wx, wr)):
        check(name, x.grad, r.grad, 5e-5)
    epilogue = entropy != "loss"
    assert sum(rows for rows, _ in calls) == (b * t if epilogue else 0), calls
    assert len(calls) == (0 if not epilogue else 1 if chunks == "one" else 3), calls
    assert deferred == (["add_product", "mm_out"] if chunks == "one" else ["add_product"]), deferred


def test_exported():
    for name in ("linear_log_prob_loss", "linear_grpo_loss", "GRPOOutput", "linear_dpo_loss", "DPOOutput"):
        assert name in vpce.__all__ and hasattr(vpce, name)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("scope,budget", [("token", "auto"), ("sequence", "auto"), ("token", "lean")])
def test_metric_outputs_from_the_fused_pass(backend, scope, budget):
    """The ``top1`` / ``mean_logits`` outputs of the fused pass (``linear_dpo_loss(return_logit_metrics=True)``,
    DPO's logged metrics in ``vpce.integrations.trl``): ``linear_log_probs``' ``is_top1`` and ``mean_logits``, on
    the fused route and the two-pass form, in the DPO layout."""
    from vpce import post_training

    gen = torch.Generator().manual_seed(3)
    h, w, b = torch.randn(4, 10, 16, generator=gen), torch.randn(50, 16, generator=gen) * 0.5, torch.randn(50, generator=gen)
    t = torch.randint(0, 50, (4, 10), generator=gen)
    t[0, :3] = -100
    t[1, 4:] = (h[1, 4:] @ w.T + b).argmax(-1)  # some top-1 tokens
    if backend == "triton" and torch.cuda.is_available():  # the interpreter runs only without CUDA (conftest)
        h, w, b, t = (x.cuda() for x in (h, w, b, t))
    args = dict(temperature=0.7, softcap=4.0, backend=backend, memory_budget=budget)
    want = vpce.linear_log_probs(h, w, t, b, return_entropy=True, return_top1=True, return_mean_logits=True,
                                 temperature=0.7, softcap=4.0, backend="torch")
    hl = h.clone().requires_grad_()
    fused = post_training.LogProbLossArgs(loss_fn=lambda lp, e: 0.3 * lp, scope=scope, top1=True, mean_logits=True,
                                          temperature=0.7, softcap=4.0, memory_budget=budget)
    loss, logp, _, top1, mean_z = post_training._log_prob_loss(hl, w, t, b, fused, backend=backend)
    loss.backward()
    assert top1.dtype == torch.bool and top1.any() and torch.equal(top1, want[2])
    torch.testing.assert_close(mean_z, want[3], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logp, want[0], rtol=1e-5, atol=1e-5)
    if scope == "sequence":
        zeros = torch.zeros(2, device=h.device)
        out, logp, ent, top1, mean_z = vpce.linear_dpo_loss(h, w, t, zeros, zeros, b, return_outputs=True,
                                                            return_logit_metrics=True, **args)
        for name, got, ref in (("log_probs", logp, want[0]), ("entropy", ent, want[1]),
                               ("mean_logits", mean_z, want[3])):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5, msg=name)
        assert torch.equal(top1, want[2])
