"""verl: the actor's log-probs, entropy and policy loss computed by vpce (verl 0.9.x).

verl's actor gets per-token log-probs and entropy from the model's forward, then applies its policy loss
(``verl.workers.utils.losses.ppo_loss``: a ``core_algos`` policy loss by ``policy_loss.loss_mode``, aggregated by
``loss_agg_mode``, minus ``entropy_coeff`` times the aggregated entropy, plus ``kl_loss_coef`` times the aggregated
``kl_penalty`` against the reference). With ``use_fused_kernels`` the forward takes the log-probs and entropy from a
fused head: ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (the FSDP worker's patched HF models)
or ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (the Megatron worker, its lm_head split by
vocab over the tensor-parallel group).

Four ways in, each exact against verl's own code:

- ``apply()`` makes verl 0.9's FSDP actor update compute its policy loss fused. It wraps
  ``FSDPEngineWithLMHead.forward_step``; for a training micro-batch whose loss function is verl's ``ppo_loss``, the
  model's fused-kernel forward (verl's ``patch_forward_with_backends``) calls vpce's head. The head evaluates
  ``ppo_loss`` below on the hidden states of the response positions and hands the loss back to verl's step through
  the model's output (``_FusedStep``). verl's metrics come from its own function.
- ``apply()`` makes verl 0.9's Megatron actor update compute its policy loss fused too. It wraps
  ``MegatronEngineWithLMHead.forward_step``; for a training micro-batch whose loss function is verl's ``ppo_loss``,
  with the fused kernels, verl's fused forward (``model_forward_fused``, which gathers the sequence-parallel hidden
  states) calls vpce's ``linear_cross_entropy`` on the rank's vocab shard of the output layer. That head evaluates
  ``ppo_loss`` below with ``group=`` the tensor-parallel group on the hidden states of the response positions (the
  packed layout recorded from verl's ``preprocess_thd_engine``) and hands the loss to verl's
  ``postprocess_micro_batch_func``, hence to Megatron's schedule, as the micro-batch's loss (``_MegatronStep``).
- ``apply()`` also makes the two fused heads run on ``vpce.linear_log_probs`` (one fused GEMM + online-softmax pass,
  O(N) memory; under ``torch.no_grad``, as for the old and reference log-probs, nothing is kept for backward).
  ``VpceLinearForPPO`` is the FSDP worker's head; ``linear_cross_entropy`` the Megatron worker's, on the rank's
  vocab shard with ``dist_process_group``. Where the loss is not fused (Ulysses sequence parallelism, Megatron's
  context and pipeline parallelism, other loss functions), verl's loss code runs unchanged on their per-token
  values: the lean route (the logits recomputed in backward).
- ``ppo_loss(...)`` is ``ppo_loss`` itself, fused: ``vpce.linear_log_prob_loss`` evaluates verl's registered policy
  loss, ``agg_loss`` and ``kl_penalty`` on each chunk's log-probs and entropy while its logits are live, so the
  gradients are formed in forward at the cross-entropy's cost. Chunks hold whole responses (scope ``"sequence"``)
  for the loss modes whose loss is a sum over responses (``ROW_LOSS_MODES``). The aggregation's batch constants
  (``batch_num_tokens``, ``global_batch_size``) are filled in from the whole micro-batch where verl leaves them to
  ``agg_loss``, so every chunk's share adds up to verl's value. Other loss modes (``clip_cov``, ``kl_cov``: a
  selection over the batch) see every token at once (scope ``"batch"``, one pass over the logits more). verl's
  metrics are computed by its own function once, on the detached log-probs.

Supported: verl 0.9.x, tested against 0.9.1 on CPU (its FSDP and Megatron engines' ``forward_backward_batch`` and
``infer_batch``, ``core_algos``, ``ppo_loss`` and ``FusedLinearForPPO``; megatron-core 0.16). The fused update
covers the FSDP engine with ``use_fused_kernels`` (``impl_backend`` ``torch`` or ``liger``), and the Megatron engine
with ``use_fused_kernels`` for a ``GPTModel`` under tensor parallelism with sequence parallelism (verl's default
when tp > 1) or without tensor parallelism; context parallelism, pipeline parallelism and tensor parallelism
without sequence parallelism run verl's loss on vpce's log-probs, with a warning. The Megatron worker's no-grad
forward and its unfused steps get vpce's log-probs and entropy, with verl's loss on them. verl itself needs ``ray``
and ``tensordict`` to import.
"""

