"""Losses of per-token log-probabilities, fused: any ``loss_fn(log_probs, entropy, **inputs)``, and on it GRPO (with
GSPO's sequence-level importance sampling) and DPO as TRL 1.16 defines them.

What is computed. For tokens ``i`` with target ``t_i`` (``ignore_index`` marks prompt and padding),
``log_probs_i = log softmax(cap(s * (x_i W^T + b)) / T)[t_i]`` and ``entropy_i`` of the same distribution, both 0 at
ignored tokens. The loss is ``sum(loss_fn(log_probs, entropy, **inputs))``, a scalar; a per-token result (the shape
of its ``log_probs`` argument) is dropped at ignored tokens. ``loss_fn`` may depend differentiably on ``log_probs``
and ``entropy`` only; ``inputs`` (advantages, old and reference log-probs, weights) come detached.

Why it is as fast as the cross-entropy. In every such loss the gradient with respect to each token's logits is
``dL/dz_ij = g_i (onehot_ij - p_ij) + h_i dH_i/dz_ij``, with ``g_i = dL/dlog_probs_i`` and ``h_i = dL/dentropy_i``
known as soon as the token's global softmax statistics are. So the fast route's chunk loop
(``vpce.backends.triton``: cuBLAS logits of a chunk, one statistics pass, the exchange under a group) evaluates
``loss_fn`` on the chunk's ``log_probs`` and ``entropy`` while the chunk's logits are live, takes ``g`` and ``h``
from autograd on that small evaluation, and turns the logits into the gradient in place (the same bandwidth pass as
the cross-entropy's, with per-token coefficients), then dX and dW by cuBLAS: 6NDV, the cross-entropy's cost.
Backward only scales the held gradients by the upstream scalar.

Scopes. ``"token"``: ``loss_fn`` is elementwise over tokens, and is called on each chunk. ``"sequence"``: ``target``
is ``[B, T]`` and ``loss_fn`` sees whole rows ``[b, T]``; the chunks hold whole rows (at least one: a row longer
than the default chunk makes the logits chunk ``T x V_local``), and a chunk's gradient pass waits for all of its
parts' statistics. ``"batch"``: ``loss_fn`` sees every token at once: a statistics pass over all tokens, then the
logits recomputed to form the gradient (8NDV, the lean route's cost), still in forward. The torch backend and
``memory_budget="lean"`` take that two-pass form for every scope, as does ``memory_budget="auto"`` where the fast
route's buffers do not fit (decided as for the cross-entropy, the same on every rank).

Vocab parallel. Every rank combines the same statistics into the same ``log_probs`` and ``entropy`` bytes, so every
rank evaluates ``loss_fn`` on identical values and gets identical ``g``, ``h`` and loss; the collectives are the
cross-entropy's (one packed all-gather per chunk part, dX summed over the group).

GRPO (``linear_grpo_loss``) and DPO (``linear_dpo_loss``) are ``loss_fn``s on this, with TRL's formulas:
token-level importance sampling is scope ``"token"`` (each token's normalizer is known from the mask beforehand),
GSPO's sequence-level ratio scope ``"sequence"``, and DPO scope ``"sequence"`` over rows that hold a chosen
completion and its rejected one side by side (the hidden states are interleaved by pair first: one copy of
``[N, D]``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from typing import NamedTuple

from .autograd import LogProbLossFunction
from .options import SCOPES, LogProbLossOptions, LossOptions
from .prepare import (Entry, check_bool, check_int, check_logit_scale, check_memory_budget, check_number, enter,
                      prepare_call)
from .routing import Plan, plan_cross_entropy, plan_log_probs, settle_by_memory, size_log_prob_loss

__all__ = ["linear_log_prob_loss", "linear_grpo_loss", "GRPOOutput", "linear_dpo_loss", "DPOOutput", "SCOPES",
           "GRPO_LOSS_TYPES", "DPO_LOSS_TYPES"]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo")
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo")


def _check_inputs(inputs, target: torch.Tensor) -> dict:
    if inputs is None:
        return {}
    if not isinstance(inputs, dict):
        raise TypeError(f"inputs: expected a dict of tensors or None, got {type(inputs).__name__}")
    out = {}
    for k, x in inputs.items():
        if not isinstance(k, str):
            raise TypeError(f"inputs: expected str keys, got {type(k).__name__}")
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"inputs[{k!r}]: expected a torch.Tensor, got {type(x).__name__}")
        if tuple(x.shape[:target.dim()]) != tuple(target.shape):
            raise ValueError(f"inputs[{k!r}]: expected target's leading shape {tuple(target.shape)}, got "
                             f"{tuple(x.shape)}")
        if x.device != target.device:
            raise ValueError(f"inputs[{k!r}]: expected target's device {target.device}, got {x.device}")
        out[k] = x.detach().reshape((-1,) + tuple(x.shape[target.dim():]))
    return out


def linear_log_prob_loss(hidden, weight, target, loss_fn, bias=None, *, inputs=None, scope="token",
                         use_entropy=False, temperature=1.0, softcap=None, logit_scale=1.0, ignore_index=-100,
                         group=None, vocab_start=None, vocab_size=None, sequence_parallel=False, backend="auto",
                         memory_budget="auto", validate=False, return_outputs=False):
    """``sum(loss_fn(log_probs, entropy, **inputs))`` of the per-token log-probabilities of ``target`` under
    ``softmax(softcap(logit_scale * (hidden @ weight.T + bias)) / temperature)``, without materializing the logits,
    with exact gradients formed at the cross-entropy's fast-route cost (module docstring).

    Args:
        hidden, weight, target, bias, ignore_index, group, vocab_start, vocab_size, sequence_parallel, backend,
            validate: as in ``linear_cross_entropy``.
        loss_fn: ``loss_fn(log_probs, entropy, **inputs) -> Tensor``. ``log_probs`` and ``entropy`` (None unless
            ``use_entropy``) are fp32 (fp64 for fp64 inputs on the torch backend), 0 at ignored tokens; a result of
            their shape is dropped there. It may depend differentiably on them only, and must give the same result
            for the same values (under a group every rank evaluates it).
        inputs: dict of tensors with ``target``'s leading shape (advantages, old log-probs, ...), sliced alongside
            the tokens and passed detached.
        scope: ``"token"`` (elementwise: called on chunks of tokens, flat), ``"sequence"`` (``target`` is ``[B, T]``;
            called on whole rows ``[b, T]``), ``"batch"`` (called once on everything; costs a second pass over the
            logits: 8NDV instead of 6NDV).
        use_entropy: pass the entropy of each token's distribution to ``loss_fn`` (differentiable).
        temperature, softcap, logit_scale: as in ``linear_log_probs``.
        memory_budget: ``"auto"`` (the fused route where its buffers fit in free device memory), ``"fast"``,
            ``"lean"`` (the two-pass form), or GiB of the logits chunk.
        return_outputs: also return the detached per-token ``(log_probs, entropy)`` (target's shape; entropy 0
            unless ``use_entropy``).

    Returns:
        The loss, a 0-d fp32 tensor (fp64 for fp64 inputs), or ``(loss, log_probs, entropy)``.
    """
    if not isinstance(return_outputs, bool):
        raise TypeError(f"return_outputs: expected a bool, got {type(return_outputs).__name__}")
    out = _log_prob_loss(hidden, weight, target, loss_fn, bias, inputs=inputs, scope=scope, use_entropy=use_entropy,
                         temperature=temperature, softcap=softcap, logit_scale=logit_scale, ignore_index=ignore_index,
                         group=group, vocab_start=vocab_start, vocab_size=vocab_size,
                         sequence_parallel=sequence_parallel, backend=backend, memory_budget=memory_budget,
                         validate=validate)
    return out if return_outputs else out[0]


def _log_prob_loss(hidden, weight, target, loss_fn, bias=None, *, inputs=None, scope="token", use_entropy=False,
                   temperature=1.0, softcap=None, logit_scale=1.0, ignore_index=-100, group=None, vocab_start=None,
                   vocab_size=None, sequence_parallel=False, backend="auto", memory_budget="auto", validate=False,
                   entropy_stats=False, top1=False, mean_logits=False):
    """``linear_log_prob_loss`` returning ``(loss, log_probs, entropy)``; ``entropy_stats``: compute the entropy as
    an output (a metric) even where ``loss_fn`` does not get it. ``top1`` / ``mean_logits``: also return
    ``linear_log_probs``' ``is_top1`` and ``mean_logits`` (detached metrics, from the same pass; each ``(0,)``
    where not asked): ``(loss, log_probs, entropy, is_top1, mean_logits)``."""
    entry = LogProbLossEntry(loss_fn, target, inputs, scope, use_entropy, entropy_stats, temperature, softcap,
                             logit_scale, ignore_index, memory_budget, top1=top1, mean_logits=mean_logits)
    h2, weight, bias, target, call = prepare_call(entry, hidden, weight, target, bias, group=group,
                                                  vocab_start=vocab_start, vocab_size=vocab_size,
                                                  sequence_parallel=sequence_parallel, backend=backend,
                                                  validate=validate)
    with torch.autocast(h2.device.type, enabled=False):  # (the Function casts the parameters)
        loss, logp, ent, is_top1, mean_z = LogProbLossFunction.apply(enter(h2, call), weight, bias, target.reshape(-1),
                                                                     entry.options, call, entry.inputs)
    out = loss, logp.reshape(target.shape), ent.reshape(target.shape)
    if top1 or mean_logits:
        shape = lambda x: x.reshape(target.shape) if x.numel() else x  # noqa: E731
        return (*out, shape(is_top1), shape(mean_z))
    return out


class LogProbLossEntry(Entry):
    """``linear_log_prob_loss`` in ``prepare_call``: its checks, the fields every rank must agree on, its plan (the
    fast route on the Triton backend for scopes ``"token"`` and ``"sequence"`` where its buffers fit; else the
    two-pass form) and sizes."""

    name = "logprob_loss"

    def __init__(self, loss_fn, target, inputs, scope, use_entropy, entropy_stats, temperature, softcap, logit_scale,
                 ignore_index, memory_budget, top1=False, mean_logits=False):
        self.args = dict(loss_fn=loss_fn, target=target, inputs=inputs, scope=scope, use_entropy=use_entropy,
                         entropy_stats=entropy_stats, temperature=temperature, softcap=softcap,
                         logit_scale=logit_scale, ignore_index=ignore_index, memory_budget=memory_budget)
        self.metrics = dict(top1=bool(top1), mean_logits=bool(mean_logits))
        self.ignore_index = ignore_index if isinstance(ignore_index, int) else -100
        self.options = self.inputs = self.budget = None

    def checks(self, _w, _cast):
        a = self.args
        if not callable(a["loss_fn"]):
            raise TypeError(f"loss_fn: expected a callable, got {type(a['loss_fn']).__name__}")
        if a["scope"] not in SCOPES:
            raise ValueError(f"scope: expected one of {SCOPES}, got {a['scope']!r}")
        target = a["target"]
        if a["scope"] == "sequence" and target.dim() != 2:
            raise ValueError(f"target: expected [B, T] with scope='sequence', got shape {tuple(target.shape)}")
        check_bool("use_entropy", a["use_entropy"])
        check_int("ignore_index", a["ignore_index"], allow_none=False)
        check_number("temperature", a["temperature"], low=0.0, low_open=True)
        check_number("softcap", a["softcap"], low=0.0, low_open=True, allow_none=True)
        check_logit_scale(a["logit_scale"])
        self.budget = check_memory_budget(a["memory_budget"])
        self.inputs = _check_inputs(a["inputs"], target)
        # the logit scale s folds into the cap and the temperature: cap_c(s x) / T = cap_{c/s}(x) * (s / T)
        s, softcap = float(a["logit_scale"]), a["softcap"]
        self.options = LogProbLossOptions(
            loss_fn=a["loss_fn"], scope=a["scope"], entropy=a["use_entropy"],
            entropy_stats=a["use_entropy"] or a["entropy_stats"], row=target.shape[-1] if target.dim() else 1,
            ignore_index=int(a["ignore_index"]), softcap=None if softcap is None else float(softcap) / s,
            inv_t=s / float(a["temperature"]), memory_budget=self.budget, **self.metrics)

    def fields(self):
        a = self.args
        return [("ignore_index", a["ignore_index"]), ("temperature", float(a["temperature"])),
                ("softcap", None if a["softcap"] is None else float(a["softcap"])),
                ("logit_scale", float(a["logit_scale"])), ("scope", a["scope"]), ("use_entropy", a["use_entropy"]),
                ("entropy", self.options.entropy_stats), ("memory_budget", self.budget),
                ("inputs", ",".join(f"{k}:{tuple(v.shape[1:])}" for k, v in sorted(self.inputs.items())))]

    def plan(self, needs, _dtype, backend_name, sharded, sp) -> Plan:
        if backend_name == "triton" and self.args["scope"] != "batch" and self.budget != "lean" and any(needs):
            return plan_cross_entropy(LossOptions(memory_budget=self.budget), needs, backend_name, sharded, sp)
        return plan_log_probs(needs, backend_name, sharded, sp)

    def memory(self, p, h, rows, needs, world):
        return settle_by_memory(p, h, rows, needs, LossOptions(memory_budget=self.budget), world, self.weight_cast)

    def size(self, plan, shard, d, dtype):
        return size_log_prob_loss(plan, self.options, shard, d, dtype, self.weight_cast)


# -- GRPO (TRL 1.16 GRPOTrainer._compute_loss) -------------------------------------------------------------------

class GRPOOutput(NamedTuple):
    loss: torch.Tensor
    """The GRPO loss (differentiable, 0-d)."""
    kl: torch.Tensor | None
    """Masked mean of the k3 KL estimate against ``ref_log_probs`` (detached); None with ``beta=0``."""
    clip_ratio: torch.Tensor
    """Share of tokens whose ratio is clipped in the direction that stops the gradient (TRL's
    ``clip_ratio/region_mean``; ``cispo_clip_ratio`` for ``cispo``), detached."""
    entropy: torch.Tensor
    """Masked mean of the per-token entropy (detached)."""


def _grpo_token_loss(logp, old, adv, ref, weight, *, level, loss_type, beta, eps_low, eps_high, delta, mask,
                     bias_correction_kl=False):
    """TRL's per-token GRPO loss times each token's normalizer ``weight`` (rows of ``[b, T]`` or flat tokens).
    ``bias_correction_kl``: the KL term times the (unclipped) importance ratio, as TRL's ``use_bias_correction_kl``."""
    log_ratio = logp - old
    if level == "sequence":
        log_w = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    else:
        log_w = log_ratio
    coef_1 = torch.exp(log_w)
    ratio = coef_1
    if loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=eps_high).detach() * adv * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token = -torch.minimum(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        per_token = per_token + beta * (kl * ratio if bias_correction_kl else kl)
    return per_token * weight


def linear_grpo_loss(hidden, weight, target, advantages, bias=None, *, old_log_probs=None, ref_log_probs=None,
                     beta=0.0, epsilon_low=0.2, epsilon_high=None, delta=None, loss_type="dapo",
                     importance_sampling_level="token", max_completion_length=None, num_items_in_batch=None,
                     temperature=1.0, softcap=None, logit_scale=1.0, ignore_index=-100, group=None, vocab_start=None,
                     vocab_size=None, sequence_parallel=False, backend="auto", memory_budget="auto",
                     validate=False) -> GRPOOutput:
    """TRL 1.16's GRPO loss (``GRPOTrainer._compute_loss``) of the policy head, fused (``linear_log_prob_loss``).

    ``hidden`` is ``[B, T, D]`` (or this rank's slice of ``B*T`` tokens with ``sequence_parallel``), ``target``
    ``[B, T]``: completion tokens, prompt and padding set to ``ignore_index`` (the mask). ``advantages``: ``[B]``
    or ``[B, T]``. ``old_log_probs`` (``[B, T]``): the sampling policy's log-probs, None for the current ones
    detached (one iteration per generation). ``ref_log_probs``: needed with ``beta != 0`` (the k3 KL estimate).
    ``epsilon_high`` defaults to ``epsilon_low``; ``delta``: two-sided clipping's upper bound on the ratio.
    ``loss_type`` in ``GRPO_LOSS_TYPES``; ``importance_sampling_level`` ``"token"`` or ``"sequence"`` (GSPO).
    Normalizers: ``grpo`` each sequence's mean then the mean over sequences; ``bnpo`` the mask's count; ``dr_grpo``
    ``B * max_completion_length`` (default ``T``); ``dapo`` and ``cispo`` ``num_items_in_batch`` (default the
    mask's count). No gradient-accumulation normalizer is applied (divide the loss as the trainer does).
    """
    return _linear_grpo_loss(
        hidden, weight, target, advantages, bias, old_log_probs=old_log_probs, ref_log_probs=ref_log_probs, beta=beta,
        epsilon_low=epsilon_low, epsilon_high=epsilon_high, delta=delta, loss_type=loss_type,
        importance_sampling_level=importance_sampling_level, max_completion_length=max_completion_length,
        num_items_in_batch=num_items_in_batch, temperature=temperature, softcap=softcap, logit_scale=logit_scale,
        ignore_index=ignore_index, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        sequence_parallel=sequence_parallel, backend=backend, memory_budget=memory_budget, validate=validate)[0]


def _linear_grpo_loss(hidden, weight, target, advantages, bias=None, *, old_log_probs=None, ref_log_probs=None,
                      beta=0.0, epsilon_low=0.2, epsilon_high=None, delta=None, loss_type="dapo",
                      importance_sampling_level="token", max_completion_length=None, num_items_in_batch=None,
                      temperature=1.0, softcap=None, logit_scale=1.0, ignore_index=-100, group=None, vocab_start=None,
                      vocab_size=None, sequence_parallel=False, backend="auto", memory_budget="auto",
                      validate=False, bias_correction_kl=False, entropy_bonus=None, token_weight=None):
    """``linear_grpo_loss`` returning ``(GRPOOutput, log_probs, entropy)``: also the detached per-token log-probs
    and entropy ``[B, T]`` (0 at ignored tokens), for metrics (``vpce.integrations.trl``). ``bias_correction_kl``:
    the KL term of the loss times the importance ratio (TRL's ``use_bias_correction_kl``; the returned ``kl`` metric
    stays the plain masked mean). ``entropy_bonus`` (``[B, T]``, or None): the loss also gets
    ``-sum(entropy_bonus * entropy)`` (TRL's entropy bonus, its coefficient and normalizer folded in per token).
    ``token_weight`` (``[B, T]``, or None): each token's normalizer, given instead of ``loss_type``'s (e.g. for the
    tokens of several sequences packed into one row, with token-level importance sampling)."""
    for name, value in (("loss_type", loss_type), ("importance_sampling_level", importance_sampling_level)):
        allowed = GRPO_LOSS_TYPES if name == "loss_type" else ("token", "sequence")
        if value not in allowed:
            raise ValueError(f"{name}: expected one of {allowed}, got {value!r}")
    if not isinstance(target, torch.Tensor) or target.dim() != 2:
        raise ValueError(f"target: expected a [B, T] tensor, got "
                         f"{tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__}")
    b_, t_ = target.shape
    check_number("beta", beta, low=0.0)
    check_number("epsilon_low", epsilon_low, low=0.0)
    check_number("epsilon_high", epsilon_high, low=0.0, allow_none=True)
    check_number("delta", delta, low=1.0, allow_none=True)
    check_int("max_completion_length", max_completion_length, low=1)
    eps_high = epsilon_low if epsilon_high is None else float(epsilon_high)
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in ((b_,), (b_, t_)):
        raise ValueError(f"advantages: expected a tensor of shape ({b_},) or ({b_}, {t_}), got "
                         f"{tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages)}")
    if beta != 0.0 and ref_log_probs is None:
        raise ValueError("ref_log_probs: expected the reference policy's [B, T] log-probs with beta != 0, got None")
    acc = torch.float64 if getattr(hidden, "dtype", None) == torch.float64 else torch.float32
    mask = (target != ignore_index).to(acc)
    adv = advantages.detach().to(acc)
    adv = adv[:, None].expand(b_, t_) if adv.dim() == 1 else adv
    # each token's normalizer, known from the mask beforehand
    if loss_type == "grpo":
        weight_tok = mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / b_
    elif loss_type == "bnpo":
        weight_tok = mask / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        weight_tok = mask / (b_ * (t_ if max_completion_length is None else max_completion_length))
    else:
        items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=acc,
                                                                              device=mask.device)
        weight_tok = mask / items.clamp(min=1.0)
    if token_weight is not None:
        weight_tok = mask * token_weight.detach().to(acc)
    inputs = {"adv": adv, "weight": weight_tok, "mask": mask}
    current = old_log_probs is None
    if not current:
        inputs["old"] = old_log_probs
    if beta != 0.0:
        inputs["ref"] = ref_log_probs
    if entropy_bonus is not None:
        inputs["bonus"] = entropy_bonus
    opts = dict(level=importance_sampling_level, loss_type=loss_type, beta=float(beta), eps_low=float(epsilon_low),
                eps_high=eps_high, delta=None if delta is None else float(delta))
    token_opts = dict(opts, bias_correction_kl=bool(bias_correction_kl) and beta != 0.0)

    def loss_fn(logp, entropy, adv, weight, mask, old=None, ref=None, bonus=None):
        old = logp.detach() if old is None else old.to(logp.dtype)
        out = _grpo_token_loss(logp, old, adv.to(logp.dtype), None if ref is None else ref.to(logp.dtype),
                               weight.to(logp.dtype), mask=mask.to(logp.dtype), **token_opts)
        return out if bonus is None else out - bonus.to(logp.dtype) * entropy

    scope = "sequence" if importance_sampling_level == "sequence" else "token"
    loss, logp, ent = _log_prob_loss(
        hidden, weight, target, loss_fn, bias, inputs=inputs, scope=scope, temperature=temperature, softcap=softcap,
        logit_scale=logit_scale, ignore_index=ignore_index, group=group, vocab_start=vocab_start,
        vocab_size=vocab_size, sequence_parallel=sequence_parallel, backend=backend, memory_budget=memory_budget,
        validate=validate, entropy_stats=True, use_entropy=entropy_bonus is not None)
    per_sequence = importance_sampling_level == "sequence" and advantages.dim() == 1
    out = GRPOOutput(loss, *_grpo_metrics(logp, ent, old_log_probs, ref_log_probs, adv, mask, opts, per_sequence))
    return out, logp, ent


