"""``vpce.linear_grpo_loss`` beyond the basic loss types: TRL 1.16's bias-corrected KL (its default), the vLLM
importance-sampling correction in all four modes, SAPO, VESPO, LUSPO, the off-policy sequence mask, the entropy
bonus and ``top_entropy_quantile`` (one process, and over the tokens of every rank of a group). The reference is
``GRPOTrainer._compute_loss`` written out on float64 materialized logits, calling TRL's own static methods
(``get_off_policy_mask``, ``get_gamma_weights``) where TRL has them. Both backends (Triton through the interpreter
on CPU, fp32), 1-2 gloo ranks.
"""

import math

import pytest
import torch
import torch.distributed as dist

import vpce
from distributed import cpu_triton, run_ranks
from test_post_training import B, CUDA, DEV, T, V, check, leaves, materialized, problem

trl = pytest.importorskip("trl", minversion="1.16")

BACKENDS = [("torch", torch.float64, 1e-10, 1e-10), ("triton", torch.float32, 2e-5, 5e-5)]


def is_ratio_trl(old, sampling, mask, mode, clip_min, clip_max):
    """TRL 1.16's vLLM correction (``_generate_and_score_completions``), written out."""
    diff = torch.nan_to_num((old - sampling) * mask, nan=0.0)
    if mode in ("sequence_mask", "sequence_truncate"):
        diff = diff.sum(dim=-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode in ("sequence_truncate", "token_truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    lo = clip_min if clip_min is not None else -math.inf
    hi = clip_max if clip_max is not None else math.inf
    return ratio.masked_fill((ratio < lo) | (ratio > hi), value=0.0)


def trl_grpo_loss(logp, ent, mask, adv, old, ref, c, sampling=None, is_ratio=None, every_entropy=None):
    """``GRPOTrainer._compute_loss``'s loss (one process, no accumulation; ``use_vllm`` where ``is_ratio`` is
    given), written out. ``every_entropy``: the entropies of the tokens of every rank (TRL's gather)."""
    from trl import GRPOTrainer

    loss_type, level, beta = c["loss_type"], c.get("importance_sampling_level", "token"), c.get("beta", 0.0)
    eps_low, eps_high = 0.2, c.get("epsilon_high", 0.2)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    entropy_mask = None
    if c.get("top_entropy_quantile", 1.0) < 1.0:
        gathered = ent[mask.bool()] if every_entropy is None else every_entropy
        thr = torch.quantile(gathered, 1 - c["top_entropy_quantile"])
        entropy_mask = ((ent * mask) >= thr) & mask.bool()
    old = logp.detach() if old is None else old
    if c.get("off_policy_mask_threshold") is not None:
        opm = GRPOTrainer.get_off_policy_mask(adv, logp, old if sampling is None else sampling, mask,
                                              c["off_policy_mask_threshold"])
    log_ratio = logp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    if beta != 0.0:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if c.get("use_bias_correction_kl", True):
            kl = kl * coef_1
    if loss_type == "cispo":
        per = -torch.clamp(coef_1, max=eps_high).detach() * adv * logp
    elif loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        per = -torch.min(coef_1 * adv, coef_2 * adv)
    elif loss_type == "sapo":
        temps = torch.where(adv > 0, 1.0, 1.05)
        per = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * adv
    else:
        phi = GRPOTrainer.get_gamma_weights(advantages=adv, log_ratio_per_token=log_ratio, mask=mask,
                                            importance_sampling_ratio=is_ratio)
        per = -phi * adv * logp
    if c.get("off_policy_mask_threshold") is not None:
        per = per * opm
    if entropy_mask is not None:
        per = per * entropy_mask
    if is_ratio is not None and loss_type != "vespo":
        per = per * is_ratio
    if beta != 0.0:
        per = per + beta * kl
    if loss_type in ("grpo", "sapo"):
        loss = ((per * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per * mask).sum() / (per.size(0) * T)
    elif loss_type == "luspo":
        loss = (per * mask).sum(-1).mean()
    else:
        loss = (per * mask).sum() / mask.sum().clamp(min=1.0)
    if c.get("entropy_coef", 0.0) != 0.0:
        eff = mask if entropy_mask is None else mask * entropy_mask
        loss = loss - c["entropy_coef"] * (ent * eff).sum() / eff.sum().clamp(min=1.0)
    kl_metric = None if beta == 0.0 else (kl * mask).sum() / mask.sum()
    return loss, kl_metric


CASES = {
    "dapo-kl": dict(loss_type="dapo", beta=0.04),  # TRL's default KL: bias-corrected
    "gspo-kl": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.04, adv="B"),
    "token_truncate": dict(loss_type="dapo", beta=0.04, is_mode="token_truncate", clip=(0.5, 1.3)),
    "token_mask": dict(loss_type="bnpo", is_mode="token_mask", clip=(0.6, 1.4)),
    "sequence_truncate": dict(loss_type="grpo", is_mode="sequence_truncate", clip=(None, 2.0)),
    "sequence_mask": dict(loss_type="dapo", beta=0.02, is_mode="sequence_mask", clip=(0.8, 1.5)),
    "sapo": dict(loss_type="sapo", beta=0.04, is_mode="token_truncate", clip=(None, 1.5)),
    "vespo": dict(loss_type="vespo", is_mode="token_mask", clip=(0.8, 1.3)),
    "luspo-seq": dict(loss_type="luspo", importance_sampling_level="sequence", adv="B"),
    "off-policy-mask": dict(loss_type="dapo", off_policy_mask_threshold=0.05, sampling=True),
    "entropy-coef": dict(loss_type="dr_grpo", entropy_coef=0.05),
    "top-entropy": dict(loss_type="dapo", top_entropy_quantile=0.3, entropy_coef=0.05, beta=0.04),
    "top-entropy-gspo": dict(loss_type="grpo", importance_sampling_level="sequence", top_entropy_quantile=0.5,
                             is_mode="sequence_truncate", clip=(None, 2.0), adv="B"),
}
TRITON_CASES = ("dapo-kl", "token_mask", "sequence_mask", "vespo", "off-policy-mask", "top-entropy")


def inputs_of(c, seed=3, b=B):
    h, w, bias, y, gen = problem(seed=seed, b=b)
    adv = torch.randn(b, generator=gen, dtype=torch.float64) if c.get("adv") == "B" else \
        torch.randn(b, T, generator=gen, dtype=torch.float64)
    logp, _ = materialized(h, w, bias, y)
    mask = (y != -100).double()
    shift = torch.tensor([-0.5, 0.5] * (b // 2), dtype=torch.float64)[:, None]
    old = logp + (torch.rand(b, T, generator=gen, dtype=torch.float64) - 0.5) * 1.2 + shift
    ref = logp + torch.randn(b, T, generator=gen, dtype=torch.float64) * 0.3
    sampling = old + (torch.rand(b, T, generator=gen, dtype=torch.float64) - 0.5) * 0.8
    extra = {}
    if c.get("is_mode"):
        lo, hi = c["clip"]
        sampling[0, T // 2] = float("nan")  # a token the sampler could not score: ratio 1
        extra["importance_sampling_ratio"] = is_ratio_trl(old, sampling, mask, c["is_mode"], lo, hi)
    if c.get("sampling"):
        extra["sampling_log_probs"] = sampling
    return h, w, bias, y, adv, old, ref, extra


def kwargs_of(c):
    skip = ("adv", "is_mode", "clip", "sampling")
    return {k: v for k, v in c.items() if k not in skip}


def reference(c, h, w, bias, y, adv, old, ref, extra, every_entropy=None):
    hr, wr, br = (x.clone().requires_grad_() for x in (h, w, bias))
    logp, ent = materialized(hr, wr, br, y)
    loss, kl = trl_grpo_loss(logp, ent, (y != -100).double(), adv, old, ref, c,
                             sampling=extra.get("sampling_log_probs"),
                             is_ratio=extra.get("importance_sampling_ratio"), every_entropy=every_entropy)
    loss.backward()
    return loss, kl, (hr.grad, wr.grad, br.grad)


@pytest.mark.parametrize("backend,dtype,tol,gtol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("case", list(CASES))
def test_grpo_options_match_trl(backend, dtype, tol, gtol, case):
    if backend == "triton" and case not in TRITON_CASES:
        pytest.skip("the interpreter is slow: a subset on Triton")
    c = CASES[case]
    h, w, bias, y, adv, old, ref, extra = inputs_of(c)
    loss, kl, grads = reference(c, h, w, bias, y, adv, old, ref, extra)
    if "importance_sampling_ratio" in extra and c["is_mode"].endswith("mask"):
        r = extra["importance_sampling_ratio"]
        assert (r == 0).any() and (r != 0).any(), "the mask modes must drop some tokens and keep others"
    hx, wx, bx = leaves(dtype, h, w, bias)
    to = lambda x: x.to(DEV, dtype)  # noqa: E731
    out = vpce.linear_grpo_loss(hx, wx, y.to(DEV), to(adv), bx, old_log_probs=to(old), ref_log_probs=to(ref),
                                backend=backend, **{k: to(v) for k, v in extra.items()}, **kwargs_of(c))
    out.loss.backward()
    check("loss", out.loss, loss, tol)
    if kl is not None:
        check("kl", out.kl, kl, tol)
    for name, x, r in zip(("dX", "dW", "db"), (hx, wx, bx), grads):
        check(name, x.grad, r, gtol)


def test_bias_correction_kl_is_the_default_and_changes_the_gradient():
    c = dict(loss_type="dapo", beta=0.1)
    h, w, bias, y, adv, old, ref, _ = inputs_of(c)
    got = []
    for corrected in (True, False):
        hx = h.clone().requires_grad_()
        kw = {} if corrected else dict(use_bias_correction_kl=False)
        out = vpce.linear_grpo_loss(hx, w, y, adv, bias, old_log_probs=old, ref_log_probs=ref, beta=0.1,
                                    backend="torch", **kw)
        out.loss.backward()
        loss, _, grads = reference({**c, "use_bias_correction_kl": corrected}, h, w, bias, y, adv, old, ref, {})
        check(f"loss corrected={corrected}", out.loss, loss, 1e-10)
        check(f"dX corrected={corrected}", hx.grad, grads[0], 1e-10)
        got.append(hx.grad)
    assert (got[0] - got[1]).abs().max() > 1e-4


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_vllm_importance_sampling_ratio(mode):
    gen = torch.Generator().manual_seed(0)
    old, sampling = torch.randn(3, 7, generator=gen), torch.randn(3, 7, generator=gen) * 0.3
    sampling[1, 2] = float("nan")
    mask = (torch.rand(3, 7, generator=gen) > 0.3).float()
    for lo, hi in ((None, 3.0), (0.5, 2.0), (None, None)):
        if mode.endswith("truncate") and lo is None and hi is None:
            continue
        want = is_ratio_trl(old, sampling, mask, mode, lo, hi)
        got = vpce.vllm_importance_sampling_ratio(old, sampling, mask, mode=mode, clip_min=lo, clip_max=hi)
        assert got.shape == want.shape and torch.equal(got, want), (mode, lo, hi)
    with pytest.raises(ValueError, match="mode"):
        vpce.vllm_importance_sampling_ratio(old, sampling, mask, mode="tis")


def test_grpo_new_bad_arguments():
    c = dict(loss_type="vespo")
    h, w, bias, y, adv, old, ref, _ = inputs_of(c)
    with pytest.raises(ValueError, match="importance_sampling_ratio"):
        vpce.linear_grpo_loss(h, w, y, adv, loss_type="vespo", importance_sampling_ratio=torch.ones(B, 1))
    with pytest.raises(ValueError, match="importance_sampling_ratio"):
        vpce.linear_grpo_loss(h, w, y, adv, importance_sampling_ratio=torch.ones(B, 3))
    with pytest.raises(ValueError, match="top_entropy_quantile"):
        vpce.linear_grpo_loss(h, w, y, adv, top_entropy_quantile=1.5)
    with pytest.raises(TypeError, match="use_bias_correction_kl"):
        vpce.linear_grpo_loss(h, w, y, adv, use_bias_correction_kl=1)


# -- top_entropy_quantile over the tokens of every rank --------------------------------------------------------------

def _ranks_top_entropy(rank, world, backend, tp):
    """Data parallel (``tp=False``: each rank its own batch, rank 1's all padding on its last row) or vocab
    parallel (``tp=True``: the same batch, the vocab split), the quantile over every rank's tokens."""
    dtype = torch.float64 if backend == "torch" else torch.float32
    c = CASES["top-entropy"]
    h, w, bias, y, adv, old, ref, _ = inputs_of(c, seed=3 if tp else 10 + rank)
    if not tp and rank == 1:
        y[-1] = -100
    shard = {}
    if tp:
        rows = [80, V - 80][rank]
        start = 80 * rank
        w, bias = w[start:start + rows], bias[start:start + rows]
        shard = dict(group=dist.group.WORLD)
    hx, wx, bx = (x.to(dtype).requires_grad_() for x in (h, w, bias))
    out = vpce.linear_grpo_loss(hx, wx, y, adv.to(dtype), bx, old_log_probs=old.to(dtype), ref_log_probs=ref.to(dtype),
                                backend=backend, top_entropy_group=dist.group.WORLD, **kwargs_of(c), **shard)
    out.loss.backward()
    return [x.detach().numpy() for x in (out.loss, hx.grad, wx.grad)]


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=cpu_triton)])
@pytest.mark.parametrize("tp", [False, True], ids=["data-parallel", "vocab-parallel"])
def test_top_entropy_quantile_over_ranks(backend, tp):
    tol, gtol = (1e-10, 1e-10) if backend == "torch" else (2e-5, 5e-5)
    results = run_ranks(_ranks_top_entropy, 2, backend, tp, timeout=240)
    c = CASES["top-entropy"]
    batches = []
    for rank in range(2):
        h, w, bias, y, adv, old, ref, _ = inputs_of(c, seed=3 if tp else 10 + rank)
        if not tp and rank == 1:
            y[-1] = -100
        batches.append((h, w, bias, y, adv, old, ref))
    # TRL's gather: every process's masked entropies (vocab-parallel ranks hold the same tokens: twice)
    every = torch.cat([materialized(*b[:4])[1][b[3] != -100] for b in batches])
    for rank in range(2):
        h, w, bias, y, adv, old, ref = batches[rank]
        loss, _, (dx, dw, _) = reference(c, h, w, bias, y, adv, old, ref, {}, every_entropy=every)
        alone, _, _ = reference(c, h, w, bias, y, adv, old, ref, {})
        got = [torch.from_numpy(x) for x in results[rank]]
        check(f"rank {rank} loss", got[0], loss, tol)
        check(f"rank {rank} dX", got[1], dx, gtol)
        s, n = (80 * rank, [80, V - 80][rank]) if tp else (0, V)
        check(f"rank {rank} dW", got[2], dw[s:s + n], gtol)
        if not tp:  # the group's quantile is not this rank's own
            assert abs(float(alone) - float(loss)) > 1e-6
