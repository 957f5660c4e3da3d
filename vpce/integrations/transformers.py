"""Hugging Face transformers: the causal-LM loss of ``*ForCausalLM`` models, computed by vpce.

``apply(model, **options)`` patches one model instance of a supported family (``FAMILIES``: Llama, Mistral,
Qwen2, Qwen3, Gemma 2, Gemma 3 text, Cohere, Cohere 2, Granite, Phi-3, OLMo 2) so that a forward **with**
``labels`` never builds the ``[tokens, vocab]`` logits. Stock transformers computes, in
``<Family>ForCausalLM.forward``::

    hidden = slice_logits_to_keep(self.model(...).last_hidden_state, logits_to_keep)
    logits = self.lm_head(hidden)                                  # [B, S, V] in the model dtype
    logits = cap * tanh(logits / cap)                              # Gemma 2/3, cap = config.final_logit_softcapping
    logits = logits * self.logit_scale                             # Cohere, Cohere 2
    logits = logits / self.config.logits_scaling                   # Granite
    loss   = self.loss_function(logits, labels, vocab_size, **kwargs)   # ForCausalLMLoss

and ``ForCausalLMLoss`` upcasts the logits to fp32, shifts the labels left by one (the last position gets
``ignore_index``) unless ``shift_labels`` is passed, and takes ``cross_entropy(reduction="mean")``, or
``reduction="sum"`` divided by ``num_items_in_batch`` when that keyword is passed (gradient accumulation).

The patched forward runs the same base model with the same arguments, slices the hidden states the same way, and
hands them with ``lm_head.weight`` (and its bias, if any) to ``causal_lm_loss``, which shifts the labels exactly as
above and calls ``vpce.linear_cross_entropy`` with the family's soft cap as ``softcap=`` and its logit factor as
``logit_scale=`` (Granite's: ``1 / logits_scaling``, a multiplication where stock divides: the same logits up to
one rounding). Both are read from the model at every call, as stock reads them. The returned
``CausalLMOutputWithPast`` has ``logits=None``; its cache (``cache`` from transformers 5.24, ``past_key_values``
before), ``hidden_states`` and ``attentions`` are the base model's. Without ``labels`` the stock forward runs
untouched (``generate`` included).

Numerics: in fp32 the loss and gradients equal stock transformers to rounding. In bf16/fp16 (or under autocast,
where the GEMM operands are cast to the autocast dtype as ``nn.Linear`` would cast them) vpce keeps the logits and
the soft cap in fp32, where stock rounds the logits to the model dtype first, so vpce is the more accurate one.
One deliberate difference: when every label is ``ignore_index``, stock's ``mean`` is ``0/0 = NaN``; vpce's is 0.

The patch lives on the instance (``model.forward``), not on the class; ``apply`` twice only updates the options,
and ``remove(model)`` restores the forward that was there before.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import numbers
import types
import warnings
from typing import Any, Callable

import torch
import torch.nn.functional as F

import vpce

try:
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.modeling_outputs import CausalLMOutputWithPast
except ImportError as err:  # pragma: no cover - exercised only without transformers
    raise ImportError("vpce.integrations.transformers needs the `transformers` package "
                      "(pip install transformers)") from err

try:
    from transformers.modeling_utils import slice_logits_to_keep
except ImportError:  # transformers < 5: the same slicing, inline in each forward
    def slice_logits_to_keep(hidden_states: torch.Tensor, logits_to_keep) -> torch.Tensor:
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        return hidden_states[:, keep, :]

# The output's cache field: ``cache`` from transformers 5.24 (which renamed ``past_key_values``, in the forwards'
# parameters too), ``past_key_values`` before.
_CACHE = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"

__all__ = ["FAMILIES", "OPTIONS", "LogitsRule", "apply", "remove", "is_applied", "causal_lm_loss"]


def _positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite number > 0 (vpce's logit_scale), got {value!r}")
    return float(value)


def _cohere_scale(model) -> float:
    return _positive(model.logit_scale, "model.logit_scale")  # stock multiplies by the instance attribute


def _granite_scale(model) -> float:
    return 1.0 / _positive(model.config.logits_scaling, "model.config.logits_scaling")  # stock divides by it


@dataclasses.dataclass(frozen=True)
class LogitsRule:
    """How a family's forward turns ``lm_head``'s output into the logits it hands to its loss."""

    softcap: bool = False
    """``cap * tanh(logits / cap)`` with ``config.final_logit_softcapping`` (passed to vpce as ``softcap=``)."""
    scale: Callable[[Any], float] | None = None
    """The factor the logits are multiplied by, read from the model (passed to vpce as ``logit_scale=``)."""

    def options(self, model) -> dict:
        """vpce's ``softcap`` / ``logit_scale`` for this model now (read at every call, as stock reads them)."""
        out = {}
        if self.softcap:
            out["softcap"] = getattr(model.config, "final_logit_softcapping", None)
        if self.scale is not None:
            out["logit_scale"] = self.scale(model)
        return out


