"""torchtune: vpce's cross-entropy as a torchtune SFT loss, from the final hidden states, without logits.

A recipe config names it as its loss::

    loss:
      _component_: vpce.integrations.torchtune.LinearCrossEntropyLoss

torchtune's main branch (the ``SFTLoss`` protocol, ``torchtune/modules/loss/loss_types.py``). The SFT recipes
instantiate ``cfg.loss`` and, for an ``SFTLoss``, call ``loss.set_model_output(model)``. ``_loss_step`` then calls
``loss(model(**batch), labels)``. The labels ``[b, s]`` arrive already shifted by the dataset. Here
``set_model_output`` sets the model's ``skip_output_layer = True``, so ``TransformerDecoder.unembed`` returns the
final norm's output ``[b, s, d]`` instead of ``output(h).float()``. The loss keeps the output layer and reads its
weight at every call, so a reloaded or swapped parameter is the one used.

The released torchtune 0.6.x has neither ``SFTLoss`` nor ``skip_output_layer``. Its recipes shift the labels
themselves (``ignore_index`` appended), flatten a tensor output to ``[b*s, -1]``, and call ``loss(output, labels)``
(a list output would be ``CEWithChunkedOutputLoss``'s chunks, which this loss refuses). On 0.6.x
``set_model_output`` gives the decoder an instance-level ``unembed`` that returns ``norm(h)``, which is what main's
``skip_output_layer`` does. Nothing in the state dict changes. A 0.6.x recipe never calls ``set_model_output``, so
a copied recipe (``tune cp full_finetune_single_device .``) needs the one line that main's recipes have, right
after ``self._loss_fn = config.instantiate(cfg.loss)``::

    if hasattr(self._loss_fn, "set_model_output"):
        self._loss_fn.set_model_output(self._model)

The output layer may be an ``nn.Linear`` (weight and bias) or torchtune's ``TiedLinear`` (the tied embedding's
weight, no bias). The loss is ``vpce.linear_cross_entropy(hidden, weight, labels, bias, reduction="mean")``: the
sum over non-ignored tokens divided by their count, which is what ``CEWithChunkedOutputLoss`` and main's
``LinearCrossEntropyLoss`` compute. When every label is ignored it is 0, as on main; 0.6.x's chunked loss gives
``0/0 = NaN`` there. The logits are formed in fp32 from the hidden states and weight in their own dtype. A bf16
model therefore gets a more accurate loss than stock, which rounds the logits to bf16 before upcasting them.

LoRA on the output layer (``apply_lora_to_output``, torchtune's ``LoRALinear``) adds ``(alpha / rank) *
lora_b(lora_a(dropout(h)))`` to ``h @ W.T + b``. That is one linear map of a wider input, exactly:
``[h, u] @ [W, (alpha / rank) * B].T + b`` with ``u = lora_a(dropout(h))`` (``rank`` more columns), so the loss
hands vpce that hidden and weight, built at every call from the parameters as they are. The dropout mask is drawn
by the layer's own dropout module where its forward draws it; gradients reach ``lora_a`` and ``lora_b`` (and ``W``
only where it requires one). A disabled adapter is the base layer. Not supported, with an error: DoRA
(``DoRALinear``), an NF4-quantized base weight (QLoRA's output layer), and output weights that are DTensors (FSDP2
shards the weight over data-parallel ranks and tensor parallelism over a TP mesh; vpce would take either for a
vocab shard of the same tokens).
"""

from __future__ import annotations

import types

import torch

import vpce

try:
    from torchtune.modules import TransformerDecoder
    from torchtune.modules.tied_linear import TiedLinear
except ImportError as err:  # pragma: no cover - exercised only without torchtune
    raise ImportError("vpce.integrations.torchtune needs the `torchtune` package: pip install 'torchtune==0.6.1' "
                      "'torchao>=0.13,<0.16' (the `torchtune` extra; from a vpce clone: pip install '.[torchtune]'; "
                      "README.md#install)") from err

try:  # torchtune main: the protocol the SFT recipes test with isinstance
    from torchtune.modules.loss import SFTLoss
    _BASES = (SFTLoss, torch.nn.Module)
except ImportError:  # torchtune 0.6.x: no protocol; the recipe calls the loss as a plain module
    _BASES = (torch.nn.Module,)

try:
    from torchtune.modules.peft import LoRALinear
except ImportError:  # pragma: no cover - a torchtune without LoRA modules
    LoRALinear = ()

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # torch < 2.5, or a build without torch.distributed
    DTensor = ()

__all__ = ["LinearCrossEntropyLoss", "OPTIONS", "output_weight", "output_linear"]

#: The vpce options the loss accepts besides ``ignore_index``; the reduction is the recipe's mean.
OPTIONS = ("label_smoothing", "z_loss", "backend", "memory_budget", "validate")


