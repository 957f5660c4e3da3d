"""TRL: the fused LM head of TRL's trainers (SFT, DPO, GRPO, RLOO, KTO), computed by vpce.

TRL 1.16 patches every model its trainers train (and their reference models) with ``trl.trainer.utils.
add_fused_lm_head``. The patched forward, called with ``fused_lm_head=True``, runs the backbone, shifts the labels
and calls, at every forward::

    per_token = trl.trainer.utils._ChunkedLogProbFunction.apply(
        hidden [N, D], lm_head.weight (whole: an FSDP2 DTensor is gathered first), lm_head.bias, labels [N],
        temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)
    log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1 = per_token     # [N] each, None where not asked

and builds a ``FusedCausalLMOutput`` from them; the trainer reduces them itself (the loss from ``log_probs``, the
logged ``entropy`` and ``mean_token_accuracy`` from ``entropy`` and ``is_top1``). TRL's own function projects
``[4096, 32768]`` tiles with cuBLAS in the compute dtype, folds them with Triton, and recomputes in backward.

``apply(**options)`` replaces that one module attribute with ``VpceLogProbHead``, which computes the same five
fields with ``vpce.linear_log_probs`` (one fused GEMM + online-softmax pass, logits in fp32, O(N) memory; the
backward recomputes the logits in vocab blocks). The forward looks the attribute up at each call, so one call
covers every model of every trainer, whether the trainer was built before or after it, and ``remove()`` restores
TRL's. Nothing else of TRL changes: labels, masking, the loss, MoE auxiliary losses, PEFT and generation are
TRL's own code.

Per-token definitions (TRL's): with ``x = h W^T + b`` and ``z = cap(scale * x) / T`` (``cap``: the model's
``final_logit_softcapping``; ``scale``: its logit scale), ``log_probs = z_t - lse(z)``, ``entropy = lse - E_p[z]``,
``log_sum_sq_probs = log sum_j p_j^2``, ``mean_logits = mean_j z_j``, ``is_top1``: ``argmax_j z_j == t`` (the lowest
id wins a tie). A logit scale other than 1 is applied to ``hidden`` and ``bias`` before vpce (differentiably).
Autocast and ``cast_lm_head_to_fp32`` behave as in TRL: the GEMM operands are in the autocast dtype, or in fp32.

Vocab parallel (``group=``): every rank of a tensor-parallel group holds the same tokens (TRL gives TP ranks the
same batch) and the whole weight as TRL hands it over (gathered from a TP DTensor by TRL). Each rank then computes
only its ``torch.chunk`` share of the vocab rows (the layout of a ``Shard(0)`` DTensor) and vpce exchanges O(N)
statistics: each rank forms ``1/world`` of the logits, and the weight's gradient lands on the rank's own rows.

Routes and memory: ``memory_budget`` goes to ``vpce.linear_log_probs`` and must be ``"auto"`` or ``"lean"``.
With ``"auto"``, a head whose ``log_probs`` the trainer reduces uniformly over the non-ignored tokens (SFT's loss,
its ``entropy`` only logged) takes vpce's speculative route from its second step, where the fast route's buffers
fit: the gradients are formed in forward, at the fast route's cost, and backward stays exact whatever the
trainer's upstream gradient turns out to be. A frozen lm_head (LoRA) takes it
from the first step. Every other call takes the lean route, as ``"lean"`` always does. There forward keeps three
fp32 statistics per token and backward recomputes the logits in blocks, so a long sequence costs O(N) beyond the
gradients.

Fused losses (``apply(losses=True)``, the default): ``GRPOTrainer._compute_loss`` and ``DPOTrainer._compute_loss``
take their loss from ``vpce.linear_grpo_loss`` / ``vpce.linear_dpo_loss`` on the policy's hidden states and lm_head
(gradients formed in forward), with TRL's normalizers and logged metrics; configurations they do not cover run TRL's
own loss with one warning naming the reason (the section "Fused losses" below; docs/integrations.md).
"""

from __future__ import annotations

import math

import torch

import vpce

try:
    import trl  # noqa: F401 - cheap (lazy); trl.trainer.utils, which imports the trainers' stack, only in apply()
except ImportError as err:  # pragma: no cover - exercised only without trl
    raise ImportError("vpce.integrations.trl needs the `trl` package: pip install 'trl==1.16.0' (the `trl` extra; "
                      "from a vpce clone: pip install '.[trl]'; README.md#install)") from err