from __future__ import annotations

import contextvars
import functools
import warnings

import torch

import vpce
from vpce.double_backward import refuse_double_backward

try:
    import verl.trainer.ppo.core_algos as core_algos
except ImportError as err:  # pragma: no cover - exercised only without verl
    raise ImportError("vpce.integrations.verl needs verl 0.9.x (pip install 'verl==0.9.1'; its core_algos imports "
                      "ray and tensordict)") from err

__all__ = ["ppo_loss", "VpceLinearForPPO", "linear_cross_entropy", "apply", "remove", "is_applied",
           "ROW_LOSS_MODES"]

#: verl policy loss modes whose loss is a sum of per-response terms (given the aggregation's batch constants):
#: fused with chunks of whole responses. Any other registered mode sees the whole micro-batch at once.
ROW_LOSS_MODES = ("vanilla", "gspo", "sapo", "gpg", "geo_mean", "cispo", "dppo_tv", "dppo_kl")


def _filled_batch_info(info: dict, mask: torch.Tensor) -> dict:
    """verl's ``global_batch_info`` with the constants ``agg_loss`` would take from the whole micro-batch filled in
    (one process: ``dp_size`` 1), so that each chunk of responses adds its share."""
    info = dict(info)
    if info.get("dp_size", 1) in (None, 1):
        info["dp_size"] = 1
        if info.get("batch_num_tokens") is None:
            info["batch_num_tokens"] = mask.sum()
        if info.get("global_batch_size") is None:
            info["global_batch_size"] = (mask.sum(-1) > 0).float().sum()
    return info


def ppo_loss(config, hidden, weight, target, old_log_probs, advantages, bias=None, *, response_mask=None,
             rollout_is_weights=None, ref_log_prob=None, use_entropy=None, temperature=1.0, softcap=None,
             ignore_index=-100, group=None, vocab_start=None, vocab_size=None, backend="auto", memory_budget="auto",
             validate=False):
    """verl's ``workers.utils.losses.ppo_loss`` of the policy head, fused.

    Args:
        config: verl's ``ActorConfig`` (``policy_loss.loss_mode``, ``loss_agg_mode``, ``clip_ratio*``,
            ``entropy_coeff``, ``use_kl_loss``, ``kl_loss_type``, ``kl_loss_coef``, ``global_batch_info``, ...).
        hidden: ``[B, T, D]`` the hidden states that predict the response tokens; weight (``[V_local, D]``), bias:
            the lm_head (this rank's vocab shard under ``group``).
        target: ``[B, T]`` the response tokens, ``ignore_index`` where ``response_mask`` is 0.
        old_log_probs, advantages: ``[B, T]`` (verl's ``old_log_probs``, ``advantages``).
        response_mask: ``[B, T]``; default ``target != ignore_index``.
        rollout_is_weights, ref_log_prob: ``[B, T]`` where verl has them (``use_kl_loss`` needs the reference's).
        use_entropy: add verl's entropy term (default: ``config.entropy_coeff != 0``).
        temperature, softcap, ignore_index, group, vocab_start, vocab_size, backend, memory_budget, validate: as in
            ``vpce.linear_log_prob_loss``.

    Returns:
        ``(loss, metrics, log_probs, entropy)``: the loss (0-d, differentiable), verl's metrics (``actor/pg_loss``,
        the policy loss's own, ``actor/entropy_loss``, ``kl_loss``, ``kl_coef``), and the detached per-token
        ``log_probs`` and ``entropy`` ``[B, T]``.
    """
    return _ppo_loss(config, hidden, weight, target, old_log_probs, advantages, bias, response_mask=response_mask,
                     rollout_is_weights=rollout_is_weights, ref_log_prob=ref_log_prob, use_entropy=use_entropy,
                     temperature=temperature, softcap=softcap, ignore_index=ignore_index, group=group,
                     vocab_start=vocab_start, vocab_size=vocab_size, backend=backend, memory_budget=memory_budget,
                     validate=validate)