def _grpo_metrics(logp, ent, old, ref, adv, mask, opts, per_sequence: bool):
    """TRL's logged ``kl``, clip ratio and ``entropy`` (masked means over the tokens; detached). ``per_sequence``
    (sequence-level ratios, ``[B]`` advantages): the clip ratio is the mean over sequences, as TRL's."""
    logp = logp.detach()
    dtype = logp.dtype
    mask, adv = mask.to(dtype), adv.to(dtype)
    old = logp if old is None else old.detach().to(dtype)
    count = mask.sum().clamp(min=1.0)
    kl = None
    if opts["beta"] != 0.0:
        r = ref.detach().to(dtype)
        kl = ((torch.exp(r - logp) - (r - logp) - 1) * mask).sum() / count
    log_ratio = logp - old
    if opts["level"] == "sequence":
        coef = torch.exp((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))
    else:
        coef = torch.exp(log_ratio)
    if opts["loss_type"] == "cispo":
        clipped = (coef > opts["eps_high"]) & (adv > 0)
    else:
        clipped = ((coef < 1 - opts["eps_low"]) & (adv < 0)) | ((coef > 1 + opts["eps_high"]) & (adv > 0))
    if per_sequence:
        clip_ratio = clipped[:, :1].to(dtype).mean()
    else:
        clip_ratio = (clipped.to(dtype) * mask).sum() / count
    entropy = (ent.detach().to(dtype) * mask).sum() / count
    return kl, clip_ratio, entropy