__all__ = ["apply", "remove", "is_applied", "VpceLogProbHead", "OPTIONS", "LOSS_OPTIONS"]

#: Keywords ``apply`` accepts: the head's, then the fused losses' (``LOSS_OPTIONS``).
OPTIONS = ("backend", "validate", "memory_budget", "group", "losses", "dpo_logit_metrics")
#: The fused losses' keywords of ``apply`` (the section "Fused losses" below).
LOSS_OPTIONS = ("losses", "dpo_logit_metrics")
_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _trl_utils():
    import trl.kernels
    import trl.trainer.utils

    return trl.trainer.utils, trl.kernels.ChunkedLogProbFunction


class VpceLogProbHead:
    """Drop-in for ``trl.kernels.ChunkedLogProbFunction``: ``apply(...)`` takes TRL's arguments and returns TRL's
    5-tuple ``(log_probs, entropy, log_sum_sq_probs, mean_logits, is_top1)``, None where not in ``outputs``."""

    def __init__(self, *, backend="auto", validate=False, memory_budget="auto", group=None):
        if memory_budget not in ("auto", "lean"):
            raise ValueError(f"memory_budget: expected 'auto' or 'lean' (the speculative route where it fits, or "
                             f"never), got {memory_budget!r}")
        vpce.LinearCrossEntropy(backend=backend, validate=validate)  # checks the names now, not at the first step
        self.backend, self.validate, self.memory_budget, self.group = backend, validate, memory_budget, group

    _captured = None  # a list while a fused loss captures the head's calls (``_capturing``)

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        unknown = sorted(set(outputs) - set(_OUTPUTS))
        if unknown:
            raise ValueError(f"outputs: expected fields among {_OUTPUTS}, got {unknown}")
        if self._captured is not None:
            return _capture(self._captured, hidden, weight, bias, targets, temperature, final_logit_softcapping,
                            logit_scale, outputs)
        if logit_scale != 1.0:  # cap(s * (h W^T + b)) = cap((s h) W^T + s b)
            hidden = hidden * logit_scale
            bias = None if bias is None else bias * logit_scale
        # TRL casts the weight to the hidden states' dtype outside autocast (cast_lm_head_to_fp32)
        autocast = (hidden.device.type, None, torch.is_autocast_enabled(hidden.device.type))
        weight, bias, shard = _operands(self, dict(weight=weight, bias=bias, autocast=autocast), hidden)
        asked = dict(return_entropy="entropy" in outputs, return_top1="is_top1" in outputs,
                     return_mean_logits="mean_logits" in outputs,
                     return_log_sum_sq_probs="log_sum_sq_probs" in outputs)
        got = vpce.linear_log_probs(hidden, weight, targets, bias, temperature=temperature,
                                    softcap=final_logit_softcapping, backend=self.backend, validate=self.validate,
                                    memory_budget=self.memory_budget, **shard, **asked)
        got = list(got) if isinstance(got, tuple) else [got]
        fields = dict(zip(["log_probs", *(k for k in ("entropy", "is_top1", "mean_logits", "log_sum_sq_probs")
                                          if k in outputs)], got))
        return tuple(fields.get(k) for k in _OUTPUTS)


def apply(**options) -> VpceLogProbHead:
    """Make every TRL fused LM head (all trainers, every model, built before or after this call) run on vpce.

    ``options``: ``backend``, ``validate``, ``memory_budget`` (``"auto"``/``"lean"``), ``group`` (a
    tensor-parallel process group: vocab-parallel compute over it). Applying again replaces the options. Returns
    the installed head.

    Fused losses (``LOSS_OPTIONS``): ``losses=True`` (the default) also makes ``trl.GRPOTrainer`` and
    ``trl.DPOTrainer`` take their loss from vpce's fused losses (the section "Fused losses" below; ``False``: the
    head only); ``dpo_logit_metrics=True`` (the default) logs DPO's ``logits/*`` and ``mean_token_accuracy`` from
    the fused pass's statistics (``False``: not computed, not logged).
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"options: expected keywords among {OPTIONS}, got {unknown}")
    loss_options = {k: options.pop(k) for k in LOSS_OPTIONS if k in options}
    head = VpceLogProbHead(**options)
    _apply_losses(head, **loss_options)
    _trl_utils()[0]._ChunkedLogProbFunction = head
    return head


def remove() -> None:
    """Restore TRL's own fused head. Harmless when not applied."""
    utils, original = _trl_utils()
    utils._ChunkedLogProbFunction = original
    _remove_losses()


