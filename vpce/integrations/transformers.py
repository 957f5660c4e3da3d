"""Hugging Face transformers: the causal-LM loss of any ``*ForCausalLM`` with a linear head, computed by vpce.

``apply(model, **options)`` patches one model instance so that a forward **with** ``labels`` never builds the
``[tokens, vocab]`` logits. Stock transformers 5.x computes, in every ``<Family>ForCausalLM.forward``::

    outputs = self.<base model>(...)                               # self.model, self.transformer, ...
    hidden  = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    logits  = self.lm_head(hidden)                                 # an nn.Linear: weight [V, D], bias or not
    logits  = <family transform>(logits)                           # soft cap, logit scale, or nothing
    loss    = self.loss_function(logits, labels, vocab_size, **kwargs)      # ForCausalLMLoss
    loss   += self.router_aux_loss_coef * aux_loss                 # mixture-of-experts families, when
                                                                   # output_router_logits (config or keyword)

One generic path serves every family (no per-family copy of the forward). The patched forward runs the family's
**own** forward with ``labels=None``, with a stand-in for ``lm_head``'s forward that keeps the hidden states it
receives and returns ``lm_head``'s output for no position, computed from nothing (no cast of an fp32 head under
autocast), so the stock code runs everything but the logits: the base model, the
slicing, any cast before ``lm_head``, the router aux loss (``aux_loss``), the cache. vpce then takes the kept
hidden states with ``lm_head.weight`` (and its bias) in ``causal_lm_loss``, which shifts the labels as
``ForCausalLMLoss`` does, and adds ``coef * aux_loss`` exactly as stock (the coefficient is the attribute the
family's forward multiplies by, ``router_aux_loss_coef`` or ``aux_loss_coef``).

The family transform is read from the model at every call, as stock reads it: ``softcap=`` from
``config.final_logit_softcapping`` (Gemma 2/3/3n/4), ``logit_scale=`` from ``model.logit_scale`` (Cohere, Cohere 2)
or ``1 / config.logits_scaling`` (Granite, GraniteMoe: a multiplication where stock divides, the same logits up to
one rounding). Nothing is assumed unchecked: the first forward with labels runs the real ``lm_head`` on one
position (no graph, nothing cached), and compares stock's logits for it with vpce's transform of ``lm_head``'s output. A family that does
anything else to its logits (a slice of the vocab, another scale) is refused there with a ``TypeError`` that says
so, before any loss is returned. ``apply`` itself refuses, naming the reason and the alternative, a model whose
output embedding is not an ``nn.Linear``, whose forward has no ``labels``/``**kwargs`` or does not call
``self.loss_function``, or whose ``loss_function`` is not ``ForCausalLMLoss``.

The returned output is stock's output class (``CausalLMOutputWithPast``, ``MoeCausalLMOutputWithPast``, ...) with
vpce's loss and ``logits=None`` (but see Evaluation below); everything else (cache, hidden states, attentions,
``aux_loss``, ``router_logits``) is stock's. Without ``labels`` the stock forward runs untouched (``generate``
included); a training forward without labels builds the logits, and warns once.

PEFT: ``apply(peft_model)`` patches the transformers model inside it (``get_base_model()``) and returns the
``PeftModel``. A LoRA or DoRA adapter on ``lm_head`` (or ``modules_to_save=["lm_head"]``) reaches vpce as one
linear map of a wider input, ``[x, dropout(x) @ A.T] @ [W, s * B].T``, with LoRA dropout drawn as PEFT draws it
(``vpce.integrations.peft``); the first forward checks that form against the head's real output.

``transformers.Trainer``: ``apply(trainer)`` (after building it) patches ``trainer.model`` and maps
``label_smoothing_factor`` onto vpce's ``label_smoothing`` (the same definition as Trainer's ``LabelSmoother``),
so Trainer no longer pops the labels to smooth full logits. A model patched with ``apply(model)`` inside a Trainer
with ``label_smoothing_factor`` raises at the first step, naming ``apply(trainer)``. Evaluation: a no-grad forward
with labels called from ``Trainer.prediction_step`` with ``prediction_loss_only=False`` (``compute_metrics`` set,
or ``predict()``) also returns the logits, from the real ``lm_head`` (the Trainer hands them to
``preprocess_logits_for_metrics`` and ``compute_metrics``, so they exist in stock too); its loss is still vpce's.
Training forwards never build them.

Numerics: in fp32 the loss and gradients equal stock transformers to rounding. In bf16/fp16 (or under autocast,
where the GEMM operands are cast to the autocast dtype as ``nn.Linear`` would cast them) vpce keeps the logits and
the soft cap in fp32, where stock rounds the logits to the model dtype first, so vpce is the more accurate one.
One deliberate difference: when every label is ``ignore_index``, stock's ``mean`` is ``0/0 = NaN``; vpce's is 0.

The patch lives on the instance (``model.forward``), not on the class; ``apply`` twice only updates the options,
and ``remove(model)`` restores the forward that was there before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import numbers
import re
import sys
import types
import warnings

import torch
import torch.nn.functional as F

import vpce

try:
    from transformers.loss.loss_utils import ForCausalLMLoss
except ImportError as err:  # pragma: no cover - exercised only without transformers
    raise ImportError("vpce.integrations.transformers needs the `transformers` package: "
                      "pip install 'transformers>=4.57,<6' (or vpce's `transformers` extra, README.md#install)") from err

__all__ = ["OPTIONS", "apply", "remove", "is_applied", "patch", "VpceAutoModelForCausalLM", "causal_lm_loss",
           "logits_options"]

#: The vpce options ``apply`` accepts. ``reduction``, ``softcap``, ``logit_scale`` and ``ignore_index`` come from
#: the model and the forward's keywords; the vocab-parallel options do not apply to a whole, unsharded ``lm_head``.
OPTIONS = ("label_smoothing", "z_loss", "backend", "memory_budget", "validate")

_ATTR = "_vpce_patch"


def _positive(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}: expected a finite number > 0 (vpce's logit_scale), got {value!r}")
    return float(value)


def logits_options(model) -> dict:
    """vpce's ``softcap`` / ``logit_scale`` for what ``model``'s forward does to ``lm_head``'s output, read now.

    ``config.final_logit_softcapping`` (any family that sets it) -> ``softcap``; Cohere's ``model.logit_scale``
    and Granite's ``1 / config.logits_scaling`` -> ``logit_scale``. The first patched forward checks the result
    against stock's logits (see the module docstring), so a family this does not describe is refused, not
    mis-computed.
    """
    out = {}
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap is not None:
        out["softcap"] = cap
    name = type(model).__name__
    if name.startswith("Cohere") and hasattr(model, "logit_scale"):
        out["logit_scale"] = _positive(model.logit_scale, "model.logit_scale")  # stock multiplies by it
    elif name.startswith("Granite") and hasattr(model.config, "logits_scaling"):
        out["logit_scale"] = 1.0 / _positive(model.config.logits_scaling, "model.config.logits_scaling")
    return out


@dataclasses.dataclass
class _Patch:
    options: dict
    """Validated vpce options from ``apply``."""
    signature: inspect.Signature
    """The family forward's signature, read once here rather than at each call (under ``torch.compile`` a cached
    lookup in the forward would be traced every time, and Dynamo warns about ``lru_cache``)."""
    var_kw: str
    """The name of that forward's ``**kwargs``."""
    aux_coef: str | None
    """The attribute the family's forward multiplies its router aux loss by, or None (no aux loss)."""
    previous: object
    """The instance-level ``forward`` that ``apply`` replaced (e.g. an accelerate hook), or None."""
    checked: bool = False
    """Whether a forward has compared stock's logits with vpce's transform of ``lm_head``'s output."""
    warned: bool = False
    """Whether the one warning for a forward that builds logits has been given."""
    label_smoothing_from_trainer: bool = False
    """Whether ``label_smoothing`` came from a Trainer's ``label_smoothing_factor`` (``apply(trainer)``)."""


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
        # stock runs lm_head under autocast, i.e. on operands cast to the autocast dtype: all of them here but fp32
        # parameters, which vpce casts under the same autocast inside its autograd Function, handing their
        # gradients back in fp32 with no 16-bit copy (vpce.prepare.compute_operands)
        dtype = torch.get_autocast_dtype(device_type)
        cast = lambda t: t if t is None or t.dtype == torch.float32 else t.to(dtype)  # noqa: E731
        hidden, weight, bias = hidden.to(dtype), cast(weight), cast(bias)
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = vpce.linear_cross_entropy(hidden, weight, target, bias, ignore_index=ignore_index, reduction=reduction,
                                     softcap=softcap, **options)
    if num_items_in_batch is not None:
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


