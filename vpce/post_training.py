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

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .autograd import LogProbLossFunction
from .options import SCOPES, LogProbLossOptions
from .parallel import all_gather_tensor, group_rank_and_size
from .prepare import (Entry, check_bool, check_int, check_logit_scale, check_memory_budget, check_number, enter,
                      prepare_call)
from .routing import Plan, plan_log_prob_loss, settle_by_memory, size_log_prob_loss

__all__ = ["linear_log_prob_loss", "linear_grpo_loss", "GRPOOutput", "vllm_importance_sampling_ratio",
           "high_entropy_mask", "linear_dpo_loss", "DPOOutput", "SCOPES", "GRPO_LOSS_TYPES",
           "VLLM_IMPORTANCE_SAMPLING_MODES", "DPO_LOSS_TYPES", "F_DIVERGENCE_TYPES"]

GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "vespo", "luspo")
VLLM_IMPORTANCE_SAMPLING_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard", "aot",
                  "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm")
F_DIVERGENCE_TYPES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


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
    args = LogProbLossArgs(loss_fn=loss_fn, scope=scope, use_entropy=use_entropy, temperature=temperature,
                           softcap=softcap, logit_scale=logit_scale, ignore_index=ignore_index,
                           memory_budget=memory_budget)
    out = _log_prob_loss(hidden, weight, target, bias, args, inputs=inputs, group=group, vocab_start=vocab_start,
                         vocab_size=vocab_size, sequence_parallel=sequence_parallel, backend=backend,
                         validate=validate)
    return out if return_outputs else out[0]


@dataclass(frozen=True, kw_only=True)
class LogProbLossArgs:
    """``linear_log_prob_loss``'s options as the caller gave them (the meanings: its docstring), not yet checked;
    ``validate`` freezes them into ``LogProbLossOptions`` (as ``vpce.api.CrossEntropyArgs``). GRPO and DPO build
    one for their policy (and reference) heads."""

    loss_fn: object
    scope: str = "token"
    use_entropy: bool = False
    temperature: float = 1.0
    softcap: float | None = None
    logit_scale: float = 1.0
    ignore_index: int = -100
    memory_budget: str | float = "auto"
    entropy_stats: bool = False
    """Compute the entropy as an output (a metric) even where ``loss_fn`` does not get it."""
    top1: bool = False
    """Also return ``linear_log_probs``' ``is_top1`` (detached, from the same pass)."""
    mean_logits: bool = False
    """Also return ``linear_log_probs``' ``mean_logits`` (detached, from the same pass)."""

    def validate(self, target: torch.Tensor) -> LogProbLossOptions:
        """The checked options (``ValueError``/``TypeError`` naming the argument) for ``target`` (checked already:
        a tensor)."""
        if not callable(self.loss_fn):
            raise TypeError(f"loss_fn: expected a callable, got {type(self.loss_fn).__name__}")
        if self.scope not in SCOPES:
            raise ValueError(f"scope: expected one of {SCOPES}, got {self.scope!r}")
        if self.scope == "sequence" and target.dim() != 2:
            raise ValueError(f"target: expected [B, T] with scope='sequence', got shape {tuple(target.shape)}")
        check_bool("use_entropy", self.use_entropy)
        check_int("ignore_index", self.ignore_index, allow_none=False)
        check_number("temperature", self.temperature, low=0.0, low_open=True)
        check_number("softcap", self.softcap, low=0.0, low_open=True, allow_none=True)
        check_logit_scale(self.logit_scale)
        budget = check_memory_budget(self.memory_budget)
        return LogProbLossOptions(
            loss_fn=self.loss_fn, scope=self.scope, entropy=self.use_entropy,
            entropy_stats=self.use_entropy or self.entropy_stats, row=target.shape[-1] if target.dim() else 1,
            ignore_index=int(self.ignore_index), softcap=None if self.softcap is None else float(self.softcap),
            logit_scale=float(self.logit_scale), temperature=float(self.temperature), memory_budget=budget,
            top1=bool(self.top1), mean_logits=bool(self.mean_logits))


def _log_prob_loss(hidden, weight, target, bias, args: LogProbLossArgs, *, inputs=None, group=None, vocab_start=None,
                   vocab_size=None, sequence_parallel=False, backend="auto", validate=False):
    """``linear_log_prob_loss`` returning ``(loss, log_probs, entropy)``, and with ``args.top1`` or
    ``args.mean_logits`` also ``linear_log_probs``' ``is_top1`` and ``mean_logits`` (each ``(0,)`` where not asked):
    ``(loss, log_probs, entropy, is_top1, mean_logits)``."""
    entry = LogProbLossEntry(args, target, inputs)
    h2, weight, bias, target, call = prepare_call(entry, hidden, weight, target, bias, group=group,
                                                  vocab_start=vocab_start, vocab_size=vocab_size,
                                                  sequence_parallel=sequence_parallel, backend=backend,
                                                  validate=validate)
    with torch.autocast(h2.device.type, enabled=False):  # (the Function casts the parameters)
        loss, logp, ent, is_top1, mean_z = LogProbLossFunction.apply(enter(h2, call), weight, bias, target.reshape(-1),
                                                                     entry.options, call, entry.inputs)
    out = loss, logp.reshape(target.shape), ent.reshape(target.shape)
    if args.top1 or args.mean_logits:
        shape = lambda x: x.reshape(target.shape) if x.numel() else x  # noqa: E731
        return (*out, shape(is_top1), shape(mean_z))
    return out