def _ppo_loss(config, hidden, weight, target, old_log_probs, advantages, bias=None, *, response_mask=None,
              rollout_is_weights=None, ref_log_prob=None, use_entropy=None, temperature=1.0, softcap=None,
              ignore_index=-100, group=None, vocab_start=None, vocab_size=None, backend="auto", memory_budget="auto",
              validate=False, metrics=True):
    """``ppo_loss``; without ``metrics``, the metrics are ``None`` (the caller takes them from verl)."""
    if not isinstance(target, torch.Tensor) or target.dim() != 2:
        raise ValueError(f"target: expected a [B, T] tensor, got "
                         f"{tuple(target.shape) if isinstance(target, torch.Tensor) else type(target).__name__}")
    t_ = target.shape[1]
    mask = (target != ignore_index) if response_mask is None else response_mask.to(torch.bool)
    if tuple(mask.shape) != tuple(target.shape):
        raise ValueError(f"response_mask: expected target's shape {tuple(target.shape)}, got {tuple(mask.shape)}")
    target = target.masked_fill(~mask, ignore_index)
    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    policy_loss_fn = core_algos.get_policy_loss_fn(loss_mode)
    agg_mode = config.loss_agg_mode
    use_entropy = config.entropy_coeff != 0 if use_entropy is None else bool(use_entropy)
    use_kl = bool(config.use_kl_loss)
    if use_kl and ref_log_prob is None:
        raise ValueError("ref_log_prob: expected the reference's [B, T] log-probs with config.use_kl_loss, got None")
    # verl's policy losses read config.global_batch_info (verl's ppo_loss sets it per micro-batch): filled in for
    # the call, restored after
    saved = dict(config.global_batch_info)
    info = _filled_batch_info(saved, mask.to(torch.float32))
    config.global_batch_info.update(info)
    scope = "sequence" if loss_mode in ROW_LOSS_MODES else "batch"
    inputs = {"old": old_log_probs, "adv": advantages, "mask": mask}
    if rollout_is_weights is not None:
        inputs["is_w"] = rollout_is_weights
    if use_kl:
        inputs["ref"] = ref_log_prob

    def terms(logp, ent, old, adv, mask, is_w=None, ref=None):
        f = logp.dtype
        rows = lambda x: None if x is None else x.reshape(-1, t_)  # noqa: E731 (scope "batch": flat tokens)
        logp, ent, old, adv, mask = rows(logp), rows(ent), rows(old).to(f), rows(adv).to(f), rows(mask).bool()
        is_w, ref = (None if x is None else rows(x).to(f) for x in (is_w, ref))
        pg, metrics = policy_loss_fn(old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
                                     loss_agg_mode=agg_mode, config=config, rollout_is_weights=is_w)
        loss, parts = pg, {"actor/pg_loss": pg, **metrics}
        if ent is not None:
            entropy_loss = core_algos.agg_loss(loss_mat=ent, loss_mask=mask, loss_agg_mode=agg_mode, **info)
            loss = loss - config.entropy_coeff * entropy_loss
            parts["actor/entropy_loss"] = entropy_loss
        if ref is not None:
            kld = core_algos.kl_penalty(logprob=logp, ref_logprob=ref, kl_penalty=config.kl_loss_type)
            kl_loss = core_algos.agg_loss(loss_mat=kld, loss_mask=mask, loss_agg_mode=agg_mode, **info)
            loss = loss + kl_loss * config.kl_loss_coef
            parts["kl_loss"], parts["kl_coef"] = kl_loss, config.kl_loss_coef
        return loss, parts

    # verl's policy losses return their metrics as Python floats (``.item()``: the host waits for the GPU). Where
    # vpce evaluates the loss once on every token (one chunk, or the two-pass form), that evaluation's metrics are
    # the micro-batch's; else they are computed once more on the whole micro-batch
    evaluations = []

    def loss_fn(lp, en, **x):
        loss, parts = terms(lp, en, **x)
        evaluations.append((lp.numel(), parts))
        return loss

    rng = torch.get_rng_state()  # (clip_cov draws a random subset: the metrics see the loss's draw)
    try:
        loss, logp, ent = vpce.linear_log_prob_loss(
            hidden, weight, target, loss_fn, bias, inputs=inputs, scope=scope, use_entropy=use_entropy,
            temperature=temperature, softcap=softcap, ignore_index=ignore_index, group=group,
            vocab_start=vocab_start, vocab_size=vocab_size, backend=backend, memory_budget=memory_budget,
            validate=validate, return_outputs=True)
        parts = None
        if metrics and len(evaluations) == 1 and evaluations[0][0] == target.numel():
            parts = evaluations[0][1]
        elif metrics:
            with torch.no_grad():  # verl's metrics, once, on the whole micro-batch
                x = {k: v.detach().to(logp.device) for k, v in inputs.items()}
                after = torch.get_rng_state()
                torch.set_rng_state(rng)
                _, parts = terms(logp, ent if use_entropy else None, **x)
                torch.set_rng_state(after)
    finally:
        config.global_batch_info.clear()
        config.global_batch_info.update(saved)
    if parts is not None:
        parts = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in parts.items()}
    return loss, parts, logp, ent