_ALTERNATIVE = ("the alternative: run the model with output_hidden_states=True and no labels, and call "
                "vpce.linear_cross_entropy(hidden_states[-1], weight, shifted_labels) yourself")


def _peft():
    """``vpce.integrations.peft`` when PEFT is in use (imported), else None: nothing imports peft for a user who
    does not."""
    if "peft" not in sys.modules:
        return None
    from vpce.integrations import peft as vpce_peft
    return vpce_peft


def _unwrap(model):
    """The transformers model a ``PeftModel`` wraps; ``model`` itself otherwise."""
    vpce_peft = _peft()
    return vpce_peft.base_model(model) if vpce_peft is not None else model


def _plain_head(head) -> bool:
    return isinstance(head, torch.nn.Linear) and not (_peft() and _peft().is_peft_head(head))


def _check_head(head, name: str) -> None:
    if _plain_head(head):
        if not head.weight.is_floating_point():
            raise TypeError(f"model.lm_head: expected a floating-point weight, got {head.weight.dtype} "
                            f"({type(head).__name__} in {name}: a quantized lm_head); keep lm_head unquantized")
        return
    vpce_peft = _peft()
    if vpce_peft is None or not vpce_peft.is_peft_head(head):
        raise TypeError(f"model.lm_head: expected a torch.nn.Linear (or a PEFT LoRA layer over one), got "
                        f"{type(head).__name__} in {name}; {_ALTERNATIVE}")
    vpce_peft.check_head(head)