class LogProbLossEntry(Entry):
    """``linear_log_prob_loss`` in ``prepare_call``: its checks, the fields every rank must agree on, its plan
    (``routing.plan_log_prob_loss``: the fast route or the two-pass form) and sizes."""

    name = "logprob_loss"

    def __init__(self, args: LogProbLossArgs, target, inputs):
        self.args, self.target, self.raw_inputs = args, target, inputs
        self.ignore_index = args.ignore_index if isinstance(args.ignore_index, int) else -100
        self.options = self.inputs = None

    def checks(self, _w, _cast):
        self.options = self.args.validate(self.target)
        self.inputs = _check_inputs(self.raw_inputs, self.target)

    def fields(self):
        o = self.options
        return [("ignore_index", o.ignore_index), ("temperature", o.temperature), ("softcap", o.softcap),
                ("logit_scale", o.logit_scale), ("scope", o.scope), ("use_entropy", o.entropy),
                ("entropy", o.entropy_stats), ("memory_budget", o.memory_budget),
                ("inputs", ",".join(f"{k}:{tuple(v.shape[1:])}" for k, v in sorted(self.inputs.items())))]

    def plan(self, needs, _dtype, backend_name, sharded, sp) -> Plan:
        return plan_log_prob_loss(self.options, needs, backend_name, sharded, sp)

    def memory(self, p, h, rows, needs, world):
        return settle_by_memory(p, h, rows, needs, self.options.chunk_options(), world,
                                self.weight_cast, whole_ok=True)

    def size(self, plan, shard, d, dtype):
        return size_log_prob_loss(plan, self.options, shard, d, dtype, self.weight_cast)


# -- GRPO (TRL 1.16 GRPOTrainer._compute_loss) -------------------------------------------------------------------

class GRPOOutput(NamedTuple):
    loss: torch.Tensor
    """The GRPO loss (differentiable, 0-d)."""
    kl: torch.Tensor | None
    """Masked mean of the k3 KL estimate against ``ref_log_probs`` (times the importance ratio with
    ``use_bias_correction_kl``, as TRL logs it; detached); None with ``beta=0``."""
    clip_ratio: torch.Tensor
    """Share of tokens whose ratio is clipped in the direction that stops the gradient (TRL's
    ``clip_ratio/region_mean``; ``cispo_clip_ratio`` for ``cispo``), detached."""
    entropy: torch.Tensor
    """Masked mean of the per-token entropy (detached)."""