# -- the heads -----------------------------------------------------------------------------------------------------

class VpceLinearForPPO(torch.nn.Module):
    """Drop-in for verl's ``FusedLinearForPPO`` (the FSDP worker's fused head): ``forward(hidden_states,
    vocab_weights, input_ids, temperature)`` returns ``(log_probs, entropy)`` of ``input_ids``' shape, computed by
    ``vpce.linear_log_probs``. ``chunk_size`` and ``impl_backend`` are verl's arguments (accepted, not needed)."""

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch", *, backend="auto", memory_budget="auto",
                 validate=False):
        super().__init__()
        self.options = dict(backend=backend, memory_budget=memory_budget, validate=validate)

    def forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
        step = _STEP.get()
        if step is not None and step.loss is None and torch.is_grad_enabled():
            return step.head(hidden_states, vocab_weights, input_ids, temperature, self.options)
        if vocab_weights.dtype != hidden_states.dtype:
            vocab_weights = vocab_weights.to(hidden_states.dtype)
        return vpce.linear_log_probs(hidden_states, vocab_weights, input_ids.to(torch.int64),
                                     temperature=float(temperature), return_entropy=True, **self.options)


class _ShareGrad(torch.autograd.Function):
    """Identity; backward hands each rank ``1 / world`` of vpce's complete hidden-state gradient, so that the sum
    over the group that verl's Megatron path applies after its fused head (which returns each rank's partial
    gradient) gives the complete one."""

    @staticmethod
    def forward(ctx, x, world):
        ctx.world = world
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        refuse_double_backward("vpce.integrations.verl's Megatron head")
        return g / ctx.world, None


def linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none", dist_process_group=None, *,
                         backend="auto", memory_budget="auto", validate=False):
    """Drop-in for ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (the Megatron worker's fused
    head): flat per-token ``(log_probs, entropy)`` of ``labels`` under ``hidden @ weight.T / temperature``;
    ``weight`` is this rank's vocab shard of ``dist_process_group`` (the shards in rank order), computed by
    ``vpce.linear_log_probs`` with ``group=``. ``reduction`` must be ``"none"`` (verl's only use). ``backend``,
    ``memory_budget``, ``validate``: as in ``vpce.linear_log_probs``.

    Called inside a training micro-batch that ``apply`` fuses (``_MegatronStep``), it computes verl's policy loss
    instead and returns the detached log-probs and entropy."""
    if reduction != "none":
        raise ValueError(f"reduction: expected 'none' (per-token log-probs and entropy), got {reduction!r}")
    options = dict(backend=backend, memory_budget=memory_budget, validate=validate)
    step = _STEP.get()
    if isinstance(step, _MegatronStep) and step.loss is None and torch.is_grad_enabled():
        out = step.head(hidden, weight, labels, temperature, dist_process_group, options)
        if out is not None:
            return out
    h = hidden.reshape(-1, hidden.shape[-1])
    shard = {}
    world = _world(dist_process_group)
    if world > 1:
        shard = dict(group=dist_process_group)  # the shards in rank order (vpce agrees on the starts)
        h = _ShareGrad.apply(h, world)
    w = weight if weight.dtype == h.dtype else weight.to(h.dtype)
    return vpce.linear_log_probs(h, w, labels.reshape(-1).to(torch.int64), temperature=float(temperature),
                                 return_entropy=True, **shard, **options)


def _world(group):
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


# -- the actor's training step: the policy loss formed in the model's forward ------------------------------------