def _check_model(model, forward=None) -> tuple[inspect.Signature, str, str | None]:
    """Refuse, naming the reason, a model the generic path cannot reproduce; return the forward's signature, the
    name of its ``**kwargs`` and the router aux-loss coefficient's attribute (None without one). ``forward`` is the
    class's stock forward (default: the class attribute)."""
    name = type(model).__name__
    forward = type(model).forward if forward is None else forward
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None or getattr(model, "lm_head", None) is not head:
        raise TypeError(f"model: expected a transformers causal LM whose output embedding is `lm_head`, got "
                        f"{name} (output embedding {type(head).__name__}); vpce computes the loss of that "
                        f"head; {_ALTERNATIVE}")
    _check_head(head, name)
    sig = inspect.signature(forward)
    var_kw = [p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
    if "labels" not in sig.parameters or not var_kw:
        raise TypeError(f"model: {name}.forward{sig} has no `labels` and `**kwargs` (the loss keywords); this is "
                        f"not a transformers causal-LM forward vpce can patch; {_ALTERNATIVE}")
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):  # no source (frozen, compiled): the first forward's check still guards
        source = "self.loss_function("
    if "self.loss_function(" not in source:
        raise TypeError(f"model: {name}.forward computes its loss with its own code, not self.loss_function "
                        f"(ForCausalLMLoss); vpce reproduces only that loss; {_ALTERNATIVE}")
    if "z_loss" in source:
        raise TypeError(f"model: {name}.forward adds a z-loss of its own to the loss; vpce does not reproduce "
                        f"it (vpce's own z_loss option differs in its coefficient source); {_ALTERNATIVE}")
    if model.loss_function is not ForCausalLMLoss:
        raise ValueError(f"model.loss_function: expected transformers' ForCausalLMLoss, got "
                         f"{model.loss_function!r}; vpce computes only that loss")
    coef = re.search(r"self\.(\w+)\s*\*\s*aux_loss", source)
    return sig, var_kw[0], coef.group(1) if coef else None