def is_applied() -> bool:
    """Whether TRL's fused heads currently run on vpce."""
    return isinstance(_trl_utils()[0]._ChunkedLogProbFunction, VpceLogProbHead)


# -- Fused losses: GRPOTrainer._compute_loss and DPOTrainer._compute_loss on vpce's fused losses ------------------
#
# ``apply(losses=True)`` (the default) also replaces, at class level, ``trl.GRPOTrainer._compute_loss`` and
# ``trl.DPOTrainer._compute_loss``. The replacement runs TRL's own model call (the backbone, TRL's labels and masks)
# with the head in capture mode: each head call records its operands and returns placeholders (``_capture``), whose
# ``log_probs`` carry each token's row number, so that the layout TRL's forward builds from them (compact: only the
# valid tokens, on Triton devices; or every position) maps back to ``[B, T]``. The loss is then vpce's fused GRPO or
# DPO loss on those hidden states and the lm_head (``vpce.linear_grpo_loss`` / ``vpce.linear_dpo_loss``, every
# option through their public keywords): its gradients are formed in forward, at the fast route's cost.
# GRPO: TRL's ``_compute_loss`` itself then runs on vpce's detached per-token log-probs and entropy (its
# ``_get_per_token_logps_and_entropies`` answered by the fused call), and logs every metric it logs, with its own
# code; its loss value is replaced by vpce's. DPO: the metrics are TRL's, computed here from vpce's log-probs,
# entropy, ``mean_logits`` and ``is_top1`` (the fused pass's statistics; ``dpo_logit_metrics``). A configuration
# that the fused losses do not cover runs TRL's own loss (on vpce's per-token head), with one warning per reason.

import functools  # noqa: E402
import warnings  # noqa: E402

_PATCHED: dict = {}  # (class, name) -> TRL's attribute
_WARNED: set = set()


def _capture(calls, hidden, weight, bias, targets, temperature, softcap, logit_scale, outputs):
    """Record one head call; return placeholders: ``log_probs`` = the rows' 1-based numbers across the captured
    calls (fp64: exact), the other fields zeros. TRL's forward lays them out as it lays out the real fields."""
    device = hidden.device.type
    offset = sum(c["hidden"].shape[0] for c in calls)
    calls.append(dict(hidden=hidden, weight=weight, bias=bias, targets=targets, temperature=temperature,
                      softcap=softcap, logit_scale=logit_scale,
                      autocast=(device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))))
    n = hidden.shape[0]
    fields = dict(log_probs=torch.arange(offset + 1, offset + n + 1, dtype=torch.float64, device=hidden.device))
    for k in _OUTPUTS[1:]:
        fields[k] = torch.zeros(n, dtype=torch.bool if k == "is_top1" else torch.float32, device=hidden.device)
    return tuple(fields[k] if k in outputs else None for k in _OUTPUTS)


class _Layout:
    """Each row's scored tokens moved to its front, in order (``_rebuild``): ``take`` maps a ``[B, T]`` tensor of
    TRL's layout to the ``[B, T']`` one (``T'``: the most scored tokens of a row), ``put`` maps back (0 elsewhere).
    The losses only sum over each row's tokens, so the order within a row is all they need; the logits GEMM then
    skips the prompt and most of the padding."""

    def __init__(self, valid):
        b, t = valid.shape
        counts = valid.sum(1)
        width = max(int(counts.max()) if b else 0, 1)
        # the valid positions first, in order: a stable sort on "not valid"
        self.pos = torch.sort((~valid).to(torch.int8), dim=1, stable=True).indices[:, :width]
        self.valid = torch.arange(width, device=valid.device)[None, :] < counts[:, None]
        self.shape = (b, t)

    def take(self, x):
        x = x.to(self.pos.device)
        return x.gather(1, self.pos) if x.dim() == 2 else x

    def put(self, y):
        y = torch.where(self.valid.to(y.device), y, torch.zeros((), dtype=y.dtype, device=y.device))
        return y.new_zeros(self.shape).scatter(1, self.pos.to(y.device), y)