class _FusedStep:
    """One micro-batch of verl's FSDP actor update whose policy loss is computed by the head, fused.

    ``FSDPEngineWithLMHead.forward_step`` (patched by ``apply``) makes one per micro-batch and passes it as the loss
    function. The model's forward calls the head (``VpceLinearForPPO``), which finds the step and calls ``head``:
    it takes the hidden states of the positions that predict response tokens (verl's own ``no_padding_2_padding``
    maps the packed positions), evaluates verl's loss on them through ``_ppo_loss`` and returns the per-token
    log-probs and entropy of every position (0 outside the responses, where verl's loss does not look). The
    returned log-probs carry the loss's gradient: their values are the log-probs and ``d log_probs / d loss`` is 1,
    so the loss that ``__call__`` hands back to verl's forward step (its value, plus the first log-prob minus
    itself) reaches the hidden states and the lm_head through the model's output, where the FSDP wrappers watch
    for the backward. ``__call__`` also returns verl's metrics, from ``verl.workers.utils.losses.ppo_loss`` itself
    on the detached log-probs and entropy.
    """

    def __init__(self, config, micro_batch):
        self.config, self.micro_batch = config, micro_batch
        self.loss = self.rng = self.rng_after = None

    def head(self, hidden, weight, labels, temperature, options):
        from verl.utils import tensordict_utils as tu
        from verl.workers.utils.padding import no_padding_2_padding

        data = self.micro_batch
        dev = hidden.device
        lengths = data["input_ids"].offsets().diff().to(dev)
        nnz = int(lengths.sum())
        if tu.get_non_tensor_data(data=data, key="use_remove_padding", default=True):
            flat = torch.arange(nnz, device=dev)  # hidden [1, nnz + tail padding, D]
        else:  # hidden [B, S, D], each sequence left-aligned
            rows = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), lengths)
            starts = torch.cumsum(lengths, 0) - lengths
            flat = rows * hidden.shape[-2] + torch.arange(nnz, device=dev) - starts[rows]
        where = no_padding_2_padding(flat, data)  # [B, T]: the position predicting each response token
        logp, ent = self._evaluate(hidden.reshape(-1, hidden.shape[-1]), weight, labels.reshape(-1), where,
                                   temperature, options)
        return (logp + (self.loss - self.loss.detach()).to(logp.dtype)).view(labels.shape), ent.view(labels.shape)

    def _evaluate(self, hidden, weight, labels, where, temperature, options, group=None):
        """verl's loss through ``_ppo_loss`` on the rows ``where`` (``[B, T]``) of the flat hidden states ``[N, D]``
        and labels ``[N]``; sets ``self.loss`` and returns the detached log-probs and entropy ``[N]`` (0 outside
        the responses). ``group``: the tensor-parallel group of the vocab-sharded ``weight``."""
        from verl.utils import tensordict_utils as tu

        data, config = self.micro_batch, self.config
        dev = hidden.device
        fields = ["response_mask", "old_log_probs", "advantages"]
        fields += [k for k in ("rollout_is_weights", "ref_log_prob") if k in data]
        x = data.select(*fields).to_padded_tensor()
        x = {k: x[k].to(dev) for k in fields}
        mask = x["response_mask"].to(torch.bool)
        world = _world(group)
        if world > 1:
            hidden = _ShareGrad.apply(hidden, world)
        h = hidden[where]
        y = labels.to(torch.int64)[where]
        # verl's ppo_loss sets these on the config for each micro-batch before the policy loss reads them
        config.global_batch_info.update(dp_size=data["dp_size"], batch_num_tokens=data["batch_num_tokens"],
                                        global_batch_size=data["global_batch_size"],
                                        loss_scale_factor=config.loss_scale_factor)
        use_entropy = bool(tu.get_non_tensor_data(data=data, key="calculate_entropy", default=False))
        if weight.dtype != h.dtype:
            weight = weight.to(h.dtype)
        shard = dict(group=group) if world > 1 else {}
        self.rng = torch.get_rng_state()
        loss, _, logp, ent = _ppo_loss(
            config, h, weight, y, x["old_log_probs"], x["advantages"], response_mask=mask,
            rollout_is_weights=x.get("rollout_is_weights"), ref_log_prob=x.get("ref_log_prob"),
            use_entropy=use_entropy, temperature=float(temperature), metrics=False, **shard, **options)
        self.rng_after = torch.get_rng_state()
        self.loss = loss
        dtype = torch.promote_types(logp.dtype, loss.dtype)
        out = []
        for values in (logp, ent if use_entropy else torch.zeros_like(logp)):
            full = torch.zeros(labels.numel(), dtype=dtype, device=dev)
            full[where[mask]] = values[mask].to(dtype)
            out.append(full)
        return out[0], out[1]

    def __call__(self, model_output, data, dp_group=None):
        from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

        if self.loss is None:  # the model's forward did not run vpce's head: verl's loss on its outputs
            _warn_once(self.NOT_CALLED)
            return verl_ppo_loss(config=self.config, model_output=model_output, data=data, dp_group=dp_group)
        detached = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in model_output.items()}
        with torch.no_grad():  # verl's metrics, on the log-probs of the loss, with the loss's random draw
            torch.set_rng_state(self.rng)
            _, metrics = verl_ppo_loss(config=self.config, model_output=detached, data=data, dp_group=dp_group)
            torch.set_rng_state(self.rng_after)
        return self._handed_back(model_output), metrics

    NOT_CALLED = ("the model's forward did not call vpce's head (is use_fused_kernels on, with impl_backend "
                  "'torch' or 'liger'?): verl's policy loss runs on its log-probs")

    def _handed_back(self, model_output):
        """The loss as verl's step sees it: its value, its gradient through the model's output (where the FSDP
        wrappers watch for the backward)."""
        log_probs = model_output["log_probs"]
        first = (log_probs.values() if log_probs.is_nested else log_probs).reshape(-1)[0]
        return self.loss.detach() + (first - first.detach()).to(self.loss.dtype)


