"""torch 2.13's ``torch.nn.functional.linear_cross_entropy`` and ``torch.nn.LinearCrossEntropyLoss``, computed by
vpce: the same signatures, defaults and results, without the ``[N, C]`` logits, plus vpce's own options as
keyword-only extras (``group``, ``vocab_start``, ``vocab_size``, ``z_loss``, ``softcap``, ``logit_scale``, ...).

torch's arguments map onto ``vpce.linear_cross_entropy`` one to one:

* ``input [..., in_features]``, ``linear_weight [C, in_features]``, ``linear_bias [C]`` are vpce's ``hidden``,
  ``weight`` and ``bias``; ``target`` holds class indices;
* ``weight`` (per-class rescaling, ``[C]``) is vpce's ``class_weight``: torch's semantics, label smoothing included
  (``mean`` divides by the summed weights of the non-ignored targets);
* ``ignore_index=None`` means -100, as in torch for class-index targets; ``label_smoothing`` in [0, 1];
* ``options`` (a ``torch.nn.LinearCrossEntropyOptions``, or None) selects torch's chunking strategy. vpce chunks by
  its own rules (``memory_budget``), so the chunking fields are ignored; ``allow_retain_graph=True``, which asks
  for a backward that may run twice, selects ``memory_budget="lean"`` (the route that recomputes in backward).

Differences, all deliberate: the loss is fp32 for 16-bit inputs (torch returns the input dtype); ``mean`` over
targets whose weights sum to 0 (every token ignored, say) is 0 with zero gradients, where torch gives NaN; with the
default fast route (``memory_budget="auto"``) a second backward through the same loss raises, as on torch's own
chunked path (pass ``options=LinearCrossEntropyOptions(allow_retain_graph=True)`` or ``memory_budget="lean"``).
Not supported, with a clear error: class-probability (float) targets, which are a distillation loss
(``vpce.linear_distillation_loss``), and torch's K-dimensional loss (``linear_weight [C, d_1, ..., in_features]``,
``out_features != ()``), whose softmax runs over ``C`` per position.
"""

from __future__ import annotations

import torch

from . import api

__all__ = ["linear_cross_entropy", "LinearCrossEntropyLoss", "EXTRAS"]

#: vpce options accepted as keyword-only extras (``vpce.linear_cross_entropy``'s names).
EXTRAS = ("z_loss", "softcap", "logit_scale", "token_weight", "group", "vocab_start", "vocab_size",
          "sequence_parallel", "backend", "memory_budget", "validate", "accumulate_main_grad")
_TORCH_NAMES = {"class_weight": "weight", "bias": "linear_bias", "hidden": "input"}


def _check_extras(extras: dict, allowed=EXTRAS):
    for name in extras:
        if name in _TORCH_NAMES:
            raise TypeError(f"{name}: expected torch's name for it here, {_TORCH_NAMES[name]}=, got {name}=")
        if name not in allowed:
            raise TypeError(f"{name}: expected a keyword among torch's arguments or vpce's extras {allowed}, got "
                            f"{name}=")


def _memory_budget(options, extras: dict):
    """The vpce ``memory_budget`` that honours torch's ``options`` (see the module docstring)."""
    options_type = getattr(torch.nn, "LinearCrossEntropyOptions", None)
    if options is None:
        return extras.get("memory_budget", "auto")
    if options_type is None or not isinstance(options, options_type):
        raise TypeError(f"options: expected None or a torch.nn.LinearCrossEntropyOptions, got "
                        f"{type(options).__name__}")
    budget = extras.get("memory_budget", "lean" if options.allow_retain_graph else "auto")
    if options.allow_retain_graph and budget != "lean":
        raise ValueError(f"memory_budget: expected 'lean' (or no memory_budget) with "
                         f"options.allow_retain_graph=True, whose backward may run twice, got {budget!r}")
    return budget


def _check_target(target, linear_weight):
    if isinstance(target, torch.Tensor) and target.is_floating_point():
        raise TypeError(f"target: expected class indices (an int64 or int32 tensor), got a {target.dtype} tensor of "
                        f"shape {tuple(target.shape)}; class-probability (soft) targets are a distillation loss, "
                        f"vpce.linear_distillation_loss")
    if isinstance(linear_weight, torch.Tensor) and linear_weight.dim() > 2:
        raise ValueError(f"linear_weight: expected shape [C, in_features] (vpce's softmax runs over all C classes; "
                         f"torch's K-dimensional loss is not supported), got {tuple(linear_weight.shape)}")