# -- DPO (TRL 1.16 DPOTrainer._compute_loss) ---------------------------------------------------------------------

class DPOOutput(NamedTuple):
    loss: torch.Tensor
    """The DPO loss, mean over pairs (differentiable, 0-d)."""
    chosen_rewards: torch.Tensor
    """``beta * (log pi(chosen) - log ref(chosen))`` per pair ``[B]`` (detached)."""
    rejected_rewards: torch.Tensor
    """The same for the rejected completions ``[B]`` (detached)."""


def _no_loss(logp, entropy):
    return logp.new_zeros(())


def _dpo_pair_loss(delta, beta, loss_type):
    if loss_type == "sigmoid":
        return -F.logsigmoid(beta * delta)
    if loss_type == "hinge":
        return torch.relu(1 - beta * delta)
    return (delta - 1 / (2 * beta)) ** 2  # ipo: delta already length-normalized


def linear_dpo_loss(hidden, weight, target, ref_chosen_log_probs=None, ref_rejected_log_probs=None, bias=None, *,
                    beta=0.1, loss_type="sigmoid", ref_hidden=None, ref_weight=None, ref_bias=None, temperature=1.0,
                    softcap=None, logit_scale=1.0, ignore_index=-100, group=None, vocab_start=None, vocab_size=None,
                    sequence_parallel=False, backend="auto", memory_budget="auto", validate=False) -> DPOOutput:
    """TRL 1.16's DPO loss (``DPOTrainer._compute_loss``) of the policy head, fused (``linear_log_prob_loss``).

    TRL's concatenated batch: ``hidden`` ``[2B, T, D]``, ``target`` ``[2B, T]``; rows ``[0, B)`` are the chosen
    completions, rows ``[B, 2B)`` the rejected ones, prompt and padding ``ignore_index``. Sequence log-probs are
    summed over the non-ignored tokens. ``ref_chosen_log_probs`` / ``ref_rejected_log_probs`` (``[B]``): the
    reference's sequence log-probs; or ``ref_hidden`` (``[2B, T, D_ref]``) and ``ref_weight`` (and ``ref_bias``): the
    reference head, computed here without gradient. ``loss_type``: ``sigmoid``, ``hinge`` or ``ipo`` (with TRL's
    length normalization), the mean over pairs. The hidden states are interleaved by pair (one copy of ``[N, D]``)
    so that each fused row holds a chosen completion and its rejected one.
    """
    return _linear_dpo_loss(
        hidden, weight, target, ref_chosen_log_probs, ref_rejected_log_probs, bias, beta=beta, loss_type=loss_type,
        ref_hidden=ref_hidden, ref_weight=ref_weight, ref_bias=ref_bias, temperature=temperature, softcap=softcap,
        logit_scale=logit_scale, ignore_index=ignore_index, group=group, vocab_start=vocab_start,
        vocab_size=vocab_size, sequence_parallel=sequence_parallel, backend=backend, memory_budget=memory_budget,
        validate=validate)[0]