class _MegatronStep(_FusedStep):
    """One micro-batch of verl's Megatron actor update whose policy loss is computed by the head, fused.

    ``MegatronEngineWithLMHead.forward_step`` (patched by ``apply``) makes one per micro-batch and passes it to
    verl's ``postprocess_micro_batch_func`` as the loss function. verl's fused forward
    (``model_forward_fused.fused_forward_model_engine``) packs the micro-batch with ``preprocess_thd_engine`` (each
    sequence from row ``cu_seqlens_q_padded[i]``, the labels rolled by one within it), which ``apply`` wraps to
    record the layout here; it runs the ``GPTModel``, gathers the sequence-parallel hidden states over the
    tensor-parallel group as verl does, and calls ``linear_cross_entropy`` with the rank's vocab shard of the
    output layer, which finds the step and calls ``head``. The head takes the rows that predict response tokens
    (the packed row of each token, through verl's ``no_padding_2_padding``), evaluates verl's loss there with
    ``group=`` the tensor-parallel group (vpce's hidden-state gradient, complete on every rank, shared by
    ``_ShareGrad`` so that the reduce-scatter of verl's gather adds up to it) and returns the detached per-token
    log-probs and entropy (0 outside the responses). ``__call__`` returns the loss itself to verl's
    ``postprocess_micro_batch_func``, which scales it for Megatron's schedule; the schedule's backward is the
    loss's. verl's metrics come from its ``ppo_loss`` on the detached values, as for FSDP.
    """

    NOT_CALLED = ("verl's Megatron forward did not call vpce's head with a packed micro-batch it can map: verl's "
                  "policy loss runs on its log-probs")

    def __init__(self, config, micro_batch):
        super().__init__(config, micro_batch)
        self.packed = None  # verl's PackedSeqParams of the micro-batch, recorded by _recording_layout

    def head(self, hidden, weight, labels, temperature, group, options):
        from verl.workers.utils.padding import no_padding_2_padding

        rows = hidden.numel() // hidden.shape[-1]
        if self.packed is None or getattr(self.packed, "qkv_format", None) != "thd" or rows != labels.numel():
            return None  # not verl's packed micro-batch (the caller computes the log-probs, __call__ warns)
        dev = hidden.device
        cu = self.packed.cu_seqlens_q_padded.to(dev, torch.int64)  # each sequence's first packed row
        if int(cu[-1]) != rows:
            return None
        lengths = self.micro_batch["input_ids"].offsets().diff().to(dev)
        seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=dev), lengths)
        starts = torch.cumsum(lengths, 0) - lengths
        flat = cu[seq] + torch.arange(int(lengths.sum()), device=dev) - starts[seq]
        where = no_padding_2_padding(flat, self.micro_batch)  # [B, T]: the row predicting each response token
        return self._evaluate(hidden.reshape(rows, hidden.shape[-1]), weight, labels.reshape(-1), where,
                              temperature, options, group=group)

    def _handed_back(self, model_output):
        return self.loss  # Megatron's schedule runs the backward of what the loss function returns


_STEP: contextvars.ContextVar = contextvars.ContextVar("vpce_verl_step", default=None)
_WARNED: set = set()


def _warn_once(message):
    if message not in _WARNED:
        _WARNED.add(message)
        warnings.warn(f"vpce.integrations.verl: {message}", stacklevel=3)