def apply(model, **options):
    """Make ``model``'s forward compute its ``labels`` loss with vpce, without logits; returns ``model``.

    ``options`` are among ``OPTIONS`` (``label_smoothing``, ``z_loss``, ``backend``, ``memory_budget``,
    ``validate``), passed to every ``vpce.linear_cross_entropy`` call. Applying again replaces the options.
    ``model`` may be a ``transformers.Trainer`` (built, not yet trained): then its model is patched and its
    ``label_smoothing_factor`` becomes vpce's ``label_smoothing``; returns the trainer. ``model`` may be a
    ``peft.PeftModel``: the transformers model inside it is patched; returns the ``PeftModel``.
    """
    if _is_trainer(model):
        return _apply_trainer(model, **options)
    wrapper, model = model, _unwrap(model)
    if wrapper is not model:
        apply(model, **options)
        return wrapper
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"options: expected keywords among {OPTIONS}, got {unknown}")
    if not hasattr(model, "config"):
        raise TypeError(f"model: expected a transformers causal LM (a PreTrainedModel with an lm_head), got "
                        f"{type(model).__name__}")
    sig, var_kw, aux_coef = _check_model(model)
    vpce.LinearCrossEntropy(**options, **logits_options(model))  # validates them now, not at the first forward
    patch = model.__dict__.get(_ATTR)
    if patch is not None:
        patch.options = dict(options)
        return model

    def forward(self, *args, **kwargs):
        return _patched_forward(self, *args, **kwargs)

    functools.update_wrapper(forward, type(model).forward)  # inspect.signature(model.forward) stays the stock one
    setattr(model, _ATTR, _Patch(options=dict(options), signature=sig, var_kw=var_kw, aux_coef=aux_coef,
                                 previous=model.__dict__.get("forward")))
    model.forward = types.MethodType(forward, model)
    return model


def remove(*targets):
    """Undo ``apply`` or ``patch``.

    ``remove(model)`` (a model, ``PeftModel`` or Trainer) restores the forward that was there before ``apply``;
    harmless on an unpatched model. ``remove("llama")`` / ``remove(LlamaForCausalLM)`` withdraws those ``patch``
    targets, and ``remove()`` all of them: models built afterwards are stock again (models already built keep
    their instance patch until ``remove(model)``).
    """
    if len(targets) == 1 and not isinstance(targets[0], (str, type)):
        return _remove_instance(targets[0])
    _unpatch(targets)
    return None


def _remove_instance(model):
    if _is_trainer(model):
        remove(model.model)
        return model
    wrapper, model = model, _unwrap(model)
    state = model.__dict__.get(_ATTR)
    if state is None:
        return wrapper
    del model.forward
    if state.previous is not None:
        model.forward = state.previous
    delattr(model, _ATTR)
    return wrapper


def is_applied(model) -> bool:
    """Whether ``apply`` patched this model instance (or this Trainer's model)."""
    if _is_trainer(model):
        model = model.model
    return _ATTR in _unwrap(model).__dict__


# -- before loading: class-level patch and an Auto loader -------------------------------------------------------------

_ALL = "*"
_CLASS_PATCHES: dict = {}
"""``patch`` targets (a model type or class name string, a class, or ``_ALL``) -> their vpce options."""
_POST_INIT: list = []
"""``PreTrainedModel.post_init`` as it was before ``patch`` wrapped it (empty while nothing is patched)."""


def _causal_lm_names() -> set:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())


def _is_causal_lm(model) -> bool:
    names = _causal_lm_names()
    return hasattr(model, "lm_head") and any(c.__name__ in names or c.__name__.endswith("ForCausalLM")
                                             for c in type(model).__mro__)


def _check_target(target):
    if isinstance(target, type):
        from transformers import PreTrainedModel
        if not issubclass(target, PreTrainedModel):
            raise TypeError(f"targets: expected transformers model classes, model types or class names, got the "
                            f"class {target.__name__}")
        return target
    if not isinstance(target, str) or not target:
        raise TypeError(f"targets: expected model types ('llama'), class names or classes, got {target!r}")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    if target not in CONFIG_MAPPING_NAMES and target not in _causal_lm_names() and not target.endswith("ForCausalLM"):
        raise ValueError(f"targets: expected a transformers model type (a key of CONFIG_MAPPING_NAMES, e.g. 'llama') "
                         f"or a causal-LM class name, got {target!r}")
    return target