def _linear_dpo_loss(hidden, weight, target, ref_chosen_log_probs=None, ref_rejected_log_probs=None, bias=None, *,
                     beta=0.1, loss_type="sigmoid", ref_hidden=None, ref_weight=None, ref_bias=None, temperature=1.0,
                     softcap=None, logit_scale=1.0, ignore_index=-100, group=None, vocab_start=None, vocab_size=None,
                     sequence_parallel=False, backend="auto", memory_budget="auto", validate=False,
                     entropy_stats=False, logit_metrics=False):
    """``linear_dpo_loss`` returning ``(DPOOutput, log_probs, entropy)``: also the detached per-token log-probs and
    (``entropy_stats``, else zeros) entropy in ``target``'s ``[2B, T]`` layout, 0 at ignored tokens, for metrics
    (``vpce.integrations.trl``). ``logit_metrics``: also ``is_top1`` and ``mean_logits`` in that layout, from the
    same pass: ``(DPOOutput, log_probs, entropy, is_top1, mean_logits)``."""
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"loss_type: expected one of {DPO_LOSS_TYPES}, got {loss_type!r}")
    check_number("beta", beta, low=0.0, low_open=True)
    if not isinstance(target, torch.Tensor) or target.dim() != 2 or target.shape[0] % 2:
        raise ValueError(f"target: expected a [2B, T] tensor (chosen rows, then rejected rows), got "
                         f"{tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__}")
    if sequence_parallel:
        raise ValueError("sequence_parallel: linear_dpo_loss pairs whole rows and expects the full sequence on "
                         "every rank, got sequence_parallel=True")
    two_b, t_ = target.shape
    b_ = two_b // 2
    if (ref_hidden is None) == (ref_chosen_log_probs is None):
        raise ValueError("ref_chosen_log_probs / ref_hidden: expected either the reference's sequence log-probs "
                         "(ref_chosen_log_probs and ref_rejected_log_probs) or its head (ref_hidden and ref_weight), "
                         "got both or neither")
    common = dict(temperature=temperature, softcap=softcap, logit_scale=logit_scale, ignore_index=ignore_index,
                  group=group, vocab_start=vocab_start, vocab_size=vocab_size, backend=backend)
    if ref_hidden is not None:
        if ref_weight is None:
            raise ValueError("ref_weight: expected the reference head's weight with ref_hidden, got None")
        with torch.no_grad():  # the reference's log-probs alone: one statistics pass, no gradient
            _, ref_tok, _ = _log_prob_loss(ref_hidden, ref_weight, target, _no_loss, ref_bias, **common)
        ref_seq = ref_tok.sum(-1)
        ref_chosen, ref_rejected = ref_seq[:b_], ref_seq[b_:]
    else:
        ref_chosen, ref_rejected = ref_chosen_log_probs, ref_rejected_log_probs
        for name, x in (("ref_chosen_log_probs", ref_chosen), ("ref_rejected_log_probs", ref_rejected)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (b_,):
                raise ValueError(f"{name}: expected a tensor of shape ({b_},), got "
                                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    acc = torch.float64 if getattr(hidden, "dtype", None) == torch.float64 else torch.float32
    f32 = lambda x: x.detach().to(device=target.device, dtype=acc)  # noqa: E731
    lengths = (target != ignore_index).to(acc).sum(-1).clamp(min=1.0)
    # interleave by pair: row b of the fused view holds chosen completion b, then rejected completion b
    pair = lambda x: x.reshape(2, b_, t_, *x.shape[2:]).transpose(0, 1).reshape(b_, 2 * t_, *x.shape[2:])  # noqa: E731
    row = lambda x: x[:, None].expand(b_, 2 * t_)  # noqa: E731  (a per-pair value, along its fused row)
    inputs = {"ref_c": row(f32(ref_chosen)), "ref_r": row(f32(ref_rejected)), "len_c": row(lengths[:b_]),
              "len_r": row(lengths[b_:])}
    beta_f = float(beta)

    def loss_fn(logp, entropy, ref_c, ref_r, len_c, len_r):
        chosen = logp[:, :t_].sum(-1) - ref_c[:, 0].to(logp.dtype)
        rejected = logp[:, t_:].sum(-1) - ref_r[:, 0].to(logp.dtype)
        if loss_type == "ipo":  # TRL: each log-ratio over its completion's length
            delta = chosen / len_c[:, 0].to(logp.dtype) - rejected / len_r[:, 0].to(logp.dtype)
        else:
            delta = chosen - rejected
        return _dpo_pair_loss(delta, beta_f, loss_type) / b_

    h = pair(hidden.reshape(two_b, t_, hidden.shape[-1])) if isinstance(hidden, torch.Tensor) else hidden
    loss, logp, ent, *extras = _log_prob_loss(h, weight, pair(target), loss_fn, bias, inputs=inputs,
                                              scope="sequence", memory_budget=memory_budget, validate=validate,
                                              entropy_stats=entropy_stats, top1=logit_metrics,
                                              mean_logits=logit_metrics, **common)
    logp = logp.detach()
    chosen_rewards = beta_f * (logp[:, :t_].sum(-1) - inputs["ref_c"][:, 0].to(logp.dtype))
    rejected_rewards = beta_f * (logp[:, t_:].sum(-1) - inputs["ref_r"][:, 0].to(logp.dtype))
    unpair = lambda x: x.detach().reshape(b_, 2, t_).transpose(0, 1).reshape(two_b, t_)  # noqa: E731
    return (DPOOutput(loss, chosen_rewards, rejected_rewards), unpair(logp), unpair(ent), *map(unpair, extras))
