"""OpenRLHF: the actor's log-probs and entropy, and its ``PolicyLoss`` and ``DPOLoss``, computed by vpce
(OpenRLHF 0.11.x).

OpenRLHF's actor (``openrlhf.models.Actor.forward``) materializes the logits, divides them by the temperature,
and takes the log-probs of the next tokens (``log_probs_from_logits``) and, when asked, the entropy
(``compute_entropy``); its trainers then apply ``openrlhf.models.loss.PolicyLoss`` (PPO / GSPO, dual clip, the
train/rollout importance-sampling correction, token- or sequence-level aggregation) or ``DPOLoss`` on them.

- ``log_probs(hidden, weight, labels, ...)``: the actor's per-token log-probs (and entropy) of ``labels`` from
  the last hidden states and the lm_head, by ``vpce.linear_log_probs``: one fused pass, O(N) memory, no logits;
  under ``torch.no_grad`` (the old, reference and rollout log-probs) nothing is kept for backward; ``group=``
  for an lm_head split by vocab.
- ``policy_loss(loss_module, ...)``: a ``PolicyLoss`` instance's loss, fused: ``vpce.linear_log_prob_loss``
  evaluates the module itself on each chunk of whole sequences while the chunk's logits are live (gradients formed
  in forward, the cross-entropy's cost). Its aggregation's batch constants (``batch_num_tokens``,
  ``global_batch_size``) are filled in from the whole micro-batch where the caller leaves them to it, so each
  chunk's share adds up to the module's value; its metrics come from one more call on the detached log-probs.
- ``dpo_loss(loss_module, ...)``: a ``DPOLoss`` instance's loss of the concatenated chosen / rejected batch,
  fused the same way (each chunk of pairs its share of the mean).

The module is duck-typed: it does not import OpenRLHF (whose package imports flash-attn and DeepSpeed); any object
with ``PolicyLoss``' or ``DPOLoss``' call signature and attributes works. Tested against OpenRLHF 0.11.2's
``openrlhf/models/loss.py`` on CPU.
"""

from __future__ import annotations

import torch

import vpce

__all__ = ["log_probs", "policy_loss", "dpo_loss"]


def log_probs(hidden, weight, labels, bias=None, *, temperature=1.0, return_entropy=False, ignore_index=-100,
              group=None, vocab_start=None, vocab_size=None, backend="auto", memory_budget="auto", validate=False):
    """OpenRLHF's actor log-probs (``log_probs_from_logits(logits / temperature, labels)``) and, with
    ``return_entropy``, ``compute_entropy`` of the same distribution, of ``labels`` (``[...]``) from ``hidden``
    (``[..., D]``); 0 at ``ignore_index``. ``vpce.linear_log_probs``."""
    return vpce.linear_log_probs(hidden, weight, labels, bias, temperature=temperature, return_entropy=return_entropy,
                                 ignore_index=ignore_index, group=group, vocab_start=vocab_start,
                                 vocab_size=vocab_size, backend=backend, memory_budget=memory_budget,
                                 validate=validate)


def _masked(target, action_mask, ignore_index):
    """``(mask, target)``: the action mask as bool, and ``target`` with ``ignore_index`` where it is 0."""
    if action_mask is None:
        return target != ignore_index, target
    mask = action_mask.to(torch.bool)
    if tuple(mask.shape) != tuple(target.shape):
        raise ValueError(f"action_mask: expected target's shape {tuple(target.shape)}, got {tuple(mask.shape)}")
    return mask, target.masked_fill(~mask, ignore_index)


