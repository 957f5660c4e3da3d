"""``vpce.integrations.verl`` against verl 0.9.1's own code on CPU: its policy losses (``core_algos``, by loss mode),
``agg_loss`` (every aggregation mode), ``kl_penalty`` and the entropy term composed as ``workers.utils.losses.
ppo_loss`` composes them, applied to float64 log-probs and entropy of materialized logits; its torch fused head
(``FusedLinearForPPO``) for the drop-in head; vocab-parallel over 2 gloo ranks for the Megatron worker's head and
the fused loss.
"""

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("verl.trainer.ppo.core_algos", reason="verl 0.9.x (needs ray and tensordict)")

import vpce.integrations.verl as vverl  # noqa: E402
from distributed import run_ranks  # noqa: E402
from test_post_training import CUDA, DEV, V, check, leaves, materialized, problem  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.workers.config import ActorConfig  # noqa: E402
from verl.workers.config.actor import PolicyLossConfig  # noqa: E402

BACKENDS = [("torch", torch.float64, 1e-10, 1e-10), ("triton", torch.float32, 2e-5, 5e-5)]


def actor_config(loss_mode="vanilla", agg="token-mean", entropy_coeff=0.0, kl=False, **kw):
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=4, loss_agg_mode=agg,
                       entropy_coeff=entropy_coeff, use_kl_loss=kl, kl_loss_coef=0.05,
                       policy_loss=PolicyLossConfig(loss_mode=loss_mode), **kw)


def verl_ppo_loss(config, logp, ent, old, adv, mask, is_w=None, ref=None):
    """``verl.workers.utils.losses.ppo_loss``'s composition (one process), on unfused per-token values."""
    fn = core_algos.get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))
    pg, metrics = fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                     loss_agg_mode=config.loss_agg_mode, config=config, rollout_is_weights=is_w)
    loss = pg
    if config.entropy_coeff != 0:
        loss = loss - config.entropy_coeff * core_algos.agg_loss(loss_mat=ent, loss_mask=mask,
                                                                 loss_agg_mode=config.loss_agg_mode,
                                                                 **config.global_batch_info)
    if config.use_kl_loss:
        kld = core_algos.kl_penalty(logprob=logp, ref_logprob=ref, kl_penalty=config.kl_loss_type)
        loss = loss + core_algos.agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=config.loss_agg_mode,
                                          **config.global_batch_info) * config.kl_loss_coef
    return loss, metrics


CASES = {  # id: actor_config keywords
    "vanilla-token-mean": dict(),
    "vanilla-seq-mean-token-sum-entropy-kl": dict(agg="seq-mean-token-sum", entropy_coeff=0.01, kl=True),
    "vanilla-seq-mean-token-mean": dict(agg="seq-mean-token-mean", entropy_coeff=0.02),
    "vanilla-seq-mean-token-sum-norm": dict(agg="seq-mean-token-sum-norm"),
    "vanilla-token-sum-is-weights": dict(agg="token-sum", is_w=True),
    "gspo": dict(loss_mode="gspo", agg="seq-mean-token-mean"),
    "sapo": dict(loss_mode="sapo"),
    "geo_mean": dict(loss_mode="geo_mean", agg="seq-mean-token-mean"),
    "cispo-kl": dict(loss_mode="cispo", kl=True),
    "gpg": dict(loss_mode="gpg"),
    "clip_cov": dict(loss_mode="clip_cov"),
    "kl_cov": dict(loss_mode="kl_cov"),
}
TRITON_CASES = ("vanilla-seq-mean-token-sum-entropy-kl", "gspo", "clip_cov")


def data(seed=3):
    h, w, bias, y, gen = problem(seed=seed)
    logp, _ = materialized(h, w, bias, y)
    b, t = y.shape
    old = logp + (torch.rand(b, t, generator=gen, dtype=torch.float64) - 0.5) * 0.8
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    ref = logp + torch.randn(b, t, generator=gen, dtype=torch.float64) * 0.3
    is_w = torch.rand(b, t, generator=gen, dtype=torch.float64) + 0.5
    return h, w, bias, y, old, adv, ref, is_w


def reference(config, h, w, bias, y, old, adv, ref, is_w):
    hr, wr, br = (x.clone().requires_grad_() for x in (h, w, bias))
    logp, ent = materialized(hr, wr, br, y)
    loss, metrics = verl_ppo_loss(config, logp, ent, old, adv, y != -100, is_w, ref)
    loss.backward()
    return loss, metrics, (hr.grad, wr.grad, br.grad)


@pytest.mark.parametrize("backend,dtype,tol,gtol", BACKENDS, ids=[b[0] for b in BACKENDS])
@pytest.mark.parametrize("case", list(CASES))
def test_ppo_loss_matches_verl(backend, dtype, tol, gtol, case):
    if backend == "triton" and case not in TRITON_CASES:
        pytest.skip("the interpreter is slow: a subset on Triton")
    kw = dict(CASES[case])
    with_is = kw.pop("is_w", False)
    h, w, bias, y, old, adv, ref, is_w = data()
    torch.manual_seed(0)  # clip_cov draws a random subset of tokens: the same draw for both
    loss, metrics, grads = reference(actor_config(**kw), h, w, bias, y, old, adv, ref, is_w if with_is else None)
    config = actor_config(**kw)
    hx, wx, bx = leaves(dtype, h, w, bias)
    to = lambda x: x.to(DEV, dtype)  # noqa: E731
    torch.manual_seed(0)
    # memory_budget: a tiny logits chunk, so that the fused route cuts the batch into chunks of responses
    got, got_metrics, logp, _ = vverl.ppo_loss(
        config, hx, wx, y.to(DEV), to(old), to(adv), bx, rollout_is_weights=to(is_w) if with_is else None,
        ref_log_prob=to(ref), backend=backend, memory_budget=1e-6 if backend == "triton" else "auto")
    got.backward()
    assert config.global_batch_info == {}, "the config must come back as it was"
    check("loss", got, loss, tol)
    for name, x, r in zip(("dX", "dW", "db"), (hx, wx, bx), grads):
        check(name, x.grad, r, gtol)
    for key, value in metrics.items():
        assert abs(float(got_metrics[key]) - float(value)) <= 1e-5 * abs(float(value)) + 1e-7, key
    check("log_probs", logp, materialized(h, w, bias, y)[0], tol)