#: Supported ``*ForCausalLM`` classes -> how their forward forms the logits from ``lm_head``'s output.
FAMILIES = {
    "LlamaForCausalLM": LogitsRule(),
    "MistralForCausalLM": LogitsRule(),
    "Qwen2ForCausalLM": LogitsRule(),
    "Qwen3ForCausalLM": LogitsRule(),
    "Gemma2ForCausalLM": LogitsRule(softcap=True),
    "Gemma3ForCausalLM": LogitsRule(softcap=True),
    "CohereForCausalLM": LogitsRule(scale=_cohere_scale),
    "Cohere2ForCausalLM": LogitsRule(scale=_cohere_scale),
    "GraniteForCausalLM": LogitsRule(scale=_granite_scale),
    "Phi3ForCausalLM": LogitsRule(),
    "Olmo2ForCausalLM": LogitsRule(),
}

#: The vpce options ``apply`` accepts. ``reduction``, ``softcap``, ``logit_scale`` and ``ignore_index`` come from
#: the model and the forward's keywords; the vocab-parallel options do not apply to a whole, unsharded ``lm_head``.
OPTIONS = ("label_smoothing", "z_loss", "backend", "memory_budget", "validate")

# Parameters a supported forward may have besides ``self`` and ``**kwargs``: those of 5.x (``past_key_values``, named
# ``cache`` from 5.24), plus ``cache_position`` (4.57) and Gemma's explicit ``output_*`` flags (4.57). All but
# ``labels`` and ``logits_to_keep`` go to the base model as keywords, as the stock forward passes them.
_KNOWN_PARAMS = {"input_ids", "attention_mask", "position_ids", "past_key_values", "cache", "inputs_embeds",
                 "labels", "use_cache", "cache_position", "output_attentions", "output_hidden_states",
                 "logits_to_keep"}
_ATTR = "_vpce_patch"


@dataclasses.dataclass
class _Patch:
    options: dict
    """Validated vpce options from ``apply``."""
    rule: LogitsRule
    """How this family forms its logits (soft cap, logit scale; read from the model at each call)."""
    signature: inspect.Signature
    """The family forward's signature, read once here rather than at each call (under ``torch.compile`` a cached
    lookup in the forward would be traced every time, and Dynamo warns about ``lru_cache``)."""
    var_kw: str
    """The name of that forward's ``**kwargs``."""
    previous: object
    """The instance-level ``forward`` that ``apply`` replaced (e.g. an accelerate hook), or None."""