def vllm_importance_sampling_ratio(old_log_probs, sampling_log_probs, mask, *, mode="sequence_mask", clip_min=None,
                                   clip_max=3.0) -> torch.Tensor:
    """TRL 1.16's vLLM importance-sampling correction (``GRPOTrainer._generate_and_score_completions``): the ratio
    ``pi_old / pi_sampler`` of the trainer's and the sampler's log-probs (``[B, T]``; ``mask`` ``[B, T]``, 1 at the
    completion tokens), per token (``"token_*"`` modes: ``[B, T]``) or per sequence (``"sequence_*"``: the exp of the
    masked sum, ``[B, 1]``); ``*_truncate`` clamps it to ``[clip_min, clip_max]``, ``*_mask`` sets it to 0 outside
    (None: unbounded). A NaN sampler log-prob gives a ratio of 1 at that token. Detached; pass it to
    ``linear_grpo_loss(importance_sampling_ratio=...)``."""
    if mode not in VLLM_IMPORTANCE_SAMPLING_MODES:
        raise ValueError(f"mode: expected one of {VLLM_IMPORTANCE_SAMPLING_MODES}, got {mode!r}")
    check_number("clip_min", clip_min, allow_none=True)
    check_number("clip_max", clip_max, allow_none=True)
    diff = torch.nan_to_num((old_log_probs.detach() - sampling_log_probs.detach()) * mask, nan=0.0)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)
    ratio = torch.exp(diff)
    if mode.endswith("truncate"):
        return torch.clamp(ratio, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return ratio.masked_fill((ratio < low) | (ratio > high), 0.0)


@dataclass(frozen=True)
class GRPOTerms:
    """The options of ``linear_grpo_loss``'s per-token loss (``grpo_token_loss``), checked."""
    loss_type: str
    level: str
    beta: float
    eps_low: float
    eps_high: float
    delta: float | None
    bias_correction_kl: bool
    sapo_temperatures: tuple[float, float]
    """(positive advantages, negative ones)"""
    vespo: tuple[float, float, float, float]
    """(k_pos, lambda_pos, k_neg, lambda_neg)"""
    off_policy_threshold: float | None
    top_entropy_quantile: float
    entropy_group: object
    entropy_coef: float
    scope: str
    width: int
    """T: the row length (rows of the flat tokens in scope ``"batch"``)"""


def gather_varying(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's 1-d ``x`` (lengths may differ), concatenated in rank order. Two all-gathers on every rank,
    of sizes every rank derives from the first (the lengths): the same collectives whatever the local length."""
    _, world = group_rank_and_size(group)
    n = torch.tensor([x.numel()], dtype=torch.int64, device=x.device)
    counts = n.new_empty(world)
    all_gather_tensor(counts, n, group=group)
    width = max(int(counts.max()), 1)
    padded = x.new_zeros(width)
    padded[:x.numel()] = x
    every = x.new_empty(world * width)
    all_gather_tensor(every, padded, group=group)
    return every[(torch.arange(width, device=x.device)[None, :] < counts[:, None]).reshape(-1)]


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, quantile: float, group=None) -> torch.Tensor:
    """TRL 1.16's ``get_high_entropy_mask``: 1 at the tokens of ``mask`` whose entropy is at least the
    ``1 - quantile`` quantile of every masked token's entropy, over all ranks of ``group`` (None: these tokens
    only); 0 elsewhere (all 0 where no rank has a token). In ``entropy``'s dtype."""
    keep = mask != 0
    every = entropy[keep]
    if group is not None:
        every = gather_varying(every, group)
    if every.numel() == 0:
        return torch.zeros_like(entropy)
    threshold = torch.quantile(every, 1.0 - quantile)
    return ((entropy * mask >= threshold) & keep).to(entropy.dtype)


def _vespo_weights(t: GRPOTerms, adv, log_ratio, mask, is_ratio):
    """TRL's ``get_gamma_weights``: ``phi(w) = exp(lambda + k log w - lambda w)`` of each sequence's ratio ``w``
    (times the sampler correction ``is_ratio``), k and lambda by the advantage's sign; detached."""
    low = math.log(1e-8)
    seq = (torch.clamp(log_ratio, -20.0, 20.0) * mask).sum(-1, keepdim=True)
    if is_ratio is not None:
        seq = seq + (torch.clamp(torch.log(is_ratio), low, 20.0) * mask).sum(-1, keepdim=True)
    log_w = torch.clamp(seq, low, 20.0)
    k_pos, lambda_pos, k_neg, lambda_neg = t.vespo
    nonneg = adv >= 0
    k = torch.where(nonneg, k_pos, k_neg)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).clamp(min=1e-4)
    return torch.exp(lam + k * log_w - lam * torch.exp(log_w)).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def _off_policy_mask(adv, logp, sampling, mask, threshold):
    """TRL's ``get_off_policy_mask``: keep a sequence whose advantage is >= 0 or whose mean KL to the sampler is at
    most ``threshold``."""
    kl = torch.nan_to_num(sampling - logp, nan=0.0)
    seq = (kl * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((adv >= 0) | (seq <= threshold)).to(mask.dtype)


def grpo_token_loss(t: GRPOTerms, logp, entropy, adv, weight, mask, old=None, ref=None, is_ratio=None, sampling=None,
                    bonus=None):
    """TRL 1.16's per-token GRPO loss (``GRPOTrainer._compute_loss``) times each token's normalizer ``weight``,
    minus ``bonus * entropy``: rows ``[b, T]`` (whole sequences), or flat tokens where nothing needs a row. The
    ``loss_fn`` of ``linear_grpo_loss``."""
    f = logp.dtype
    adv, weight, mask = adv.to(f), weight.to(f), mask.to(f)
    old = logp.detach() if old is None else old.to(f)
    is_ratio = None if is_ratio is None else is_ratio.to(f)
    log_ratio = logp - old
    if t.level == "sequence":
        log_w = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    else:
        log_w = log_ratio
    coef_1 = torch.exp(log_w)
    if t.beta != 0.0:
        r = ref.to(f)
        kl = torch.exp(r - logp) - (r - logp) - 1
        if t.bias_correction_kl:
            kl = kl * coef_1
    if t.loss_type == "cispo":
        per_token = -torch.clamp(coef_1, max=t.eps_high).detach() * adv * logp
    elif t.loss_type == "sapo":
        temps = torch.where(adv > 0, t.sapo_temperatures[0], t.sapo_temperatures[1])
        per_token = -torch.sigmoid(temps * (coef_1 - 1)) * 4 / temps * adv
    elif t.loss_type == "vespo":
        per_token = -_vespo_weights(t, adv, log_ratio.detach(), mask, is_ratio) * adv * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - t.eps_low, 1 + t.eps_high)
        if t.delta is not None:
            coef_1 = torch.clamp(coef_1, max=t.delta)
        per_token = -torch.minimum(coef_1 * adv, coef_2 * adv)
    if t.off_policy_threshold is not None:
        sampling = old if sampling is None else sampling.to(f)
        per_token = per_token * _off_policy_mask(adv, logp.detach(), sampling, mask, t.off_policy_threshold)
    kept = mask
    if t.top_entropy_quantile < 1.0:
        high = high_entropy_mask(entropy.detach(), mask, t.top_entropy_quantile, t.entropy_group)
        per_token = per_token * high
        kept = mask * high
    if is_ratio is not None and t.loss_type != "vespo":
        per_token = per_token * is_ratio
    if t.beta != 0.0:
        per_token = per_token + t.beta * kl
    out = per_token.expand_as(logp) * weight
    if t.entropy_coef != 0.0:
        if bonus is None:  # the tokens it acts on are known only now (the entropy mask): scope "batch"
            bonus = t.entropy_coef * kept / kept.sum().clamp(min=1.0)
        out = out - bonus.to(f) * entropy
    return out


def _grpo_rows(t: GRPOTerms):
    """``grpo_token_loss`` as a ``loss_fn``: in scope ``"batch"`` the flat tokens are cut into rows first."""
    def loss_fn(logp, entropy, **x):
        if t.scope != "batch":
            return grpo_token_loss(t, logp, entropy, **x)
        rows = lambda y: None if y is None else y.reshape(-1, t.width)  # noqa: E731
        return grpo_token_loss(t, rows(logp), rows(entropy), **{k: rows(v) for k, v in x.items()}).reshape(-1)

    return loss_fn


