"""vpce as the language-model loss of a megatron-core model (matched against megatron-core 0.16.1).

Two entry points:

- ``apply(model)`` patches one ``GPTModel`` instance so that its own ``forward(input_ids, position_ids,
  attention_mask, labels=labels)`` returns the loss computed by vpce from the final hidden states and the output
  layer's shard; nothing else in the training loop changes. ``remove(model)`` undoes it.
- ``vocab_parallel_lm_loss(hidden, output_layer, labels)`` is the call ``apply`` makes, for model code of one's own.

What it replaces. ``GPTModel._postprocess`` (``megatron/core/models/gpt/gpt_model.py``) ends with::

    logits, _ = self.output_layer(hidden_states, weight=output_weight)   # ColumnParallelLinear -> [s, b, V/tp]
    loss = self.compute_language_model_loss(labels, logits)             # -> [b, s]

``ColumnParallelLinear.forward`` (``megatron/core/tensor_parallel/layers.py``) puts the hidden states through
``copy_to_tensor_model_parallel_region`` (or, with sequence parallelism, the all-gather inside
``LinearWithGradAccumulationAndAsyncCommunication``) and materializes this rank's ``[s, b, V/tp]`` logits;
``LanguageModule.compute_language_model_loss`` (``megatron/core/models/common/language_module/
language_module.py``) turns labels ``[b, s]`` into ``[s, b]``, calls ``tensor_parallel.vocab_parallel_cross_entropy``
and turns the per-token loss back into ``[b, s]``. ``vocab_parallel_lm_loss`` does both lines at once, with the
same inputs and the same ``[b, s]`` output, and never holds the logits::

    loss = vocab_parallel_lm_loss(hidden_states, self.output_layer, labels, weight=output_weight,
                                  vocab_size=real_vocab_size)

Defaults taken from megatron-core, each overridable through the vpce keyword of the same name:

- ``group``: the output layer's ``tp_group``; for a raw weight, ``parallel_state.get_tensor_model_parallel_group()``.
- ``vocab_start``: ``tp_rank * V_local``, Megatron's even partition (``VocabUtility``); passed explicitly with
  ``vocab_size`` so that vpce spends no collective on finding the shard.
- ``vocab_size``: the real vocab size when given (rows past it, Megatron's ``make_vocab_size_divisible_by``
  padding, are left out of the softmax and get zero gradient), else all rows: what Megatron itself computes.
- ``sequence_parallel``: the layer's ``sequence_parallel`` (Megatron turns it off at tp=1), or
  ``config.sequence_parallel`` for a raw weight.
- ``accumulate_main_grad``: ``config.gradient_accumulation_fusion`` when the weight has ``main_grad``, the same
  test as ``LinearWithGradAccumulationAndAsyncCommunication.forward``.

No copy or gather region goes in front: the hidden states enter as the final layer norm leaves them, and vpce
all-reduces dX (or reduce-scatters it under sequence parallelism) itself.

What ``apply`` patches. ``GPTModel.forward`` runs the embedding and the decoder and ends with
``self._postprocess(hidden_states=..., labels=..., loss_mask=..., inference_context=..., ...)``. ``apply`` puts
a wrapper of that bound method on the instance (the class is untouched). With ``labels`` given, on the stage that
owns the output layer (``post_process``), outside inference, the wrapper returns ``vocab_parallel_lm_loss`` of
the hidden states, with ``weight=model.shared_embedding_or_output_weight()`` when embeddings are tied, exactly as
``_postprocess`` passes it to the output layer. Everything else (``labels=None``: the logits, for generation; a
pipeline stage without the output layer; inference) goes to the original method unchanged. Multi-token
prediction (``mtp_num_layers``) is refused: its extra heads would still materialize their logits.

Reductions. ``reduction="none"`` (the default) returns Megatron's ``[b, s]`` per-token loss, so that
``pretrain_gpt``'s ``loss_func`` (``sum(losses * loss_mask)``) is unchanged. The gradients then need the per-token
upstream gradient that arrives only in backward, so vpce recomputes the logits there (8NDV instead of 6NDV, still
without holding them); at tp=1 on the Triton backend its speculative route (docs/api.md) costs 6NDV instead once a
step's upstream gradient is the same on every token (a loss_mask of ones). ``reduction="sum"`` returns ``sum(loss *
loss_mask)`` over the micro-batch, with ``forward``'s own ``loss_mask=`` keyword (the one ``pretrain_gpt`` passes
for MTP; all ones when absent) as vpce's ``token_weight``: one scalar, whose gradients vpce forms in forward (6NDV,
the fast route). ``loss_func`` then takes the returned tensor as its numerator instead of forming it. ``"mean"``
divides that by ``loss_mask.sum()``.
"""