def _is_verl_ppo_loss(loss_function):
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    return (isinstance(loss_function, functools.partial) and loss_function.func is verl_ppo_loss
            and not loss_function.args and set(loss_function.keywords) == {"config"})


def _flag(micro_batch, key: str):
    """A flag verl's engine puts on the micro-batch (False where it is absent)."""
    from verl.utils import tensordict_utils as tu
    return tu.get_non_tensor_data(data=micro_batch, key=key, default=False)


def _in_step(step, forward_step, *args):
    """verl's ``forward_step(*args)`` with ``step`` as the micro-batch's fused step (what the heads find)."""
    token = _STEP.set(step)
    try:
        return forward_step(*args)
    finally:
        _STEP.reset(token)


def _fused_step(engine, micro_batch, loss_function, forward_only):
    """The step to fuse for this micro-batch, or None where verl's own forward step runs (inference, another loss
    than verl's ``ppo_loss``, no fused head, sequence parallelism, distillation)."""
    if forward_only or not torch.is_grad_enabled() or not _is_verl_ppo_loss(loss_function):
        return None
    get = functools.partial(_flag, micro_batch)
    if not get("use_fused_kernels") or get("distillation_use_topk") or get("distillation_only"):
        return None
    if getattr(engine, "use_ulysses_sp", False) or getattr(engine, "pad_to_length", False):
        _warn_once("Ulysses sequence parallelism and pad_to_length are not fused: verl's policy loss runs on the "
                   "log-probs of vpce's head")
        return None
    return _FusedStep(loss_function.keywords["config"], micro_batch)


def _fusing_forward_step(forward_step):
    @functools.wraps(forward_step)
    def wrapper(self, micro_batch, loss_function, forward_only):
        step = _fused_step(self, micro_batch, loss_function, forward_only)
        if step is None:
            return forward_step(self, micro_batch, loss_function, forward_only)
        return _in_step(step, forward_step, self, micro_batch, step, forward_only)

    wrapper._vpce_original = forward_step
    return wrapper


def _megatron_step(engine, model, postprocess):
    """The step to fuse for this micro-batch of verl's Megatron engine, or None where verl's own forward step runs
    (inference, another loss than verl's ``ppo_loss``, no fused kernels, parallel layouts not fused)."""
    from megatron.core import parallel_state as mpu
    from megatron.core.models.gpt.gpt_model import GPTModel
    from verl.utils.megatron_utils import unwrap_model

    if not (isinstance(postprocess, functools.partial)
            and {"forward_only", "loss_function"} <= set(postprocess.keywords)):
        return None
    keywords = postprocess.keywords
    loss_function = keywords["loss_function"]
    if keywords["forward_only"] or not torch.is_grad_enabled() or not _is_verl_ppo_loss(loss_function):
        return None
    config = engine.engine_config
    if not config.use_fused_kernels:
        return None
    if (config.context_parallel_size > 1 or config.dynamic_context_parallel
            or mpu.get_pipeline_model_parallel_world_size() > 1):
        _warn_once("context parallelism and pipeline parallelism are not fused in verl's Megatron engine: verl's "
                   "policy loss runs on the log-probs of vpce's head")
        return None
    if not isinstance(unwrap_model(model), GPTModel):  # vision-language models: their own packing
        _warn_once("only a GPTModel is fused in verl's Megatron engine: verl's policy loss runs on the log-probs of "
                   "vpce's head")
        return None
    if mpu.get_tensor_model_parallel_world_size() > 1 and not unwrap_model(model).config.sequence_parallel:
        # verl's fused forward then passes the replicated hidden states with no sum of their gradient over the group
        _warn_once("tensor parallelism without sequence parallelism is not fused in verl's Megatron engine: verl's "
                   "policy loss runs on the log-probs of vpce's head")
        return None
    return _MegatronStep(loss_function.keywords["config"], None)


def _fusing_megatron_forward_step(forward_step):
    @functools.wraps(forward_step)
    def wrapper(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func):
        step = _megatron_step(self, model, postprocess_micro_batch_func)
        if step is None:
            return forward_step(self, batch_iter, model, logits_processor_func, postprocess_micro_batch_func)
        micro_batch = next(batch_iter)
        get = functools.partial(_flag, micro_batch)
        if get("distillation_use_topk") or get("distillation_only") or get("calculate_sum_pi_squared"):
            return forward_step(self, iter([micro_batch]), model, logits_processor_func,
                                postprocess_micro_batch_func)
        step.micro_batch = micro_batch
        post = postprocess_micro_batch_func
        post = functools.partial(post.func, *post.args, **{**post.keywords, "loss_function": step})
        return _in_step(step, forward_step, self, iter([micro_batch]), model, logits_processor_func, post)

    wrapper._vpce_original = forward_step
    return wrapper