def _rebuild(codes, calls, keep=None, ignore_index=-100):
    """``(hidden [B, T', D], target [B, T'], layout)`` of the captured calls at the positions of ``codes`` (the
    placeholder ``log_probs`` as TRL's forward and trainer laid them out, ``[B, T]``; 0 where TRL masks the token),
    each row's scored tokens moved to its front (``_Layout``); ``keep`` (``[B, T]``): also drop where it is 0.
    Gradients flow to the captured hidden states (``masked_scatter`` keeps an all-masked batch connected, as TRL's
    forward)."""
    hid = torch.cat([c["hidden"] for c in calls]) if len(calls) > 1 else calls[0]["hidden"]
    lab = torch.cat([c["targets"] for c in calls]) if len(calls) > 1 else calls[0]["targets"]
    codes = codes.detach().to(hid.device)
    if keep is not None:
        codes = torch.where(keep.to(hid.device) != 0, codes, 0)
    layout = _Layout(codes > 0)
    codes = torch.where(layout.valid, layout.take(codes), 0)
    valid = layout.valid
    idx = (codes[valid] - 1).long()
    b, t = codes.shape
    d = hid.shape[-1]
    hidden = hid.new_zeros(b, t, d).masked_scatter(valid[..., None].expand(b, t, d), hid[idx])
    target = torch.full((b, t), ignore_index, dtype=torch.long, device=hid.device)
    target[valid] = lab[idx].to(torch.long)
    return hidden, target, layout


def _operands(head: VpceLogProbHead, call: dict, hidden):
    """The weight and bias (cast, and this rank's rows under ``group``) and the sharding keywords, as
    ``VpceLogProbHead.apply`` forms them."""
    weight, bias = call["weight"], call["bias"]
    if not call["autocast"][2] and weight.dtype != hidden.dtype:
        weight = weight.to(hidden.dtype)
        bias = None if bias is None else bias.to(hidden.dtype)
    shard = {}
    if head.group is not None:
        import torch.distributed as dist

        world, rank = dist.get_world_size(head.group), dist.get_rank(head.group)
        rows = math.ceil(weight.shape[0] / world)
        start = min(rank * rows, weight.shape[0])
        shard = dict(group=head.group, vocab_start=start, vocab_size=weight.shape[0])
        weight = weight[start:start + rows]
        bias = None if bias is None else bias[start:start + rows]
    return weight, bias, shard


def _common(head: VpceLogProbHead, call: dict):
    return dict(temperature=call["temperature"], softcap=call["softcap"], logit_scale=call["logit_scale"],
                backend=head.backend, memory_budget=head.memory_budget, validate=head.validate)


def _autocast(call: dict):
    device, dtype, enabled = call["autocast"]
    return torch.autocast(device, dtype=dtype, enabled=enabled)


def _loss_head():
    """The installed head, when it computes the trainers' losses too."""
    head = _trl_utils()[0]._ChunkedLogProbFunction
    return head if isinstance(head, VpceLogProbHead) and getattr(head, "losses", False) else None


def _warn_once(trainer: str, reason: str) -> None:
    if (trainer, reason) in _WARNED:
        return
    _WARNED.add((trainer, reason))
    warnings.warn(f"vpce.integrations.trl: {trainer} with {reason} is not covered by vpce's fused losses; TRL's own "
                  f"loss runs for it (on vpce's per-token head)", stacklevel=4)


def _zero3() -> bool:
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def _grpo_fallback(trainer) -> str | None:
    """Why TRL's GRPO loss must run instead of vpce's (None: covered)."""
    if trainer.loss_type not in vpce.post_training.GRPO_LOSS_TYPES:
        return f"loss_type={trainer.loss_type!r}"
    if _zero3():
        return "DeepSpeed ZeRO-3 (the lm_head is gathered only inside the head call)"
    return None


#: The GRPO inputs laid out as the completion tokens ``[B, T]`` (moved with the tokens: ``_Layout.take``).
_GRPO_TOKEN_INPUTS = ("advantages", "old_per_token_logps", "ref_per_token_logps", "sampling_per_token_logps",
                      "importance_sampling_ratio", "completion_mask", "tool_mask")