from __future__ import annotations

import dataclasses
import inspect
import numbers

import torch
import torch.distributed as dist

from .. import api

__all__ = ["OPTIONS", "apply", "remove", "is_applied", "vocab_parallel_lm_loss"]


def _tp_group_from_parallel_state():
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        raise ValueError("group: expected megatron-core's parallel_state to be initialized "
                         "(parallel_state.initialize_model_parallel) or a group= argument, got neither")
    return parallel_state.get_tensor_model_parallel_group()


_LAYER_ATTRS = ("weight", "bias", "skip_bias_add", "tp_group", "sequence_parallel", "config",
                "output_size_per_partition", "input_size")


def _from_layer(layer, weight):
    """Weight, bias, group, sequence_parallel and config of a ``ColumnParallelLinear`` output layer."""
    missing = [a for a in _LAYER_ATTRS if not hasattr(layer, a)]
    if missing:
        raise TypeError(f"output_layer: expected a megatron-core ColumnParallelLinear or a weight tensor, got "
                        f"{type(layer).__name__} (no {', '.join(missing)})")
    if weight is None:
        weight = layer.weight
        if weight is None:
            raise ValueError("weight: expected a weight= argument for an output layer built with "
                             "skip_weight_param_allocation=True (tied embeddings), got None")
    else:
        want = (layer.output_size_per_partition, layer.input_size)
        if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != want:
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"weight: expected shape {want} (the output layer's partition), got {got}")
    if getattr(layer, "disable_grad_reduce", False):
        raise ValueError("output_layer: expected disable_grad_reduce=False (vpce always reduces dX over the "
                         "tensor-parallel group), got True")
    bias = None if layer.skip_bias_add else layer.bias
    return weight, bias, layer.tp_group, bool(layer.sequence_parallel), layer.config