def output_weight(output) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(weight, bias)`` of a torchtune output layer: an ``nn.Linear``, a ``TiedLinear``, or a ``LoRALinear``'s
    base layer; anything else is refused with a ``TypeError`` naming it."""
    if isinstance(output, TiedLinear):
        return output.tied_module.weight, None
    if type(output) is torch.nn.Linear:  # not a subclass: other layers add terms of their own
        return output.weight, output.bias
    if LoRALinear and type(output) is LoRALinear:  # DoRALinear and other variants are not LoRALinear itself
        if getattr(output, "_quantize_base", False):
            raise TypeError("model.output: expected a LoRALinear with a plain base weight, got an NF4-quantized one "
                            "(QLoRA on the output layer); vpce needs the weight as a tensor")
        return output.weight, output.bias
    raise TypeError(f"model.output: expected a torch.nn.Linear, torchtune's TiedLinear or its LoRALinear, got "
                    f"{type(output).__name__}")


def output_linear(output, hidden: torch.Tensor):
    """``(hidden, weight, bias)`` whose ``hidden @ weight.T + bias`` is the output layer's ``output(hidden)``: the
    layer's own for a linear layer; for a ``LoRALinear`` the wider input ``[h, lora_a(dropout(h))]`` against
    ``[W, (alpha / rank) * lora_b.weight]`` (module docstring)."""
    weight, bias = output_weight(output)
    if not (LoRALinear and type(output) is LoRALinear) or output.disabled:
        return hidden, weight, bias
    u = output.lora_a(output.dropout(hidden))
    scaled_b = (output.alpha / output.rank) * output.lora_b.weight
    return torch.cat([hidden, u.to(hidden.dtype)], -1), torch.cat([weight, scaled_b.to(weight.dtype)], 1), bias


def _unembed_hidden(self, h: torch.Tensor) -> torch.Tensor:
    """``TransformerDecoder.unembed`` with main's ``skip_output_layer``: the final norm, no projection."""
    return self.norm(h)


class LinearCrossEntropyLoss(*_BASES):
    """torchtune SFT loss: mean cross-entropy of ``output(hidden)`` over non-ignored labels, without logits.

    ``set_model_output(model)`` must be called once before the first forward. It makes the model return hidden
    states and keeps its output layer. ``forward(outputs, targets)`` takes hidden states ``[..., d]`` and labels
    of the same leading shape, already shifted, as torchtune's recipes pass them.

    ``ignore_index`` is torchtune's (-100). ``options`` are among ``OPTIONS``, passed to every
    ``vpce.linear_cross_entropy`` call; ``label_smoothing`` follows torch's definition.
    """

    def __init__(self, ignore_index: int = -100, **options):
        super().__init__()
        unknown = sorted(set(options) - set(OPTIONS))
        if unknown:
            raise TypeError(f"options: expected keywords among {OPTIONS}, got {unknown}")
        vpce.LinearCrossEntropy(ignore_index=ignore_index, **options)  # validates them now, not at the first step
        self.ignore_index = ignore_index
        self.options = dict(options)
        # the model's output layer; kept out of this module's parameters and state dict (the model owns it)
        self.__dict__["output_layer"] = None

    def set_model_output(self, model: torch.nn.Module) -> None:
        """Make ``model`` return its final norm's output instead of logits, and keep its output layer."""
        decoder = getattr(model, "decoder", model)  # fusion models wrap a TransformerDecoder
        output = model.output if hasattr(model, "output") else getattr(decoder, "output", None)
        output_weight(output)  # refuses unsupported layers now rather than at the first step
        if hasattr(model, "skip_output_layer"):  # torchtune main
            model.skip_output_layer = True
        elif isinstance(decoder, TransformerDecoder):  # torchtune 0.6.x
            decoder.unembed = types.MethodType(_unembed_hidden, decoder)
        else:
            raise TypeError(f"model: expected a torchtune TransformerDecoder (or a model with `skip_output_layer` "
                            f"or a `decoder`), got {type(model).__name__}")
        self.__dict__["output_layer"] = output

    def forward(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy over the non-ignored ``targets``; ``outputs`` are hidden states ``[..., d]``."""
        if self.output_layer is None:
            raise RuntimeError("LinearCrossEntropyLoss: call loss.set_model_output(model) before the first forward "
                               "(torchtune 0.6.x recipes do not; see vpce.integrations.torchtune)")
        if isinstance(outputs, (list, tuple)):
            raise TypeError("outputs: expected the hidden-state tensor, got a list: the model was set up for "
                            "CEWithChunkedOutputLoss (set_num_output_chunks); call loss.set_model_output(model)")
        weight, _ = output_weight(self.output_layer)
        if isinstance(weight, DTensor):
            raise ValueError("model.output: expected a plain weight tensor, got a DTensor (FSDP or tensor "
                             "parallel); vpce would take its shards for a vocab split of the same tokens")
        if outputs.shape[-1] != weight.shape[1]:
            raise ValueError(f"outputs: expected hidden states [..., {weight.shape[1]}], got {tuple(outputs.shape)}; "
                             f"does the model still apply its output layer? (loss.set_model_output(model))")
        hidden, weight, bias = output_linear(self.output_layer, outputs)
        return vpce.linear_cross_entropy(hidden, weight, targets, bias, ignore_index=self.ignore_index,
                                         reduction="mean", **self.options)

    def extra_repr(self) -> str:
        options = "".join(f", {k}={v!r}" for k, v in self.options.items())
        output = "not set (call set_model_output)" if self.output_layer is None else type(self.output_layer).__name__
        return f"ignore_index={self.ignore_index}{options}, output_layer={output}"

    # The rest of main's SFTLoss protocol, defined here for 0.6.x too. Tensor parallelism is refused above.
    @property
    def tp_requires_loss_parallel_ctx_manager(self) -> bool:
        return False

    def patch_tp_plan(self, tp_plan: dict) -> dict:
        return tp_plan

    def apply_compile_strategy(self, *args, **kwargs):
        """``torch.compile`` the forward; vpce's loss is a ``torch.library`` op and traces as one node."""
        self.forward = torch.compile(self.forward, *args, **kwargs)
        return self