def _grpo_normalizer(trainer, kept, train, num_items):
    """Each token's share of TRL's GRPO normalizer, gradient accumulation folded in (``kept``: ``[B, T]``, 1 at
    the scored tokens; ``num_items``: the batch's ``num_items_in_batch``)."""
    b = kept.shape[0]
    if trainer.loss_type in ("cispo", "dapo", "vespo"):
        # TRL: num_items_in_batch spans the generation batch, rescaled to one accumulation window
        normalizer = num_items.clamp(min=1.0) / trainer.accelerator.num_processes
        if train:
            normalizer = normalizer * trainer.current_gradient_accumulation_steps / trainer.args.steps_per_generation
        return kept / normalizer.to(kept)
    if trainer.loss_type in ("grpo", "sapo"):
        norm = kept / kept.sum(-1, keepdim=True).clamp(min=1.0) / b
    elif trainer.loss_type == "bnpo":
        norm = kept / kept.sum().clamp(min=1.0)
    elif trainer.loss_type == "dr_grpo":
        norm = kept / (b * trainer.max_completion_length)
    else:  # luspo
        norm = kept / b
    return norm / trainer.current_gradient_accumulation_steps if train else norm


def _grpo_options(trainer, inputs, train):
    """``linear_grpo_loss``'s keywords for TRL's configuration: its loss options, the vLLM correction, the masks and
    the entropy bonus (its coefficient gated as TRL's, and scaled for accumulation)."""
    args = trainer.args
    opts = dict(beta=trainer.beta, epsilon_low=trainer.epsilon_low, epsilon_high=trainer.epsilon_high,
                delta=args.delta, loss_type=trainer.loss_type,
                importance_sampling_level=trainer.importance_sampling_level,
                use_bias_correction_kl=args.use_bias_correction_kl, sapo_temperature_pos=args.sapo_temperature_pos,
                sapo_temperature_neg=args.sapo_temperature_neg, vespo_k_pos=args.vespo_k_pos,
                vespo_lambda_pos=args.vespo_lambda_pos, vespo_k_neg=args.vespo_k_neg,
                vespo_lambda_neg=args.vespo_lambda_neg, off_policy_mask_threshold=trainer.off_policy_mask_threshold,
                top_entropy_quantile=float(trainer.top_entropy_quantile))
    if trainer.top_entropy_quantile < 1.0 and trainer.accelerator.num_processes > 1:
        import torch.distributed as dist

        opts["top_entropy_group"] = dist.group.WORLD  # TRL gathers every process's entropies
    vllm_is = trainer.use_vllm and trainer.vllm_importance_sampling_correction
    if "importance_sampling_ratio" in inputs and (vllm_is or trainer.loss_type == "vespo"):
        opts["importance_sampling_ratio"] = inputs["importance_sampling_ratio"]
    if trainer.off_policy_mask_threshold is not None and "sampling_per_token_logps" in inputs:
        opts["sampling_log_probs"] = inputs["sampling_per_token_logps"]
    if trainer._entropy_bonus_enabled:  # TRL: - coef * masked mean entropy / accumulation, the coefficient gated
        coef = trainer.entropy_coef
        if trainer.use_adaptive_entropy and not trainer._last_world_entropy <= args.entropy_target:
            coef = 0.0
        opts["entropy_coef"] = float(coef) / (trainer.current_gradient_accumulation_steps if train else 1.0)
    return opts


def _grpo_fused(trainer, head: VpceLogProbHead, calls, codes, inputs):
    """vpce's GRPO loss of the captured policy head, with TRL's normalizers: ``(loss, log_probs, entropy)``.
    Token-level terms run on every scored token of the batch packed into one row (``[1, M]``, each token with its
    sequence's normalizer: no padding reaches the logits GEMM); sequence-level ones (GSPO, VESPO, the off-policy
    mask) on the rows."""
    mask = inputs["completion_mask"]
    if "tool_mask" in inputs:
        mask = mask * inputs["tool_mask"]
    hidden, target, layout = _rebuild(codes, calls, keep=mask)
    width = codes.shape[1]
    inputs = {k: layout.take(v) if isinstance(v, torch.Tensor) and v.dim() == 2 and v.shape[1] == width and
              k in _GRPO_TOKEN_INPUTS else v for k, v in inputs.items()}
    train = trainer.model.training
    kept = target != -100
    opts = _grpo_options(trainer, inputs, train)
    norm = _grpo_normalizer(trainer, kept.to(torch.float32), train, inputs.get("num_items_in_batch"))
    old = inputs.get("old_per_token_logps")
    ref = inputs["ref_per_token_logps"] if trainer.beta != 0.0 else None
    adv = inputs["advantages"]
    call = calls[0]
    weight, bias, shard = _operands(head, call, hidden)
    rows = trainer.importance_sampling_level == "sequence" or trainer.loss_type == "vespo" or \
        trainer.off_policy_mask_threshold is not None
    b, t = target.shape
    if not rows and bool(kept.any()):
        def pack(x):
            if x is None:
                return None
            x = x.to(kept.device)
            return (x[:, None] if x.dim() == 1 else x).expand(b, t)[kept][None]

        for k in ("importance_sampling_ratio", "sampling_log_probs"):
            if k in opts:
                opts[k] = pack(opts[k])
        with _autocast(call):
            out, logp, ent = vpce.linear_grpo_loss(
                hidden[kept][None], weight, target[kept][None], pack(adv), bias, old_log_probs=pack(old),
                ref_log_probs=pack(ref), token_weight=pack(norm), return_outputs=True, **opts, **_common(head, call),
                **shard)
        unpack = lambda y: y.new_zeros(b, t).masked_scatter(kept, y[0])  # noqa: E731
        return out.loss, layout.put(unpack(logp)), layout.put(unpack(ent))
    with _autocast(call):
        out, logp, ent = vpce.linear_grpo_loss(
            hidden, weight, target, adv, bias, old_log_probs=old, ref_log_probs=ref, token_weight=norm,
            return_outputs=True, **opts, **_common(head, call), **shard)
    return out.loss, layout.put(logp), layout.put(ent)