def _grpo_normalizer(loss_type, mask, max_completion_length, num_items_in_batch):
    b_, t_ = mask.shape
    if loss_type in ("grpo", "sapo"):
        return mask / mask.sum(-1, keepdim=True).clamp(min=1.0) / b_
    if loss_type == "bnpo":
        return mask / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        return mask / (b_ * (t_ if max_completion_length is None else max_completion_length))
    if loss_type == "luspo":
        return mask / b_
    items = mask.sum() if num_items_in_batch is None else torch.as_tensor(num_items_in_batch, dtype=mask.dtype,
                                                                          device=mask.device)
    return mask / items.clamp(min=1.0)  # dapo, cispo, vespo


def _per_row(name, x, b_, t_):
    """A detached ``[B, T]``, ``[B, 1]`` or ``[B]`` tensor as ``[B, T]``."""
    if not isinstance(x, torch.Tensor) or tuple(x.shape) not in ((b_,), (b_, 1), (b_, t_)):
        raise ValueError(f"{name}: expected a tensor of shape ({b_},), ({b_}, 1) or ({b_}, {t_}), got "
                         f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    x = x.detach()
    return (x.reshape(b_, 1) if x.dim() == 1 else x).expand(b_, t_)


def linear_grpo_loss(hidden, weight, target, advantages, bias=None, *, old_log_probs=None, ref_log_probs=None,
                     beta=0.0, epsilon_low=0.2, epsilon_high=None, delta=None, loss_type="dapo",
                     importance_sampling_level="token", max_completion_length=None, num_items_in_batch=None,
                     use_bias_correction_kl=True, importance_sampling_ratio=None, sampling_log_probs=None,
                     off_policy_mask_threshold=None, sapo_temperature_pos=1.0, sapo_temperature_neg=1.05,
                     vespo_k_pos=2.0, vespo_lambda_pos=3.0, vespo_k_neg=3.0, vespo_lambda_neg=2.0,
                     entropy_coef=0.0, top_entropy_quantile=1.0, top_entropy_group=None, token_weight=None,
                     temperature=1.0, softcap=None, logit_scale=1.0, ignore_index=-100, group=None, vocab_start=None,
                     vocab_size=None, sequence_parallel=False, backend="auto", memory_budget="auto",
                     validate=False, return_outputs=False):
    """TRL 1.16's GRPO loss (``GRPOTrainer._compute_loss``) of the policy head, fused (``linear_log_prob_loss``).

    ``hidden`` is ``[B, T, D]`` (or this rank's slice of ``B*T`` tokens with ``sequence_parallel``), ``target``
    ``[B, T]``: completion tokens, prompt and padding set to ``ignore_index`` (the mask). ``advantages``: ``[B]``
    or ``[B, T]``. ``old_log_probs`` (``[B, T]``): the sampling policy's log-probs, None for the current ones
    detached (one iteration per generation). ``ref_log_probs``: needed with ``beta != 0`` (the k3 KL estimate);
    ``use_bias_correction_kl`` (TRL's default): the KL term times the importance ratio.
    ``epsilon_high`` defaults to ``epsilon_low``; ``delta``: two-sided clipping's upper bound on the ratio.
    ``loss_type`` in ``GRPO_LOSS_TYPES`` (``sapo``: ``sapo_temperature_pos`` / ``_neg``; ``vespo``: the gamma
    weights' ``vespo_*``); ``importance_sampling_level`` ``"token"`` or ``"sequence"`` (GSPO).

    Corrections and masks, as TRL applies them to the per-token policy term (not to the KL term):
    ``importance_sampling_ratio`` (``[B, T]``, ``[B, 1]`` or ``[B]``; ``vllm_importance_sampling_ratio``): TRL's vLLM
    correction, a detached factor (``vespo``: folded into the gamma weights, per token only);
    ``off_policy_mask_threshold``: drop a sequence with a negative advantage whose mean KL between
    ``sampling_log_probs`` (default ``old_log_probs``) and the current policy exceeds it;
    ``top_entropy_quantile < 1``: only the tokens whose entropy is in the top quantile of all masked tokens, over
    every rank of ``top_entropy_group`` (a process group whose ranks' tokens share the quantile, as TRL's gather
    over its processes; None: this call's tokens), one pass over the logits more (the loss needs every token's
    entropy first: scope ``"batch"``). ``entropy_coef``: the loss minus ``entropy_coef`` times the masked mean
    entropy (over the tokens the entropy mask keeps).

    Normalizers: ``grpo`` and ``sapo`` each sequence's mean then the mean over sequences; ``bnpo`` the mask's count;
    ``dr_grpo`` ``B * max_completion_length`` (default ``T``); ``luspo`` each sequence's sum, mean over sequences;
    ``dapo``, ``cispo`` and ``vespo`` ``num_items_in_batch`` (default the mask's count). ``token_weight``
    (``[B, T]``): each token's normalizer, given instead (e.g. the tokens of several sequences packed into one row
    with token-level terms, or a gradient-accumulation factor folded in). No gradient-accumulation normalizer is
    applied otherwise (divide the loss as the trainer does).

    Returns ``GRPOOutput``, or with ``return_outputs`` ``(GRPOOutput, log_probs, entropy)``: also the detached
    per-token log-probs and entropy ``[B, T]`` (0 at ignored tokens).
    """
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
    for name in ("use_bias_correction_kl", "return_outputs"):
        check_bool(name, locals()[name])
    check_number("off_policy_mask_threshold", off_policy_mask_threshold, allow_none=True)
    for name in ("sapo_temperature_pos", "sapo_temperature_neg"):
        check_number(name, locals()[name], low=0.0, low_open=True)
    for name in ("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg", "entropy_coef"):
        check_number(name, locals()[name])
    check_number("top_entropy_quantile", top_entropy_quantile, low=0.0, high=1.0)
    eps_high = epsilon_low if epsilon_high is None else float(epsilon_high)
    if not isinstance(advantages, torch.Tensor) or tuple(advantages.shape) not in ((b_,), (b_, t_)):
        raise ValueError(f"advantages: expected a tensor of shape ({b_},) or ({b_}, {t_}), got "
                         f"{tuple(advantages.shape) if isinstance(advantages, torch.Tensor) else type(advantages)}")
    if beta != 0.0 and ref_log_probs is None:
        raise ValueError("ref_log_probs: expected the reference policy's [B, T] log-probs with beta != 0, got None")
    if loss_type == "vespo" and importance_sampling_ratio is not None and tuple(importance_sampling_ratio.shape) != (
            b_, t_):
        raise ValueError(f"importance_sampling_ratio: expected a per-token ratio ({b_}, {t_}) with loss_type='vespo' "
                         f"(TRL's token_* modes), got {tuple(importance_sampling_ratio.shape)}")
    acc = torch.float64 if getattr(hidden, "dtype", None) == torch.float64 else torch.float32
    mask = (target != ignore_index).to(acc)
    adv = _per_row("advantages", advantages, b_, t_).to(acc)
    weight_tok = _grpo_normalizer(loss_type, mask, max_completion_length, num_items_in_batch)
    if token_weight is not None:
        weight_tok = mask * _per_row("token_weight", token_weight, b_, t_).to(device=mask.device, dtype=acc)
    inputs = {"adv": adv, "weight": weight_tok, "mask": mask}
    for key, name, x in (("old", "old_log_probs", old_log_probs), ("ref", "ref_log_probs", ref_log_probs),
                         ("is_ratio", "importance_sampling_ratio", importance_sampling_ratio),
                         ("sampling", "sampling_log_probs", sampling_log_probs)):
        if x is not None and (key != "ref" or beta != 0.0) and (key != "sampling" or off_policy_mask_threshold
                                                                 is not None):
            inputs[key] = _per_row(name, x, b_, t_)
    entropy_mask = float(top_entropy_quantile) < 1.0
    if entropy_coef != 0.0 and not entropy_mask:
        inputs["bonus"] = float(entropy_coef) * mask / mask.sum().clamp(min=1.0)
    rows = importance_sampling_level == "sequence" or loss_type == "vespo" or off_policy_mask_threshold is not None
    scope = "batch" if entropy_mask else "sequence" if rows else "token"
    terms = GRPOTerms(loss_type=loss_type, level=importance_sampling_level, beta=float(beta),
                      eps_low=float(epsilon_low), eps_high=eps_high, delta=None if delta is None else float(delta),
                      bias_correction_kl=use_bias_correction_kl and beta != 0.0,
                      sapo_temperatures=(float(sapo_temperature_pos), float(sapo_temperature_neg)),
                      vespo=(float(vespo_k_pos), float(vespo_lambda_pos), float(vespo_k_neg), float(vespo_lambda_neg)),
                      off_policy_threshold=None if off_policy_mask_threshold is None else
                      float(off_policy_mask_threshold), top_entropy_quantile=float(top_entropy_quantile),
                      entropy_group=top_entropy_group, entropy_coef=float(entropy_coef), scope=scope, width=t_)
    args = LogProbLossArgs(loss_fn=_grpo_rows(terms), scope=scope, use_entropy=entropy_coef != 0.0 or entropy_mask,
                           temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                           ignore_index=ignore_index, memory_budget=memory_budget, entropy_stats=True)
    loss, logp, ent = _log_prob_loss(hidden, weight, target, bias, args, inputs=inputs, group=group,
                                     vocab_start=vocab_start, vocab_size=vocab_size,
                                     sequence_parallel=sequence_parallel, backend=backend, validate=validate)
    per_sequence = importance_sampling_level == "sequence" and advantages.dim() == 1
    out = GRPOOutput(loss, *_grpo_metrics(logp, ent, old_log_probs, ref_log_probs, adv, mask, terms, per_sequence))
    return (out, logp, ent) if return_outputs else out


def _grpo_metrics(logp, ent, old, ref, adv, mask, t: GRPOTerms, per_sequence: bool):
    """TRL's logged ``kl``, clip ratio and ``entropy`` (masked means over the tokens; detached). ``per_sequence``
    (sequence-level ratios, ``[B]`` advantages): the clip ratio is the mean over sequences, as TRL's."""
    logp = logp.detach()
    dtype = logp.dtype
    mask, adv = mask.to(dtype), adv.to(dtype)
    old = logp if old is None else old.detach().to(dtype)
    count = mask.sum().clamp(min=1.0)
    log_ratio = logp - old
    if t.level == "sequence":
        coef = torch.exp((log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0))
    else:
        coef = torch.exp(log_ratio)
    kl = None
    if t.beta != 0.0:
        r = ref.detach().to(dtype)
        per_token_kl = torch.exp(r - logp) - (r - logp) - 1
        if t.bias_correction_kl:
            per_token_kl = per_token_kl * coef
        kl = (per_token_kl * mask).sum() / count
    if t.loss_type == "cispo":
        clipped = (coef > t.eps_high) & (adv > 0)
    else:
        clipped = ((coef < 1 - t.eps_low) & (adv < 0)) | ((coef > 1 + t.eps_high) & (adv > 0))
    if per_sequence:
        clip_ratio = clipped[:, :1].to(dtype).mean()
    else:
        clip_ratio = (clipped.to(dtype) * mask).sum() / count
    entropy = (ent.detach().to(dtype) * mask).sum() / count
    return kl, clip_ratio, entropy


# -- DPO (TRL 1.16 DPOTrainer._compute_loss) ---------------------------------------------------------------------

class DPOOutput(NamedTuple):
    loss: torch.Tensor
    """The DPO loss: the weighted sum over loss types of each one's mean over pairs (differentiable, 0-d)."""
    chosen_rewards: torch.Tensor
    """``beta * (log pi(chosen) - log ref(chosen))`` per pair ``[B]`` (detached)."""
    rejected_rewards: torch.Tensor
    """The same for the rejected completions ``[B]`` (detached)."""
    chosen_log_probs: torch.Tensor | None = None
    """The chosen completions' sequence log-probs ``[B]`` (``ld_alpha``-weighted where given; detached)."""
    rejected_log_probs: torch.Tensor | None = None
    """The same for the rejected completions ``[B]``."""


def _no_loss(logp, entropy):
    return logp.new_zeros(())


@dataclass(frozen=True)
class DPOTerms:
    """The options of ``linear_dpo_loss``'s per-pair loss (``dpo_pair_loss``), checked."""
    loss_types: tuple[str, ...]
    loss_weights: tuple[float, ...]
    beta: float
    label_smoothing: float
    discopop_tau: float
    f_divergence_type: str
    f_alpha_divergence_coef: float
    pairs: int
    """B: every loss type is a mean over the batch's pairs"""


def _dpo_scores(t: DPOTerms, logratios):
    """TRL's ``f_divergence_type`` score of a log-ratio ``log pi - log ref``."""
    if t.f_divergence_type == "reverse_kl" or (t.f_divergence_type == "alpha_divergence"
                                                and abs(t.f_alpha_divergence_coef - 1.0) < 1e-6):
        return logratios
    if t.f_divergence_type == "forward_kl":
        return 1 - torch.exp(-logratios)
    if t.f_divergence_type == "js_divergence":
        return math.log(2) + F.logsigmoid(logratios)
    a = t.f_alpha_divergence_coef - 1.0
    high = 11.0 if logratios.dtype == torch.float16 else 80.0
    return (torch.exp(torch.clamp(a * logratios, max=high)) - 1.0) / a


def dpo_pair_loss(t: DPOTerms, chosen, rejected, ref_chosen, ref_rejected, len_chosen, len_rejected, sft):
    """TRL 1.16's DPO loss of pairs (``DPOTrainer._compute_loss``), each loss type's mean over the batch's
    ``t.pairs`` pairs taken as this part's share: the sum over the pairs given of ``weight * loss / B``. ``chosen``,
    ``rejected``: the policy's sequence log-probs; ``len_*``: the completions' lengths (``ipo``,
    ``sigmoid_norm``); ``sft``: each pair's share of the ``sft`` loss (the chosen log-probs over the batch's chosen
    tokens). ``aot`` and ``aot_unpaired`` sort over the pairs given: every pair at once."""
    beta, eps = t.beta, t.label_smoothing
    chosen_lr, rejected_lr = chosen - ref_chosen, rejected - ref_rejected
    chosen_s, rejected_s = _dpo_scores(t, chosen_lr), _dpo_scores(t, rejected_lr)
    delta = chosen_s - rejected_s
    total = 0.0
    for loss_type, w in zip(t.loss_types, t.loss_weights):
        if loss_type == "sigmoid":
            per = -F.logsigmoid(beta * delta)
        elif loss_type == "hinge":
            per = torch.relu(1 - beta * delta)
        elif loss_type in ("ipo", "sigmoid_norm"):
            d = chosen_s / len_chosen.clamp(min=1.0) - rejected_s / len_rejected.clamp(min=1.0)
            per = (d - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * d)
        elif loss_type == "exo_pair":
            e = torch.tensor(eps, dtype=delta.dtype, device=delta.device)
            per = torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-e)) + \
                torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(e))
        elif loss_type == "nca_pair":
            per = -F.logsigmoid(beta * chosen_lr) - 0.5 * F.logsigmoid(-beta * chosen_lr) \
                - 0.5 * F.logsigmoid(-beta * rejected_lr)
        elif loss_type == "robust":
            per = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        elif loss_type == "bco_pair":
            per = -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
        elif loss_type == "sppo_hard":
            per = (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
        elif loss_type in ("aot", "aot_unpaired"):
            if loss_type == "aot":
                d = torch.sort(chosen - rejected, dim=0)[0] - torch.sort(ref_chosen - ref_rejected, dim=0)[0]
            else:
                d = torch.sort(chosen_lr, dim=0)[0] - torch.sort(rejected_lr, dim=0)[0]
            per = -F.logsigmoid(beta * d) * (1 - eps) - F.logsigmoid(-beta * d) * eps
        elif loss_type == "apo_zero":
            per = 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
        elif loss_type == "apo_down":
            per = torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(beta * (chosen_lr - rejected_lr))
        elif loss_type == "discopop":
            z = beta * delta
            mix = torch.sigmoid(z / t.discopop_tau)
            per = -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix
        else:  # sft: the batch's mean chosen log-prob, this pair's share
            total = total - w * sft
            continue
        total = total + w * per / t.pairs
    return total


def _dpo_token_weights(mask, ld_alpha, t_):
    """Each token's weight in its sequence log-prob: 1, or with ``ld_alpha`` (TRL's LD-DPO) 1 over the first
    ``min(len_chosen, len_rejected)`` tokens of a pair's completions and ``ld_alpha`` after. ``mask``: the
    interleaved ``[B, 2T]`` rows."""
    if ld_alpha is None:
        return mask
    chosen, rejected = mask[:, :t_], mask[:, t_:]
    shared = torch.minimum(chosen.sum(-1), rejected.sum(-1))[:, None]

    def weights(m):
        pos = m.cumsum(-1)
        return torch.where((pos > 0) & (pos <= shared), 1.0, torch.where(pos > shared, ld_alpha, 0.0)).to(m) * m

    return torch.cat([weights(chosen), weights(rejected)], dim=-1)


def linear_dpo_loss(hidden, weight, target, ref_chosen_log_probs=None, ref_rejected_log_probs=None, bias=None, *,
                    beta=0.1, loss_type="sigmoid", loss_weights=None, label_smoothing=0.0, discopop_tau=0.05,
                    f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5, ld_alpha=None,
                    completion_lengths=None, ref_hidden=None, ref_weight=None, ref_bias=None, temperature=1.0,
                    softcap=None, logit_scale=1.0, ignore_index=-100, group=None, vocab_start=None, vocab_size=None,
                    sequence_parallel=False, backend="auto", memory_budget="auto", validate=False,
                    return_outputs=False, return_logit_metrics=False):
    """TRL 1.16's DPO loss (``DPOTrainer._compute_loss``) of the policy head, fused (``linear_log_prob_loss``).

    TRL's concatenated batch: ``hidden`` ``[2B, T, D]``, ``target`` ``[2B, T]``; rows ``[0, B)`` are the chosen
    completions, rows ``[B, 2B)`` the rejected ones, prompt and padding ``ignore_index``. Sequence log-probs are
    summed over the non-ignored tokens (``ld_alpha``: TRL's LD-DPO weights, 1 over the tokens a pair's completions
    share in length and ``ld_alpha`` beyond). ``ref_chosen_log_probs`` / ``ref_rejected_log_probs`` (``[B]``): the
    reference's sequence log-probs; or ``ref_hidden`` (``[2B, T, D_ref]``) and ``ref_weight`` (and ``ref_bias``): the
    reference head, computed here without gradient.

    ``loss_type``: one of ``DPO_LOSS_TYPES`` or a sequence of them, summed with ``loss_weights`` (default 1 each);
    each is TRL's, a mean over pairs, with TRL's ``label_smoothing`` (``exo_pair``, ``robust``, ``aot*``),
    ``discopop_tau`` and ``f_divergence_type`` / ``f_alpha_divergence_coef`` (the scores of the log-ratios).
    ``ipo`` and ``sigmoid_norm`` divide each log-ratio by its completion's length: ``completion_lengths``
    (``[2B]``; TRL's ``completion_mask.sum(1)``, which counts a completion's first token even where nothing
    predicts it) or, by default, the non-ignored tokens of each row. ``aot`` and ``aot_unpaired`` sort over the
    batch's pairs, so they take every token at once (one pass over the logits more). The hidden states are
    interleaved by pair (one copy of ``[N, D]``) so that each fused row holds a chosen completion and its rejected
    one.

    Returns ``DPOOutput``; with ``return_outputs`` ``(DPOOutput, log_probs, entropy)``: also the detached per-token
    log-probs and entropy ``[2B, T]`` (0 at ignored tokens); ``return_logit_metrics`` adds ``is_top1`` and
    ``mean_logits`` in that layout (``linear_log_probs``' definitions), from the same pass.
    """
    types = (loss_type,) if isinstance(loss_type, str) else tuple(loss_type) if isinstance(loss_type, (list, tuple)) \
        else None
    if not types or any(x not in DPO_LOSS_TYPES for x in types):
        raise ValueError(f"loss_type: expected one of {DPO_LOSS_TYPES} or a non-empty sequence of them, got "
                         f"{loss_type!r}")
    weights = (1.0,) * len(types) if loss_weights is None else tuple(loss_weights)
    if len(weights) != len(types):
        raise ValueError(f"loss_weights: expected one weight per loss type ({len(types)}), got {len(weights)}")
    for w in weights:
        check_number("loss_weights", w)
    check_number("beta", beta, low=0.0, low_open=True)
    check_number("label_smoothing", label_smoothing, low=0.0, high_open=1.0)
    check_number("discopop_tau", discopop_tau, low=0.0, low_open=True)
    check_number("f_alpha_divergence_coef", f_alpha_divergence_coef)
    check_number("ld_alpha", ld_alpha, allow_none=True)
    check_bool("return_outputs", return_outputs)
    check_bool("return_logit_metrics", return_logit_metrics)
    if f_divergence_type not in F_DIVERGENCE_TYPES:
        raise ValueError(f"f_divergence_type: expected one of {F_DIVERGENCE_TYPES}, got {f_divergence_type!r}")
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
    acc = torch.float64 if getattr(hidden, "dtype", None) == torch.float64 else torch.float32
    f32 = lambda x: x.detach().to(device=target.device, dtype=acc)  # noqa: E731
    # interleave by pair: row b of the fused view holds chosen completion b, then rejected completion b
    pair = lambda x: x.reshape(2, b_, t_, *x.shape[2:]).transpose(0, 1).reshape(b_, 2 * t_, *x.shape[2:])  # noqa: E731
    mask = pair((target != ignore_index).to(acc))
    tok_w = _dpo_token_weights(mask, None if ld_alpha is None else float(ld_alpha), t_)
    # both heads' logits as the policy's: the reference's log-probs alone (no loss), then the policy's loss
    ref_args = LogProbLossArgs(loss_fn=_no_loss, temperature=temperature, softcap=softcap, logit_scale=logit_scale,
                               ignore_index=ignore_index)
    if ref_hidden is not None:
        if ref_weight is None:
            raise ValueError("ref_weight: expected the reference head's weight with ref_hidden, got None")
        with torch.no_grad():  # the reference's log-probs alone: one statistics pass, no gradient
            _, ref_tok, _ = _log_prob_loss(ref_hidden, ref_weight, target, ref_bias, ref_args, group=group,
                                           vocab_start=vocab_start, vocab_size=vocab_size, backend=backend)
        ref_seq = pair(ref_tok.to(acc)) * tok_w
        ref_chosen, ref_rejected = ref_seq[:, :t_].sum(-1), ref_seq[:, t_:].sum(-1)
    else:
        ref_chosen, ref_rejected = ref_chosen_log_probs, ref_rejected_log_probs
        for name, x in (("ref_chosen_log_probs", ref_chosen), ("ref_rejected_log_probs", ref_rejected)):
            if not isinstance(x, torch.Tensor) or tuple(x.shape) != (b_,):
                raise ValueError(f"{name}: expected a tensor of shape ({b_},), got "
                                 f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    if completion_lengths is None:
        lengths = (target != ignore_index).to(acc).sum(-1)
    elif not isinstance(completion_lengths, torch.Tensor) or tuple(completion_lengths.shape) != (two_b,):
        got = completion_lengths
        raise ValueError(f"completion_lengths: expected a tensor of shape ({two_b},), got "
                         f"{tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__}")
    else:
        lengths = f32(completion_lengths)
    row = lambda x: x[:, None].expand(b_, 2 * t_)  # noqa: E731  (a per-pair value, along its fused row)
    sft_tokens = mask[:, :t_].sum().clamp(min=1.0)
    inputs = {"ref_c": row(f32(ref_chosen)), "ref_r": row(f32(ref_rejected)), "len_c": row(lengths[:b_]),
              "len_r": row(lengths[b_:]), "tok_w": tok_w, "m": mask}
    terms = DPOTerms(loss_types=types, loss_weights=tuple(float(w) for w in weights), beta=float(beta),
                     label_smoothing=float(label_smoothing), discopop_tau=float(discopop_tau),
                     f_divergence_type=f_divergence_type, f_alpha_divergence_coef=float(f_alpha_divergence_coef),
                     pairs=b_)
    scope = "batch" if {"aot", "aot_unpaired"} & set(types) else "sequence"

    def loss_fn(logp, entropy, ref_c, ref_r, len_c, len_r, tok_w, m):
        f = logp.dtype
        rows = lambda x: x.reshape(-1, 2 * t_).to(f)  # noqa: E731  (scope "batch": flat)
        logp, tok_w = rows(logp), rows(tok_w)
        weighted = logp * tok_w
        chosen, rejected = weighted[:, :t_].sum(-1), weighted[:, t_:].sum(-1)
        sft = (logp[:, :t_] * rows(m)[:, :t_]).sum(-1) / sft_tokens.to(f)
        return dpo_pair_loss(terms, chosen, rejected, rows(ref_c)[:, 0], rows(ref_r)[:, 0], rows(len_c)[:, 0],
                             rows(len_r)[:, 0], sft)

    h = pair(hidden.reshape(two_b, t_, hidden.shape[-1])) if isinstance(hidden, torch.Tensor) else hidden
    args = dataclasses.replace(ref_args, loss_fn=loss_fn, scope=scope, memory_budget=memory_budget,
                               entropy_stats=return_outputs, top1=return_logit_metrics,
                               mean_logits=return_logit_metrics)
    loss, logp, ent, *extras = _log_prob_loss(h, weight, pair(target), bias, args, inputs=inputs, group=group,
                                              vocab_start=vocab_start, vocab_size=vocab_size, backend=backend,
                                              validate=validate)
    weighted = logp.detach().to(acc) * tok_w
    chosen_logps, rejected_logps = weighted[:, :t_].sum(-1), weighted[:, t_:].sum(-1)
    beta_f = float(beta)
    out = DPOOutput(loss, beta_f * (chosen_logps - inputs["ref_c"][:, 0]),
                    beta_f * (rejected_logps - inputs["ref_r"][:, 0]), chosen_logps, rejected_logps)
    if not return_outputs:
        return out
    unpair = lambda x: x.detach().reshape(b_, 2, t_).transpose(0, 1).reshape(two_b, t_)  # noqa: E731
    return (out, unpair(logp), unpair(ent), *map(unpair, extras))