def patch(*targets, **options) -> None:
    """Make every causal LM built from now on compute its ``labels`` loss with vpce, as ``apply`` would.

    ``targets`` are model types (``"llama"``, matched against ``config.model_type``), class names
    (``"LlamaForCausalLM"``) or classes (``LlamaForCausalLM``, subclasses included); none means every causal LM.
    ``options`` are ``apply``'s, used for models of these targets (patching a target again replaces them). The
    hook runs at the end of each model's construction (``PreTrainedModel.post_init``), so ``from_pretrained``,
    ``from_config`` and a recipe's own loading code all get a patched instance; PEFT may wrap it afterwards. A
    model of a class or class name named here that ``apply`` refuses raises at its construction; one reached
    through a model type or ``patch()`` is left stock, with a warning naming the reason. ``remove`` undoes it.
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"options: expected keywords among {OPTIONS}, got {unknown}")
    vpce.LinearCrossEntropy(**options)  # validated now, not at each model's construction
    checked = [_check_target(t) for t in targets] or [_ALL]
    from transformers import PreTrainedModel
    if not _POST_INIT:
        original = PreTrainedModel.post_init
        _POST_INIT.append(original)

        @functools.wraps(original)
        def post_init(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            _apply_built(self)
            return out

        PreTrainedModel.post_init = post_init
    for target in checked:
        _CLASS_PATCHES[target] = dict(options)


def _unpatch(targets) -> None:
    for target in targets or list(_CLASS_PATCHES):
        _CLASS_PATCHES.pop(target, None)
    if not _CLASS_PATCHES and _POST_INIT:
        from transformers import PreTrainedModel
        PreTrainedModel.post_init = _POST_INIT.pop()


def _apply_built(model) -> None:
    """``post_init``'s hook: ``apply`` to a model a ``patch`` target matches."""
    if _ATTR in model.__dict__:
        return
    named = [options for target, options in _CLASS_PATCHES.items()
             if (isinstance(target, type) and isinstance(model, target)) or target == type(model).__name__]
    if named:
        options = named[-1]
    else:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        options = _CLASS_PATCHES.get(model_type, _CLASS_PATCHES.get(_ALL))
        if options is None or not _is_causal_lm(model):
            return
    try:
        apply(model, **options)
    except (TypeError, ValueError) as err:
        if named:
            raise
        warnings.warn(f"vpce.integrations.transformers.patch: {type(model).__name__} is left stock: {err}",
                      stacklevel=3)


class VpceAutoModelForCausalLM:
    """``transformers.AutoModelForCausalLM`` whose models come back patched by ``apply``.

    ``from_pretrained(...)`` and ``from_config(...)`` take ``AutoModelForCausalLM``'s arguments plus ``apply``'s
    options (``OPTIONS``: ``memory_budget="lean"``, ...) as keywords.
    """

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        from transformers import AutoModelForCausalLM
        options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
        return apply(AutoModelForCausalLM.from_pretrained(*args, **kwargs), **options)

    @classmethod
    def from_config(cls, *args, **kwargs):
        from transformers import AutoModelForCausalLM
        options = {k: kwargs.pop(k) for k in OPTIONS if k in kwargs}
        return apply(AutoModelForCausalLM.from_config(*args, **kwargs), **options)


# -- Trainer -------------------------------------------------------------------------------------------------------

def _is_trainer(obj) -> bool:
    trainer = sys.modules.get("transformers.trainer")
    return trainer is not None and isinstance(obj, trainer.Trainer)


def _apply_trainer(trainer, **options):
    smoothing = trainer.args.label_smoothing_factor
    if trainer.label_smoother is not None:
        if "label_smoothing" in options and options["label_smoothing"] != smoothing:
            raise ValueError(f"label_smoothing: expected Trainer's label_smoothing_factor ({smoothing}) or "
                             f"nothing, got {options['label_smoothing']}")
        options["label_smoothing"] = smoothing
    model = trainer.accelerator.unwrap_model(trainer.model) if hasattr(trainer, "accelerator") else trainer.model
    apply(model, **options)
    if trainer.label_smoother is not None:
        trainer.label_smoother = None  # the labels now reach the model, whose loss is smoothed by vpce
        model.__dict__[_ATTR].label_smoothing_from_trainer = True
    return trainer


def _calling_trainer(names: tuple[str, ...], depth: int = 30):
    """The ``transformers.Trainer`` whose method in ``names`` is up the stack (within ``depth`` frames), or None."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code.co_name in names:
            owner = frame.f_locals.get("self")
            if _is_trainer(owner):
                return owner
        frame = frame.f_back
    return None


def _prediction_keeps_logits(depth: int = 30) -> bool:
    """Whether a ``Trainer.prediction_step`` up the stack keeps the logits it gets (``prediction_loss_only``
    False: ``compute_metrics`` is set, or ``predict()``), as it decides for Liger's ``skip_logits`` too."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_code.co_name == "prediction_step" and _is_trainer(frame.f_locals.get("self")):
            return not frame.f_locals.get("prediction_loss_only", True)
        frame = frame.f_back
    return False


# -- the patched forward -------------------------------------------------------------------------------------------