def policy_loss(loss_module, hidden, weight, target, old_log_probs, advantages, bias=None, *, action_mask=None,
                rollout_log_probs=None, dp_size=1, batch_num_tokens=None, global_batch_size=None, temperature=1.0,
                ignore_index=-100, group=None, vocab_start=None, vocab_size=None, backend="auto",
                memory_budget="auto", validate=False):
    """``loss_module(log_probs, old_log_probs, advantages, action_mask, rollout_log_probs, dp_size,
    batch_num_tokens, global_batch_size)`` (OpenRLHF's ``PolicyLoss``) on the log-probs of ``target`` (``[B, T]``,
    the action tokens; ``ignore_index`` or ``action_mask`` 0 elsewhere) under the head, fused.

    Returns ``(loss, clip_ratio, ppo_kl, vllm_kl, is_filter_ratio, log_probs)``: the module's five results (the
    loss differentiable, the metrics from the whole micro-batch) and the detached per-token log-probs ``[B, T]``.
    """
    if not isinstance(target, torch.Tensor) or target.dim() != 2:
        raise ValueError(f"target: expected a [B, T] tensor, got "
                         f"{tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__}")
    t_ = target.shape[1]
    mask, target = _masked(target, action_mask, ignore_index)
    f = mask.to(torch.float32)
    mask = mask if action_mask is None else action_mask
    # the batch constants the module would take from the whole micro-batch: each chunk adds its share
    if getattr(loss_module, "token_level_loss", True):
        if batch_num_tokens is None:
            batch_num_tokens, dp_size = f.sum(), 1
    elif global_batch_size is None:
        global_batch_size, dp_size = (f.sum(-1) > 0).float().sum(), 1
    consts = dict(dp_size=dp_size, batch_num_tokens=batch_num_tokens, global_batch_size=global_batch_size)
    inputs = {"old": old_log_probs, "adv": advantages, "mask": mask}
    if rollout_log_probs is not None:
        inputs["rollout"] = rollout_log_probs

    def call(logp, old, adv, mask, rollout=None):
        rows = lambda x: None if x is None else x.reshape(-1, t_).to(logp.dtype)  # noqa: E731
        # the mask in the caller's dtype (OpenRLHF's is bool: its aggregation's counts depend on it)
        return loss_module(logp.reshape(-1, t_), rows(old), rows(adv), action_mask=mask.reshape(-1, t_),
                           rollout_log_probs=rows(rollout), **consts)

    loss, logp, _ = vpce.linear_log_prob_loss(
        hidden, weight, target, lambda lp, ent, **x: call(lp, **x)[0], bias, inputs=inputs, scope="sequence",
        temperature=temperature, ignore_index=ignore_index, group=group, vocab_start=vocab_start,
        vocab_size=vocab_size, backend=backend, memory_budget=memory_budget, validate=validate, return_outputs=True)
    with torch.no_grad():
        _, *metrics = call(logp, **{k: v.detach().to(logp.device) for k, v in inputs.items()})
    return (loss, *metrics, logp)


def dpo_loss(loss_module, hidden, weight, target, reference_chosen_logps, reference_rejected_logps, bias=None, *,
             temperature=1.0, ignore_index=-100, group=None, vocab_start=None, vocab_size=None, backend="auto",
             memory_budget="auto", validate=False):
    """``loss_module(policy_chosen_logps, policy_rejected_logps, reference_chosen_logps, reference_rejected_logps)``
    (OpenRLHF's ``DPOLoss``, its mean over pairs) on the sequence log-probs (sums over the non-ignored tokens) of
    the concatenated batch: ``target`` ``[2B, T]``, rows ``[0, B)`` chosen and ``[B, 2B)`` rejected. The hidden
    states are interleaved by pair (one copy of ``[N, D]``) so that each fused row holds a pair.

    Returns ``(loss, chosen_rewards, rejected_rewards, log_probs)``; ``log_probs``: the detached per-token
    log-probs ``[2B, T]``.
    """
    if not isinstance(target, torch.Tensor) or target.dim() != 2 or target.shape[0] % 2:
        raise ValueError(f"target: expected a [2B, T] tensor (chosen rows, then rejected rows), got "
                         f"{tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__}")
    two_b, t_ = target.shape
    b_ = two_b // 2
    for name, x in (("reference_chosen_logps", reference_chosen_logps),
                    ("reference_rejected_logps", reference_rejected_logps)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != (b_,):
            raise ValueError(f"{name}: expected a tensor of shape ({b_},), got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    pair = lambda x: x.reshape(2, b_, t_, *x.shape[2:]).transpose(0, 1).reshape(b_, 2 * t_, *x.shape[2:])  # noqa: E731
    row = lambda x: x.detach()[:, None].expand(b_, 2 * t_)  # noqa: E731
    inputs = {"ref_c": row(reference_chosen_logps), "ref_r": row(reference_rejected_logps)}

    def loss_fn(logp, entropy, ref_c, ref_r):  # a chunk of pairs: its share of the mean over all B
        f = logp.dtype
        loss, _, _ = loss_module(logp[:, :t_].sum(-1), logp[:, t_:].sum(-1), ref_c[:, 0].to(f), ref_r[:, 0].to(f))
        return loss * (logp.shape[0] / b_)

    h = pair(hidden.reshape(two_b, t_, hidden.shape[-1]))
    loss, logp, _ = vpce.linear_log_prob_loss(
        h, weight, pair(target), loss_fn, bias, inputs=inputs, scope="sequence", temperature=temperature,
        ignore_index=ignore_index, group=group, vocab_start=vocab_start, vocab_size=vocab_size, backend=backend,
        memory_budget=memory_budget, validate=validate, return_outputs=True)
    logp = logp.detach().reshape(b_, 2, t_).transpose(0, 1).reshape(two_b, t_)
    with torch.no_grad():
        seq = logp.sum(-1)
        _, chosen_rewards, rejected_rewards = loss_module(seq[:b_], seq[b_:], reference_chosen_logps.to(seq),
                                                          reference_rejected_logps.to(seq))
    return loss, chosen_rewards, rejected_rewards, logp