def vocab_parallel_lm_loss(hidden, output_layer, labels, *, weight=None, vocab_size=None, config=None,
                           loss_mask=None, reduction="none", **vpce_options):
    """Per-token language-model loss ``[b, s]`` of a megatron-core model, without the ``[s, b, V/tp]`` logits.

    Drop-in for ``output_layer(hidden, weight=weight)`` followed by
    ``LanguageModule.compute_language_model_loss(labels, logits)``.

    Args:
        hidden: final hidden states ``[s, b, h]``, or this rank's ``[s/tp, b, h]`` slice under sequence
            parallelism; no copy/gather region in front.
        output_layer: the model's ``ColumnParallelLinear`` output layer, or a raw ``[V/tp, h]`` weight shard
            (e.g. the tied ``VocabParallelEmbedding.weight``).
        labels: ``[b, s]`` global token ids (the full sequence under sequence parallelism).
        weight: with an output layer, the weight to use instead of its own (``GPTModel`` passes the shared
            embedding weight here when embeddings are tied).
        vocab_size: the real vocab size; rows past it are padding and are excluded. Default: all rows.
        config: a ``ModelParallelConfig``/``TransformerConfig``; default: the output layer's. Read for
            ``sequence_parallel`` (raw weight only), ``gradient_accumulation_fusion`` and
            ``defer_embedding_wgrad_compute``.
        loss_mask: optional ``[b, s]`` float mask or weights (Megatron's ``loss_mask``), passed to vpce as
            ``token_weight``: the per-token losses are multiplied by it and ``mean`` divides by its sum.
        reduction: ``"none"`` (default, ``[b, s]`` like Megatron), ``"sum"`` or ``"mean"`` (0-d). ``sum`` and
            ``mean`` take vpce's faster route (gradients formed in forward); ``none`` recomputes in backward.
        **vpce_options: any other ``vpce.linear_cross_entropy`` keyword (``label_smoothing``, ``z_loss``,
            ``memory_budget``, ``backend``, ...), or an override of ``group``, ``vocab_start``,
            ``sequence_parallel``, ``accumulate_main_grad``.

    Returns:
        fp32 loss, ``[b, s]`` for ``reduction="none"``, else 0-d; the same on every rank of the group.
    """
    if "token_weight" in vpce_options:
        raise TypeError("token_weight: pass Megatron's [b, s] loss_mask= instead (labels' layout)")
    if isinstance(output_layer, torch.Tensor):
        if weight is not None:
            raise ValueError("weight: expected None when output_layer is itself a weight tensor, got a tensor")
        weight, bias = output_layer, None
        group, layer_sp = None, None
    else:
        weight, bias, group, layer_sp, layer_config = _from_layer(output_layer, weight)
        config = layer_config if config is None else config
    if config is not None and getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError("config: expected defer_embedding_wgrad_compute=False (vpce forms the output weight's "
                         "gradient itself), got True")

    group = vpce_options.pop("group", group)
    if group is None:
        group = _tp_group_from_parallel_state()
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight: expected a [V/tp, h] tensor, got {type(weight).__name__}")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected a [V/tp, h] tensor, got shape {tuple(weight.shape)}")
    rows = weight.shape[0]

    sp = vpce_options.pop("sequence_parallel", None)
    if sp is None:
        sp = layer_sp if layer_sp is not None else bool(getattr(config, "sequence_parallel", False))
        sp = sp and world > 1
    if vocab_size is None:
        vocab_size = rows * world
    elif isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
        raise TypeError(f"vocab_size: expected an int, got {type(vocab_size).__name__} {vocab_size!r}")
    elif not 1 <= vocab_size <= rows * world:
        raise ValueError(f"vocab_size: expected an int in [1, {rows * world}] (tp={world} shards of {rows} "
                         f"rows), got {vocab_size}")
    vocab_start = vpce_options.pop("vocab_start", rank * rows)
    if "accumulate_main_grad" not in vpce_options:
        vpce_options["accumulate_main_grad"] = bool(
            getattr(config, "gradient_accumulation_fusion", False) and hasattr(weight, "main_grad")
            and weight.requires_grad)

    for name, t in (("hidden", hidden), ("labels", labels)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if hidden.dim() != 3:
        raise ValueError(f"hidden: expected [s, b, h] (Megatron's layout; [s/tp, b, h] under sequence "
                         f"parallelism), got shape {tuple(hidden.shape)}")
    want = (hidden.shape[1], hidden.shape[0] * (world if sp else 1))
    if tuple(labels.shape) != want:
        what = " (b, s_local * tp: the full sequence under sequence parallelism)" if sp else " (b, s)"
        raise ValueError(f"labels: expected shape {want}{what} to match hidden {tuple(hidden.shape)}, "
                         f"got {tuple(labels.shape)}")
    target = labels.transpose(0, 1)  # [b, s] -> [s, b], hidden's layout
    token_weight = None
    if loss_mask is not None:
        if not isinstance(loss_mask, torch.Tensor) or loss_mask.shape != labels.shape:
            got = tuple(loss_mask.shape) if isinstance(loss_mask, torch.Tensor) else type(loss_mask).__name__
            raise ValueError(f"loss_mask: expected shape {tuple(labels.shape)} (labels'), got {got}")
        token_weight = loss_mask.detach().transpose(0, 1)
        if not token_weight.is_floating_point():
            token_weight = token_weight.float()

    loss = api.linear_cross_entropy(hidden, weight, target, bias, group=group, vocab_start=vocab_start,
                                    vocab_size=vocab_size, sequence_parallel=sp, reduction=reduction,
                                    token_weight=token_weight, **vpce_options)
    return loss.transpose(0, 1).contiguous() if reduction == "none" else loss  # [s, b] -> [b, s]


#: The vpce options ``apply`` passes through to ``vpce.linear_cross_entropy``. The layout (``group``, ``vocab_start``,
#: ``sequence_parallel``, ``accumulate_main_grad``) comes from the model, ``token_weight`` from ``loss_mask``.
OPTIONS = ("label_smoothing", "z_loss", "memory_budget", "backend", "validate")
_ATTR = "_vpce_patch"


@dataclasses.dataclass
class _Patch:
    vocab_size: int | None
    """The real vocab size (rows past it are padding), or None: every row of the output layer."""
    reduction: str
    """``"none"``: Megatron's [b, s]; ``"sum"``/``"mean"``: reduced with ``loss_mask`` (the fast route)."""
    options: dict
    """Validated vpce options, passed to every call."""
    saved: object
    """The instance's own ``_postprocess`` attribute before ``apply`` (normally none: the class method)."""


def _unwrap(model):
    """The ``GPTModel`` inside Megatron's wrappers (``DistributedDataParallel``, ``Float16Module``: ``.module``)."""
    seen = model
    while not hasattr(seen, "_postprocess") and hasattr(seen, "module"):
        seen = seen.module
    missing = [a for a in ("_postprocess", "output_layer", "share_embeddings_and_output_weights", "config",
                           "post_process", "vocab_size") if not hasattr(seen, a)]
    if missing:
        raise TypeError(f"model: expected a megatron-core GPTModel (or a wrapper of one with .module), got "
                        f"{type(model).__name__} (no {', '.join(missing)})")
    return seen


def apply(model, *, vocab_size=None, reduction="none", **options):
    """Make ``model``'s own forward compute its language-model loss with vpce; returns ``model``.

    Args:
        model: a megatron-core ``GPTModel``, or a wrapper of one (``.module``: DDP, ``Float16Module``), or a list of
            them (Megatron-LM's model chunks: each is patched; chunks without the output layer are left as they are).
        vocab_size: the real vocab size, when the model was built with a padded one (Megatron-LM's
            ``args.vocab_size`` vs ``args.padded_vocab_size``): rows past it are left out of the softmax and get
            zero gradient. Default: every row, the loss Megatron itself computes.
        reduction: ``"none"`` (default): ``forward(..., labels=labels)`` returns the ``[b, s]`` per-token loss, as
            stock; ``"sum"``: it returns ``sum(loss * loss_mask)`` for ``forward``'s ``loss_mask=`` keyword (all
            ones when absent), with the gradients formed in forward; ``"mean"``: that sum over ``loss_mask.sum()``.
        **options: vpce options for every call, among ``OPTIONS``.

    Calling ``apply`` again replaces the settings; ``remove`` restores the original forward.
    """
    if isinstance(model, (list, tuple)):
        inners = [_unwrap(m) for m in model]  # every chunk checked before any is patched
        for m in inners:
            apply(m, vocab_size=vocab_size, reduction=reduction, **options)
        return model
    inner = _unwrap(model)
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction: expected 'none', 'sum' or 'mean', got {reduction!r}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"apply: unexpected options {unknown}; expected any of {list(OPTIONS)} (the layout comes "
                        f"from the model, token weights from forward's loss_mask=)")
    if vocab_size is not None:
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, numbers.Integral):
            raise TypeError(f"vocab_size: expected an int, got {type(vocab_size).__name__} {vocab_size!r}")
        if not 1 <= vocab_size <= inner.vocab_size:
            raise ValueError(f"vocab_size: expected an int in [1, {inner.vocab_size}] (the model's rows), got "
                             f"{vocab_size}")
        vocab_size = int(vocab_size)
    config = inner.config
    if getattr(config, "mtp_num_layers", None) is not None:
        raise ValueError(f"model: expected config.mtp_num_layers=None (multi-token prediction's heads would still "
                         f"form their logits), got {config.mtp_num_layers}")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        raise ValueError("model: expected config.defer_embedding_wgrad_compute=False (vpce forms the output "
                         "weight's gradient itself), got True")
    patch = getattr(inner, _ATTR, None)
    if patch is not None:  # again: new settings, same wrapper
        patch.vocab_size, patch.reduction, patch.options = vocab_size, reduction, dict(options)
        return model
    saved = inner.__dict__.get("_postprocess")
    original = inner._postprocess
    signature = inspect.signature(original)
    patch = _Patch(vocab_size=vocab_size, reduction=reduction, options=dict(options), saved=saved)

    def _postprocess(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        labels = bound.arguments.get("labels")
        inference = bound.arguments.get("inference_context") is not None and not inner.training
        if labels is None or not inner.post_process or inference:
            return original(*args, **kwargs)
        hidden = bound.arguments["hidden_states"]
        if bound.arguments.get("mtp_in_postprocess"):
            raise ValueError("model: expected no multi-token prediction block with vpce, got one")
        weight = inner.shared_embedding_or_output_weight() if inner.share_embeddings_and_output_weights else None
        mask = bound.arguments.get("loss_mask") if patch.reduction != "none" else None
        return vocab_parallel_lm_loss(hidden, inner.output_layer, labels, weight=weight, vocab_size=patch.vocab_size,
                                      loss_mask=mask, reduction=patch.reduction, **patch.options)

    inner._postprocess = _postprocess
    setattr(inner, _ATTR, patch)
    return model


def is_applied(model) -> bool:
    """Whether ``apply`` has patched ``model`` (every one of a list) and ``remove`` has not undone it."""
    if isinstance(model, (list, tuple)):
        return all(is_applied(m) for m in model)
    return getattr(_unwrap(model), _ATTR, None) is not None


def remove(model):
    """Undo ``apply``: ``model``'s forward (each of a list's) computes Megatron's own loss again; returns ``model``."""
    if isinstance(model, (list, tuple)):
        for m in model:
            remove(m)
        return model
    inner = _unwrap(model)
    patch = getattr(inner, _ATTR, None)
    if patch is None:
        return model
    if patch.saved is None:
        del inner._postprocess
    else:
        inner._postprocess = patch.saved
    delattr(inner, _ATTR)
    return model