def test_fsdp_head_matches_verls_fused_head():
    """``VpceLinearForPPO`` against verl's torch ``FusedLinearForPPO``: log-probs, entropy and their gradients."""
    from verl.utils.experimental.torch_functional import FusedLinearForPPO

    gen = torch.Generator().manual_seed(0)
    h = torch.randn(2, 9, 16, generator=gen, dtype=torch.float64)
    w = torch.randn(V, 16, generator=gen, dtype=torch.float64) * 0.5
    ids = torch.randint(0, V, (2, 9), generator=gen)
    gl, ge = torch.randn(2, 9, generator=gen, dtype=torch.float64), torch.randn(2, 9, generator=gen,
                                                                                   dtype=torch.float64)
    outs = []
    for head in (FusedLinearForPPO(chunk_size=4), vverl.VpceLinearForPPO(backend="torch")):
        hx, wx = h.clone().requires_grad_(), w.clone().requires_grad_()
        logp, ent = head(hx, wx, ids, temperature=0.7)
        ((logp * gl).sum() + (ent * ge).sum()).backward()
        outs.append((logp, ent, hx.grad, wx.grad))
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = materialized(hr, wr, torch.zeros(V, dtype=torch.float64), ids, temperature=0.7)
    ((logp * gl).sum() + (ent * ge).sum()).backward()
    want = (logp, ent, hr.grad, wr.grad)
    for name, ours, verls, r in zip(("log_probs", "entropy", "dX", "dW"), outs[1], outs[0], want):
        check(f"vpce {name}", ours, r, 1e-10)  # float64 throughout
        check(f"verl {name}", verls, r, 1e-6)  # verl's head computes in float32: the same values, less exact


def test_apply_patches_verls_heads_and_remove_restores():
    import verl.utils.experimental.torch_functional as tf

    original = tf.FusedLinearForPPO
    vverl.apply(backend="torch")
    try:
        assert vverl.is_applied() and tf.FusedLinearForPPO is not original
        assert isinstance(tf.FusedLinearForPPO(impl_backend="torch"), vverl.VpceLinearForPPO)
    finally:
        vverl.remove()
    assert tf.FusedLinearForPPO is original and not vverl.is_applied()


# -- vocab parallel: the Megatron worker's head and the fused loss over 2 gloo ranks ----------------------------------

def _ranks(rank, world):
    rows = V // world + (V % world > 0)
    start = rank * rows
    g = dist.group.WORLD
    h, w, bias, y, old, adv, ref, _ = data()
    # the Megatron head: vpce's complete dX shared so that verl's sum over the group gives it
    hx, wx = h.clone().requires_grad_(), w[start:start + rows].clone().requires_grad_()
    logp, ent = vverl.linear_cross_entropy(hx, wx, y.clamp(min=0), 0.9, "none", g)
    (logp.sum() + 0.5 * ent.sum()).backward()
    dx = hx.grad.clone()
    dist.all_reduce(dx, group=g)
    head = [logp, ent, dx, wx.grad]
    # the fused loss under group=
    config = actor_config(agg="seq-mean-token-sum", entropy_coeff=0.01, kl=True)
    hx, wx = h.clone().requires_grad_(), w[start:start + rows].clone().requires_grad_()
    bx = bias[start:start + rows].clone().requires_grad_()
    loss, _, _, _ = vverl.ppo_loss(config, hx, wx, y, old, adv, bx, ref_log_prob=ref, group=g, backend="torch")
    loss.backward()
    return [x.detach().numpy() for x in head + [loss, hx.grad, wx.grad]]


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
def test_vocab_parallel_heads_and_loss():
    results = run_ranks(_ranks, 2, timeout=240)
    h, w, bias, y, old, adv, ref, _ = data()
    rows = V // 2 + (V % 2 > 0)
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    logp, ent = materialized(hr, wr, torch.zeros(V, dtype=torch.float64), y.clamp(min=0), temperature=0.9)
    (logp.sum() + 0.5 * ent.sum()).backward()
    loss, _, (dx, dw, _) = reference(actor_config(agg="seq-mean-token-sum", entropy_coeff=0.01, kl=True), h, w, bias,
                                     y, old, adv, ref, None)
    for rank, res in enumerate(results):
        got = [torch.from_numpy(x) for x in res]
        s = rank * rows
        check(f"rank {rank} head log_probs", got[0], logp.reshape(-1), 1e-10)
        check(f"rank {rank} head entropy", got[1], ent.reshape(-1), 1e-10)
        check(f"rank {rank} head dX (summed over ranks)", got[2], hr.grad, 1e-10)
        check(f"rank {rank} head dW", got[3], wr.grad[s:s + rows], 1e-10)
        check(f"rank {rank} loss", got[4], loss, 1e-10)
        check(f"rank {rank} loss dX", got[5], dx, 1e-10)
        check(f"rank {rank} loss dW", got[6], dw[s:s + rows], 1e-10)