def _grpo_compute_loss(self, model, inputs):
    """``GRPOTrainer._compute_loss`` with the loss from ``vpce.linear_grpo_loss`` (TRL's own where not covered)."""
    from trl import GRPOTrainer

    original = _PATCHED[(GRPOTrainer, "_compute_loss")]
    head = _loss_head()
    if head is None:
        return original(self, model, inputs)
    reason = _grpo_fallback(self)
    if reason is not None:
        _warn_once("GRPOTrainer", reason)
        return original(self, model, inputs)
    get = self._get_per_token_logps_and_entropies
    state = {}

    def fused(model_, input_ids, attention_mask, logits_to_keep, *args, **kwargs):
        if state:  # only the policy's call of this loss
            return get(model_, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        calls = head._captured = []
        try:
            codes, _, aux_loss = get(model_, input_ids, attention_mask, logits_to_keep, *args, **kwargs)
        finally:
            head._captured = None
        state["loss"], logp, ent = _grpo_fused(self, head, calls, codes, inputs)
        state["aux_loss"] = aux_loss
        return logp, ent, aux_loss

    self._get_per_token_logps_and_entropies = fused
    try:
        original(self, model, inputs)  # TRL's metrics, on vpce's per-token log-probs and entropy
    finally:
        del self._get_per_token_logps_and_entropies
    if not state:
        raise RuntimeError("vpce.integrations.trl: GRPOTrainer._compute_loss did not call "
                           "_get_per_token_logps_and_entropies (a TRL version other than 1.16?)")
    loss = state["loss"]
    if self.aux_loss_enabled:  # as TRL: scaled for gradient accumulation
        normalizer = self.current_gradient_accumulation_steps if self.model.training else 1.0
        loss = loss + self.router_aux_loss_coef * state["aux_loss"] / normalizer
    return loss


def _dpo_fallback(trainer, return_outputs) -> str | None:
    """Why TRL's DPO loss must run instead of vpce's (None: covered)."""
    unknown = [t for t in trainer.loss_types if t not in vpce.post_training.DPO_LOSS_TYPES]
    if unknown:
        return f"loss_type={unknown[0]!r}"
    if trainer.f_divergence_type not in vpce.post_training.F_DIVERGENCE_TYPES:
        return f"f_divergence_type={trainer.f_divergence_type!r}"
    if trainer.use_weighting:
        return "use_weighting"
    if return_outputs:
        return "return_outputs=True (compute_metrics)"
    if _zero3():
        return "DeepSpeed ZeRO-3 (the lm_head is gathered only inside the head call)"
    return None


def _dpo_compute_loss(self, model, inputs, return_outputs):
    """``DPOTrainer._compute_loss`` with the loss from ``vpce.linear_dpo_loss`` (TRL's own where not covered); the
    metrics TRL logs, with its definitions and gathers."""
    from trl import DPOTrainer

    original = _PATCHED[(DPOTrainer, "_compute_loss")]
    head = _loss_head()
    if head is None:
        return original(self, model, inputs, return_outputs)
    reason = _dpo_fallback(self, return_outputs)
    if reason is not None:
        _warn_once("DPOTrainer", reason)
        return original(self, model, inputs, return_outputs)
    mode = "train" if self.model.training else "eval"
    # TRL's model call
    model_kwargs = {k: v for k, v in inputs.items() if k not in {"completion_mask", "ref_chosen_logps",
                                                                 "ref_rejected_logps"}}
    model_kwargs["use_cache"] = False
    if self.aux_loss_enabled:
        model_kwargs["output_router_logits"] = True
    completion_mask = inputs["completion_mask"]
    shift_completion_mask = completion_mask[..., 1:]
    labels = inputs["input_ids"].masked_fill(completion_mask == 0, -100)
    calls = head._captured = []
    try:
        outputs = model(**model_kwargs, labels=labels, fused_lm_head=True)
    finally:
        head._captured = None
    seq_len = shift_completion_mask.size(1)
    hidden, target, layout = _rebuild(outputs.log_probs[:, -seq_len:], calls)
    # the reference: precomputed, or TRL's reference forward (through the head, not captured)
    if self.precompute_ref_logps:
        ref_chosen_logps, ref_rejected_logps = inputs["ref_chosen_logps"], inputs["ref_rejected_logps"]
    else:
        ref_chosen_logps, ref_rejected_logps = self.compute_ref_log_probs(
            self.model if self.ref_model is None else self.ref_model, inputs)
    call = calls[0]
    weight, bias, shard = _operands(head, call, hidden)
    with _autocast(call):
        out, per_token_logps, per_token_entropy, *logit_fields = vpce.linear_dpo_loss(
            hidden, weight, target, ref_chosen_logps.to(hidden.device), ref_rejected_logps.to(hidden.device), bias,
            beta=self.beta, loss_type=list(self.loss_types), loss_weights=list(self.loss_weights),
            label_smoothing=self.label_smoothing, discopop_tau=self.args.discopop_tau,
            f_divergence_type=self.f_divergence_type, f_alpha_divergence_coef=self.f_alpha_divergence_coef,
            ld_alpha=self.ld_alpha, completion_lengths=completion_mask.sum(1).to(hidden.device),
            return_outputs=True, return_logit_metrics=head.dpo_logit_metrics, **_common(head, call), **shard)
    loss = out.loss
    if self.aux_loss_enabled:
        aux_loss = outputs.aux_loss
        loss = loss + self.router_aux_loss_coef * aux_loss
        self._metrics[mode]["aux_loss"].append(self.accelerator.gather_for_metrics(aux_loss).mean().item())
    # back to TRL's layout for its metrics
    per_token_logps = layout.put(per_token_logps).to(completion_mask.device)
    per_token_entropy = layout.put(per_token_entropy).to(completion_mask.device)
    logit_fields = [layout.put(x) for x in logit_fields]
    chosen_logps = out.chosen_log_probs.to(device=completion_mask.device, dtype=per_token_logps.dtype)
    rejected_logps = out.rejected_log_probs.to(device=completion_mask.device, dtype=per_token_logps.dtype)
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    _dpo_metrics(self, mode, inputs, per_token_entropy, logit_fields, chosen_logps, rejected_logps,
                 chosen_logratios, rejected_logratios)
    return loss


def _dpo_metrics(self, mode, inputs, per_token_entropy, logit_fields, chosen_logps, rejected_logps,
                 chosen_logratios, rejected_logratios):
    """The metrics of TRL 1.16's ``DPOTrainer._compute_loss``, from vpce's per-token values (TRL's code).
    ``logit_fields``: ``(is_top1, mean_logits)`` ``[2B, T]`` from the fused pass, or empty (not logged)."""
    shift_completion_mask = inputs["completion_mask"][..., 1:]
    mask = shift_completion_mask
    entropy_sum = (per_token_entropy * mask).sum()
    total_tokens = mask.sum()
    entropy_sum = self.accelerator.gather_for_metrics(entropy_sum).sum()
    total_tokens = self.accelerator.gather_for_metrics(total_tokens).sum()
    entropy = (entropy_sum / total_tokens).item() if total_tokens > 0 else 0.0
    self._metrics[mode]["entropy"].append(entropy)

    if mode == "train":
        num_tokens_in_batch = self.accelerator.gather_for_metrics(inputs["attention_mask"].sum()).sum().item()
        self._total_train_tokens += num_tokens_in_batch // self._tp_size
    self._metrics[mode]["num_tokens"] = [self._total_train_tokens]

    chosen_mask, rejected_mask = shift_completion_mask.chunk(2, dim=0)
    if logit_fields:  # dpo_logit_metrics
        is_top1, mean_logits = (x.to(mask.device) for x in logit_fields)
        chosen_mean_logits, rejected_mean_logits = mean_logits.chunk(2, dim=0)
        total_chosen_logits = chosen_mean_logits[chosen_mask.bool()].sum()
        total_chosen_tokens = chosen_mask.sum()
        total_rejected_logits = rejected_mean_logits[rejected_mask.bool()].sum()
        total_rejected_tokens = rejected_mask.sum()
        total_chosen_logits = self.accelerator.gather_for_metrics(total_chosen_logits).sum().item()
        total_chosen_tokens = self.accelerator.gather_for_metrics(total_chosen_tokens).sum().item()
        total_rejected_logits = self.accelerator.gather_for_metrics(total_rejected_logits).sum().item()
        total_rejected_tokens = self.accelerator.gather_for_metrics(total_rejected_tokens).sum().item()
        avg_chosen_logits = total_chosen_logits / total_chosen_tokens if total_chosen_tokens > 0 else 0.0
        avg_rejected_logits = total_rejected_logits / total_rejected_tokens if total_rejected_tokens > 0 else 0.0
        self._metrics[mode]["logits/chosen"].append(avg_chosen_logits)
        self._metrics[mode]["logits/rejected"].append(avg_rejected_logits)

        chosen_is_top1, _ = is_top1.chunk(2, dim=0)
        correct_predictions = chosen_is_top1 & chosen_mask.bool()
        total_tokens = chosen_mask.sum()
        correct_tokens = correct_predictions.sum()
        correct_tokens = self.accelerator.gather_for_metrics(correct_tokens)
        total_tokens = self.accelerator.gather_for_metrics(total_tokens)
        total_sum = total_tokens.sum()
        accuracy = (correct_tokens.sum() / total_sum).item() if total_sum > 0 else 0.0
        self._metrics[mode]["mean_token_accuracy"].append(accuracy)

    chosen_rewards = self.beta * chosen_logratios.detach()
    rejected_rewards = self.beta * rejected_logratios.detach()
    agg_chosen_rewards = self.accelerator.gather(chosen_rewards)
    agg_rejected_rewards = self.accelerator.gather(rejected_rewards)
    self._metrics[mode]["rewards/chosen"].append(agg_chosen_rewards.mean().item())
    self._metrics[mode]["rewards/rejected"].append(agg_rejected_rewards.mean().item())
    reward_accuracies = (chosen_rewards > rejected_rewards).float()
    agg_reward_accuracies = self.accelerator.gather(reward_accuracies)
    self._metrics[mode]["rewards/accuracies"].append(agg_reward_accuracies.mean().item())
    margins = chosen_rewards - rejected_rewards
    agg_margins = self.accelerator.gather(margins)
    self._metrics[mode]["rewards/margins"].append(agg_margins.mean().item())
    self._metrics[mode]["logps/chosen"].append(self.accelerator.gather(chosen_logps).mean().item())
    self._metrics[mode]["logps/rejected"].append(self.accelerator.gather(rejected_logps).mean().item())


def _trainer_classes():
    from trl import DPOTrainer, GRPOTrainer

    return {GRPOTrainer: _grpo_compute_loss, DPOTrainer: _dpo_compute_loss}


def _apply_losses(head: VpceLogProbHead, *, losses=True, dpo_logit_metrics=True) -> None:
    """``apply``'s fused-loss options: patch (or, ``losses=False``, restore) the trainers' ``_compute_loss``."""
    from vpce.api import check_bool

    check_bool("losses", losses)
    check_bool("dpo_logit_metrics", dpo_logit_metrics)
    head.losses, head.dpo_logit_metrics = losses, dpo_logit_metrics
    _WARNED.clear()
    if not losses:
        _remove_losses()
        return
    for cls, fn in _trainer_classes().items():
        if (cls, "_compute_loss") not in _PATCHED:
            _PATCHED[(cls, "_compute_loss")] = cls.__dict__["_compute_loss"]
            cls._compute_loss = functools.wraps(_PATCHED[(cls, "_compute_loss")])(fn)


def _remove_losses() -> None:
    for (cls, name), original in list(_PATCHED.items()):
        setattr(cls, name, original)
        del _PATCHED[(cls, name)]