def _stock_forward(model, patch: _Patch):
    return patch.previous if patch.previous is not None else types.MethodType(type(model).forward, model)


def _warn_logits(model, patch: _Patch, why: str):
    if not patch.warned:
        patch.warned = True
        warnings.warn(f"vpce: {type(model).__name__}'s forward built the [tokens, vocab] logits ({why}); "
                      f"vpce computes the loss without them only for a forward with labels. Warned once.",
                      stacklevel=3)


def _without_labels(model, patch: _Patch, args, kwargs):
    if torch.is_grad_enabled() and model.training:
        trainer = _calling_trainer(("compute_loss",))
        if trainer is not None and trainer.label_smoother is not None:
            raise ValueError(f"Trainer(label_smoothing_factor={trainer.args.label_smoothing_factor}) takes the "
                             f"labels away from the model patched by vpce and smooths full logits itself; call "
                             f"vpce.integrations.transformers.apply(trainer) after building the Trainer (it maps "
                             f"label_smoothing_factor onto vpce's label_smoothing), or pass "
                             f"apply(model, label_smoothing=...) and no label_smoothing_factor")
        _warn_logits(model, patch, "a training forward without labels")
    return _stock_forward(model, patch)(*args, **kwargs)


def _transform(z: torch.Tensor, softcap=None, logit_scale: float = 1.0) -> torch.Tensor:
    z = z.float() * logit_scale
    return z if softcap is None else softcap * torch.tanh(z / softcap)


@contextlib.contextmanager
def _quiet(head, plain: bool):
    """Around a look at the real head: no dropout drawn (a PEFT head in eval mode, so the random stream stays
    stock's) and, outside a traced graph, autocast's cache off (nothing cast is kept)."""
    training = head.training
    if not plain and training:
        head.train(False)
    cache = None
    if not torch.compiler.is_compiling():  # a traced graph has no autocast cache (nor can Dynamo trace one)
        cache = torch.is_autocast_cache_enabled()
        torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        if cache is not None:
            torch.set_autocast_cache_enabled(cache)
        if not plain and training:
            head.train(True)


def _check_head_linear(model, want: torch.Tensor, got: torch.Tensor):
    """A PEFT head's real output for one position against vpce's linear form of it (vpce.integrations.peft)."""
    eps = torch.finfo(want.dtype).eps
    want, got = want.detach().float(), got.detach().float()
    err = (want - got).abs().max().item()
    if not err <= 16 * eps * max(want.abs().max().item(), 1.0):
        raise TypeError(f"model.lm_head: {type(model.lm_head).__name__}'s output differs from vpce's linear form "
                        f"of it by {err:.3g}; vpce cannot reproduce this PEFT head exactly; {_ALTERNATIVE}")


def _check_logits(model, logits, head_out, extra: dict):
    """Stock's logits for the probe position against vpce's transform of lm_head's output for it."""
    name = type(model).__name__
    if logits is None or head_out is None or logits.shape != head_out.shape:
        raise TypeError(f"model: {name}'s forward does not return lm_head's output (or a function of it, "
                        f"element by element) as its logits: lm_head gave {tuple(getattr(head_out, 'shape', ()))}"
                        f", logits {tuple(getattr(logits, 'shape', ()))}; vpce cannot reproduce its loss; "
                        f"{_ALTERNATIVE}")
    want, got = logits.detach().float(), _transform(head_out.detach(), **extra)
    eps = torch.finfo(logits.dtype if logits.is_floating_point() else torch.float32).eps
    err = (want - got).abs().max().item()
    if not err <= 8 * eps * max(want.abs().max().item(), 1.0):
        raise TypeError(f"model: {name}'s forward transforms lm_head's output in a way vpce does not reproduce "
                        f"(vpce applies {extra or 'nothing'}; stock's logits differ by {err:.3g}); {_ALTERNATIVE}")