def causal_lm_loss(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor | None, *, bias=None,
                   softcap=None, num_items_in_batch=None, ignore_index: int = -100, shift_labels=None,
                   **options) -> torch.Tensor:
    """transformers' ``ForCausalLMLoss`` of the logits ``hidden @ weight.T (+ bias)``, without forming them.

    ``hidden`` is ``[..., D]`` with the leading shape of the (shifted) labels. Labels are shifted left by one with
    ``ignore_index`` appended, unless ``shift_labels`` is given (then ``labels`` is not used). With
    ``num_items_in_batch`` the loss is the sum over tokens divided by it, else the mean over non-ignored tokens.
    ``options`` go to ``vpce.linear_cross_entropy``. Returns the fp32 loss.
    """
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    # on lm_head's device, where stock (and accelerate's hook on lm_head, under a device_map) computes the logits
    hidden = hidden.reshape(-1, hidden.shape[-1]).to(weight.device)
    target = shift_labels.reshape(-1).to(weight.device)
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        # stock runs lm_head under autocast, i.e. on operands cast to the autocast dtype
        dtype = torch.get_autocast_dtype(device_type)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    reduction = "mean" if num_items_in_batch is None else "sum"
    with torch.autocast(device_type, enabled=False):
        loss = vpce.linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index,
                                         reduction=reduction, softcap=softcap, **options)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _signature(cls: type) -> tuple[inspect.Signature, str]:
    """The class forward's signature (through transformers' decorators) and the name of its ``**kwargs``."""
    sig = inspect.signature(cls.forward)
    var_kw = [p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    return sig, var_kw[0] if var_kw else ""


def _family(model) -> tuple[type, inspect.Signature, str]:
    """The supported transformers class ``model`` is (a subclass of), checked to run that class's forward, with
    that forward's signature and the name of its ``**kwargs``."""
    for cls in type(model).__mro__:
        if cls.__name__ in FAMILIES and cls.__module__.startswith("transformers.models."):
            break
    else:
        raise TypeError(f"model: expected an instance of one of {sorted(FAMILIES)}, got {type(model).__name__}")
    if type(model).forward is not cls.forward:
        raise TypeError(f"model: expected {cls.__name__}'s own forward, got one overridden by "
                        f"{type(model).__name__}; vpce would replace it")
    sig, var_kw = _signature(cls)
    params = set(sig.parameters) - {"self", var_kw}
    if not var_kw or not {"labels", "logits_to_keep"} <= params or not params <= _KNOWN_PARAMS:
        raise TypeError(f"model: {cls.__name__}.forward{sig} is not the forward this integration was written for "
                        f"(labels, logits_to_keep and **kwargs for the loss); check the transformers version")
    if not isinstance(getattr(model, "lm_head", None), torch.nn.Linear):
        raise TypeError(f"model.lm_head: expected a torch.nn.Linear, got {type(getattr(model, 'lm_head', None))}")
    return cls, sig, var_kw


def apply(model, **options):
    """Make ``model``'s forward compute its ``labels`` loss with vpce, without logits; returns ``model``.

    ``options`` are among ``OPTIONS`` (``label_smoothing``, ``z_loss``, ``backend``, ``memory_budget``,
    ``validate``), passed to every ``vpce.linear_cross_entropy`` call. Applying again replaces the options.
    """
    family, sig, var_kw = _family(model)
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"options: expected keywords among {OPTIONS}, got {unknown}")
    rule = FAMILIES[family.__name__]
    vpce.LinearCrossEntropy(**options, **rule.options(model))  # validates them now rather than at the first forward
    patch = model.__dict__.get(_ATTR)
    if patch is not None:
        patch.options = dict(options)
        return model
    if model.loss_function is not ForCausalLMLoss:
        raise ValueError(f"model.loss_function: expected transformers' ForCausalLMLoss, got "
                         f"{model.loss_function!r}; vpce computes only that loss")

    def forward(self, *args, **kwargs):
        return _patched_forward(self, *args, **kwargs)

    functools.update_wrapper(forward, family.forward)  # inspect.signature(model.forward) stays the stock one
    setattr(model, _ATTR, _Patch(options=dict(options), rule=rule, signature=sig,
                                 var_kw=var_kw, previous=model.__dict__.get("forward")))
    model.forward = types.MethodType(forward, model)
    return model


def remove(model):
    """Undo ``apply``: restore the forward that was there before it. Harmless on an unpatched model."""
    patch = model.__dict__.get(_ATTR)
    if patch is None:
        return model
    del model.forward
    if patch.previous is not None:
        model.forward = patch.previous
    delattr(model, _ATTR)
    return model


def is_applied(model) -> bool:
    """Whether ``apply`` patched this model instance."""
    return _ATTR in model.__dict__


def _stock_forward(model, patch: _Patch):
    return patch.previous if patch.previous is not None else types.MethodType(type(model).forward, model)


def _patched_forward(model, *args, **kwargs):
    patch = model.__dict__[_ATTR]
    var_kw = patch.var_kw
    call = patch.signature.bind(model, *args, **kwargs).arguments
    if call.get("labels") is None:
        return _stock_forward(model, patch)(*args, **kwargs)
    if model.loss_function is not ForCausalLMLoss:
        warnings.warn(f"vpce: {type(model).__name__}.loss_function was replaced after vpce.integrations."
                      f"transformers.apply; running the stock forward (with logits) to honour it")
        return _stock_forward(model, patch)(*args, **kwargs)

    inputs = {k: v for k, v in call.items() if k not in ("self", var_kw, "labels", "logits_to_keep")}
    extra = dict(call.get(var_kw, {}))
    return_dict = extra.pop("return_dict", None)  # as transformers' can_return_tuple resolves it
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)

    outputs = model.model(**inputs, **extra)
    hidden = slice_logits_to_keep(outputs.last_hidden_state, call.get("logits_to_keep", 0))
    loss_kwargs = {k: extra[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in extra}
    loss = causal_lm_loss(hidden, model.lm_head.weight, call["labels"], bias=model.lm_head.bias,
                          **patch.rule.options(model), **loss_kwargs, **patch.options)
    output = CausalLMOutputWithPast(loss=loss, logits=None, **{_CACHE: getattr(outputs, _CACHE)},
                                    hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    return output if return_dict else output.to_tuple()