def _recording_layout(preprocess):
    """verl's ``preprocess_thd_engine``, recording the packed layout (its ``PackedSeqParams``) on the micro-batch's
    step."""
    @functools.wraps(preprocess)
    def wrapper(*args, **kwargs):
        out = preprocess(*args, **kwargs)
        step = _STEP.get()
        if isinstance(step, _MegatronStep):
            step.packed = out[1]
        return out

    wrapper._vpce_original = preprocess
    return wrapper


_PATCHED: dict = {}
_MEGATRON_MODULES = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")


def apply(*, backend="auto", memory_budget="auto", validate=False, megatron=True, fuse_loss=True) -> None:
    """Make verl's actor run on vpce. Call before the workers build their models; ``remove()`` restores verl's.

    - ``FusedLinearForPPO`` (the FSDP worker's head with ``use_fused_kernels``) becomes ``VpceLinearForPPO``:
      the log-probs and entropy of ``compute_log_prob`` / ``compute_ref_log_prob`` (no grad) and of training.
    - With ``fuse_loss``, ``FSDPEngineWithLMHead.forward_step`` computes the actor's policy loss (verl's
      ``ppo_loss``: its loss mode, aggregation, entropy and KL terms) inside the model's forward, fused, when the
      worker's loss function is verl's ``ppo_loss`` and the micro-batch uses the fused kernels; other steps run
      verl's code unchanged.
    - With ``megatron`` (where megatron-core imports), the Megatron worker's ``linear_cross_entropy`` (log-probs and
      entropy on the tensor-parallel vocab shard). With ``fuse_loss`` too, ``MegatronEngineWithLMHead.forward_step``
      computes the actor's policy loss inside that head, fused, under the same conditions (and without context or
      pipeline parallelism, with sequence parallelism under tensor parallelism), and hands it to Megatron's schedule
      as the micro-batch's loss.
    """
    import importlib

    import verl.utils.experimental.torch_functional as tf

    def head(*args, **kwargs):
        return VpceLinearForPPO(*args, backend=backend, memory_budget=memory_budget, validate=validate, **kwargs)

    _PATCHED.setdefault((tf, "FusedLinearForPPO"), tf.FusedLinearForPPO)
    tf.FusedLinearForPPO = head
    if fuse_loss:
        from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead as engine

        if not hasattr(engine.forward_step, "_vpce_original"):
            _PATCHED.setdefault((engine, "forward_step"), engine.forward_step)
            engine.forward_step = _fusing_forward_step(engine.forward_step)
    if megatron:
        for name in _MEGATRON_MODULES:
            try:
                module = importlib.import_module(name)
            except ImportError:
                continue
            _PATCHED.setdefault((module, "linear_cross_entropy"), module.linear_cross_entropy)
            module.linear_cross_entropy = functools.partial(linear_cross_entropy, backend=backend,
                                                            memory_budget=memory_budget, validate=validate)
            if fuse_loss and hasattr(module, "preprocess_thd_engine"):
                if not hasattr(module.preprocess_thd_engine, "_vpce_original"):
                    _PATCHED.setdefault((module, "preprocess_thd_engine"), module.preprocess_thd_engine)
                    module.preprocess_thd_engine = _recording_layout(module.preprocess_thd_engine)
        if fuse_loss:
            try:
                from verl.workers.engine.megatron.transformer_impl import MegatronEngineWithLMHead as mengine
            except ImportError:
                mengine = None
            if mengine is not None and not hasattr(mengine.forward_step, "_vpce_original"):
                _PATCHED.setdefault((mengine, "forward_step"), mengine.forward_step)
                mengine.forward_step = _fusing_megatron_forward_step(mengine.forward_step)


def remove() -> None:
    """Restore verl's own heads. Harmless when not applied."""
    for (module, name), original in list(_PATCHED.items()):
        setattr(module, name, original)
        del _PATCHED[(module, name)]


def is_applied() -> bool:
    return bool(_PATCHED)