def linear_cross_entropy(input, linear_weight, target, *, linear_bias=None, weight=None, reduction="mean",
                         ignore_index=None, label_smoothing=0.0, options=None, **vpce_extras):
    """``torch.nn.functional.linear_cross_entropy`` (torch 2.13) by vpce: the cross-entropy of
    ``input @ linear_weight.T + linear_bias`` against class indices ``target``, without the logits.

    Args:
        input: ``[..., in_features]`` (torch: ``[in_features]`` or ``[N, in_features]``).
        linear_weight: ``[C, in_features]``; under ``group=``, this rank's rows.
        target: class indices, ``input``'s leading shape.
        linear_bias: ``[C]`` or None.
        weight: per-class weights ``[C]`` (this rank's rows under ``group=``), torch's semantics.
        reduction: ``"mean"``, ``"sum"`` or ``"none"``.
        ignore_index: None (-100) or an int.
        label_smoothing: in [0, 1].
        options: None or a ``torch.nn.LinearCrossEntropyOptions`` (module docstring: how it is treated).
        **vpce_extras: keyword-only options of ``vpce.linear_cross_entropy`` (``EXTRAS``).

    Returns:
        The fp32 loss (fp64 for fp64 inputs on the torch backend): a scalar, or ``target``'s shape for
        ``"none"``.
    """
    _check_extras(vpce_extras)
    _check_target(target, linear_weight)
    extras = dict(vpce_extras)
    extras["memory_budget"] = _memory_budget(options, extras)
    return api.linear_cross_entropy(input, linear_weight, target, linear_bias,
                                    ignore_index=-100 if ignore_index is None else ignore_index, reduction=reduction,
                                    label_smoothing=label_smoothing, class_weight=weight, **extras)


class LinearCrossEntropyLoss(torch.nn.Module):
    """``torch.nn.LinearCrossEntropyLoss`` (torch 2.13) by vpce: owns ``self.linear`` (``nn.Linear(in_features,
    num_classes, bias=bias)``) and the per-class ``weight`` buffer, with torch's state-dict keys, so a state dict
    saved from torch's module loads here and back.

    ``forward(input, target)`` returns ``vpce.nn.linear_cross_entropy`` of them. ``vpce_extras`` are keyword-only
    vpce options fixed at construction (``EXTRAS`` but ``token_weight``, which is per call: use the function).
    Under ``group=`` the module holds this rank's ``num_classes`` rows of the vocab (and of ``weight``).
    ``out_features`` must be ``()`` (torch's K-dimensional loss is not supported).
    """

    def __init__(self, in_features, num_classes, *, out_features=(), bias=False, device=None, dtype=None,
                 reduction="mean", weight=None, ignore_index=None, label_smoothing=0.0, options=None,
                 **vpce_extras):
        super().__init__()
        _check_extras(vpce_extras, tuple(e for e in EXTRAS if e != "token_weight"))
        if tuple(out_features) != ():
            raise ValueError(f"out_features: expected () (vpce's softmax runs over all classes; torch's "
                             f"K-dimensional loss is not supported), got {tuple(out_features)}")
        if weight is not None and (not isinstance(weight, torch.Tensor) or weight.shape != (num_classes,)):
            got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
            raise ValueError(f"weight: expected a tensor of shape ({num_classes},) (num_classes), got {got}")
        if ignore_index is not None:
            api.check_int("ignore_index", ignore_index, allow_none=False)
        # the options vpce checks per call, checked once here
        api.CrossEntropyArgs(reduction=reduction, label_smoothing=label_smoothing,
                             **{k: vpce_extras[k] for k in ("z_loss", "softcap", "logit_scale") if k in vpce_extras}
                             ).validate()
        _memory_budget(options, vpce_extras)
        self.num_classes = num_classes
        self.out_features = ()
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.options = options
        self.vpce_extras = dict(vpce_extras)
        self.linear = torch.nn.Linear(in_features, num_classes, bias=bias, device=device, dtype=dtype)
        self.register_buffer("weight", weight)

    def forward(self, input, target):
        return linear_cross_entropy(input, self.linear.weight, target, linear_bias=self.linear.bias,
                                    weight=self.weight, reduction=self.reduction, ignore_index=self.ignore_index,
                                    label_smoothing=self.label_smoothing, options=self.options, **self.vpce_extras)

    def extra_repr(self) -> str:
        extras = "".join(f", {k}={v!r}" for k, v in self.vpce_extras.items() if k != "group")
        return (f"in_features={self.linear.in_features}, num_classes={self.num_classes}, "
                f"out_features={self.out_features}, bias={self.linear.bias is not None}, "
                f"reduction={self.reduction}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}, options={self.options}{extras}")