def _patched_forward(model, *args, **kwargs):
    patch = model.__dict__[_ATTR]
    bound = patch.signature.bind(model, *args, **kwargs)
    call = bound.arguments
    labels = call.get("labels")
    if labels is None:
        return _without_labels(model, patch, args, kwargs)
    if model.loss_function is not ForCausalLMLoss:
        _warn_logits(model, patch, f"{type(model).__name__}.loss_function was replaced after apply")
        return _stock_forward(model, patch)(*args, **kwargs)
    want_logits = not torch.is_grad_enabled() and _prediction_keeps_logits()

    extras = logits_options(model)  # read (and checked) as stock reads them, before the stock forward runs
    extra = dict(call.get(patch.var_kw, {}))
    return_dict = call.get("return_dict", extra.pop("return_dict", None))  # as transformers' decorators resolve it
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    loss_kwargs = {k: extra[k] for k in ("num_items_in_batch", "ignore_index", "shift_labels") if k in extra}
    call["labels"] = None
    if "return_dict" in patch.signature.parameters:
        call["return_dict"] = True
    else:
        extra["return_dict"] = True
    call[patch.var_kw] = extra

    # The stock forward runs with a stand-in for lm_head's forward: it keeps the full input for vpce and hands back
    # lm_head's output for no position, computed from nothing, so that no cast of an fp32 lm_head is made (under
    # autocast that cast, 0.5 GiB on a 128k-vocab head, stayed in autocast's cache beside vpce's own until the
    # forward ended, at the training step's peak). At the first call it gives the real output for one position
    # (no graph, nothing cached), whose logits check vpce's transform.
    kept = {"calls": 0}
    probe = not patch.checked
    head = model.lm_head
    plain = _plain_head(head)
    own = head.__dict__.get("forward")  # an instance forward (accelerate's hooks) is put back as found
    real = own if own is not None else types.MethodType(type(head).forward, head)

    def linear(x):
        return (x, head.weight, head.bias) if plain else _peft().head_linear(head, x)

    def stand_in(x, *rest, **kw):
        kept["calls"] += 1
        if not plain and (rest or kw):
            raise TypeError(f"model.lm_head: expected a call with the hidden states only, got extra arguments "
                            f"{sorted(kw) or len(rest)} (PEFT's mixed-adapter batches, adapter_names=, are not "
                            f"supported by vpce's loss)")
        if probe or want_logits:
            # the real head's output: all positions when the caller keeps the logits, else one position that
            # checks vpce's transform (and, for a PEFT head, vpce's linear form of it); no dropout is drawn here
            part = x if want_logits else x.narrow(-2, 0, min(1, x.shape[-2]))
            with torch.no_grad(), _quiet(head, plain):
                kept["head_out"] = real(part, *rest, **kw)
                if probe and not plain:
                    one = part.narrow(-2, 0, min(1, part.shape[-2]))
                    kept["head_check"] = (kept["head_out"].narrow(-2, 0, one.shape[-2]), F.linear(*linear(one)))
        kept["linear"] = linear(x)
        if "head_out" in kept:
            return kept["head_out"]
        autocast = torch.is_autocast_enabled(x.device.type)
        dtype = torch.get_autocast_dtype(x.device.type) if autocast else x.dtype
        return x.new_empty((*x.shape[:-2], 0, head.weight.shape[0]), dtype=dtype)

    head.forward = stand_in
    try:
        out = _stock_forward(model, patch)(*bound.args[1:], **bound.kwargs)
    finally:
        if own is None:
            del head.forward
        else:
            head.forward = own
    if kept.get("calls") != 1:
        raise TypeError(f"model: {type(model).__name__}'s forward called lm_head {kept.get('calls', 0)} times, not "
                        f"once; vpce computes the loss of one call's logits; {_ALTERNATIVE}")
    if probe:
        if "head_check" in kept:
            _check_head_linear(model, *kept["head_check"])
        _check_logits(model, out.get("logits"), kept.get("head_out"), extras)
        patch.checked = True

    hidden, weight, bias = kept["linear"]
    loss = causal_lm_loss(hidden, weight, labels, bias=bias, **extras, **loss_kwargs, **patch.options)
    aux = out.get("aux_loss")
    if aux is not None:
        if patch.aux_coef is None or not hasattr(model, patch.aux_coef):
            raise TypeError(f"model: {type(model).__name__} returned a router aux loss but vpce did not find the "
                            f"coefficient its forward multiplies it by; {_ALTERNATIVE}")
        if not isinstance(aux, torch.Tensor):  # some versions' MoE forwards give a plain 0 without router logits
            aux = torch.as_tensor(aux, dtype=loss.dtype)
        loss = loss + getattr(model, patch.aux_coef) * aux.to(loss.device)
    fields = {k: v for k, v in out.items() if k not in ("loss", "logits")}
    output = type(out)(loss=loss, logits=out.get("logits") if want_logits else None, **fields)
    return output if return_dict else output.to_tuple()
