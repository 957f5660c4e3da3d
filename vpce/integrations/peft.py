"""PEFT: a ``PeftModel``'s causal LM, and an ``lm_head`` that PEFT wrapped, as one linear map for vpce's loss.

vpce's loss takes ``hidden [N, K]`` and ``weight [V, K]`` (plus a bias) and never forms ``hidden @ weight.T``.
A LoRA adapter on ``lm_head`` adds ``s * (dropout(x) @ A.T) @ B.T`` to the base output ``x @ W.T + b``. That sum is
one linear map of a wider input, exactly::

    x @ W.T + b + s * (dropout(x) @ A.T) @ B.T  ==  [x, u] @ [W, s * B].T + b,     u = dropout(x) @ A.T   # [N, r]

so ``head_linear`` hands vpce ``hidden = cat(x, u)`` (``D + r`` columns) and ``weight = cat(W, s * B)``, built
once per forward from the parameters as they are. Autograd carries the gradient of that weight back to ``W`` (only
if ``W.requires_grad``: a frozen base stays without a gradient) and to ``B``, and the gradient of ``hidden`` back
to ``x`` and through ``u`` to ``A``. The dropout mask is drawn by the adapter's own dropout module on ``x``, where
and when PEFT's forward draws it, so a training step sees the same mask as the unpatched PEFT model: LoRA dropout
on ``lm_head`` stays exact. Folding ``s * B @ A`` into ``W`` instead would be exact only without dropout.

DoRA (``use_dora=True``) scales each output row by ``c = m / ||W + s * B @ A||`` (the norm detached, as PEFT
does). Without dropout (or in eval mode) that is ``[x, u] @ [c * W, c * s * B].T``; with dropout PEFT applies the
magnitude term to the dropped input, which takes a third block: ``[x, x_d, u] @ [W, (c - 1) * W, c * s * B].T``
with ``x_d = dropout(x)`` (``2D + r`` columns). ``lora_bias=True`` adds ``s * b_B`` (DoRA: ``c * s * b_B``) to the
bias. Several active adapters add one block each. A merged or disabled adapter is the base layer itself.

``ModulesToSaveWrapper`` (``modules_to_save=["lm_head"]``) is read through its active module's ``weight`` and
``bias``. Refused with a ``TypeError`` that names the reason: other LoRA variants, ``fan_in_fan_out``, a quantized
base weight (QLoRA quantizes the transformer blocks; transformers' bitsandbytes path keeps ``lm_head`` in 16 bits,
which works here), mixed-adapter batches (``adapter_names=``), and other PEFT wrappers of the head (trainable
tokens). ``vpce.integrations.transformers`` checks the result against the head's real output on one position at the
first forward, so a head this module misdescribes is refused there rather than mis-computed.

Cost: the weight vpce differentiates is the whole ``[V, D + r]`` block, so the gradient of the frozen ``W``
columns is computed and dropped (the work of fine-tuning ``lm_head`` fully, plus one copy of ``W`` per forward);
the ``[tokens, vocab]`` logits are still never formed. LoRA elsewhere in the model (attention, MLP) costs nothing.
"""

from __future__ import annotations

import torch

try:
    import peft
    from peft.tuners.lora import LoraLayer
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
except ImportError as err:  # pragma: no cover - exercised only without peft
    raise ImportError("vpce.integrations.peft needs the `peft` package: pip install peft (vpce's `peft` extra)") \
        from err

__all__ = ["is_peft_model", "is_peft_head", "base_model", "check_head", "head_linear"]


def is_peft_model(obj) -> bool:
    """Whether ``obj`` is a ``peft.PeftModel`` (any task type)."""
    return isinstance(obj, peft.PeftModel)


def is_peft_head(module) -> bool:
    """Whether ``module`` is a layer PEFT put in place of a model's own (an adapter layer or a wrapper)."""
    return isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper))


def base_model(model):
    """The transformers model inside a ``PeftModel`` (``get_base_model()``); ``model`` itself otherwise."""
    return model.get_base_model() if is_peft_model(model) else model


def _variant(head, name: str):
    variants = getattr(head, "lora_variant", {})
    return variants.get(name) if isinstance(variants, dict) else None


def check_head(head, where: str = "model.lm_head") -> None:
    """Refuse, naming the reason, a PEFT-wrapped head ``head_linear`` cannot describe exactly."""
    kind = type(head).__name__
    if isinstance(head, ModulesToSaveWrapper):
        for module in [head.original_module, *head.modules_to_save.values()]:
            if type(module) is not torch.nn.Linear:
                raise TypeError(f"{where}: expected modules_to_save copies that are torch.nn.Linear, got "
                                f"{type(module).__name__}")
        return
    if not isinstance(head, LoraLayer) or not hasattr(head, "lora_A"):
        raise TypeError(f"{where}: expected a torch.nn.Linear, a PEFT LoRA linear layer or PEFT's "
                        f"ModulesToSaveWrapper, got {kind}")
    base = head.get_base_layer()
    if not isinstance(base, torch.nn.Linear) or not base.weight.is_floating_point() or base.weight.dim() != 2:
        raise TypeError(f"{where}: expected a LoRA layer over a torch.nn.Linear with a floating-point weight, got "
                        f"{kind} over {type(base).__name__} (weight {getattr(base.weight, 'dtype', None)}); a "
                        f"quantized lm_head has no weight vpce can read: keep lm_head unquantized (transformers' "
                        f"bitsandbytes path does so unless llm_int8_skip_modules leaves it out)")
    if getattr(head, "fan_in_fan_out", False):
        raise TypeError(f"{where}: expected fan_in_fan_out=False (a torch.nn.Linear head), got True")
    for name in head.lora_A:
        variant = _variant(head, name)
        if getattr(head, "use_dora", {}).get(name) and type(variant).__name__ != "DoraLinearVariant":
            raise TypeError(f"{where}: expected PEFT >= 0.16 for DoRA (its lora_variant table), got peft "
                            f"{peft.__version__} with adapter {name!r} using DoRA")
        if variant is not None and type(variant).__name__ != "DoraLinearVariant":
            raise TypeError(f"{where}: expected plain LoRA or DoRA adapters, got the {type(variant).__name__} "
                            f"variant for adapter {name!r}; vpce cannot reproduce its output as one linear map")


def head_linear(head, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(hidden, weight, bias)`` with ``F.linear(hidden, weight, bias) == head(x)`` up to rounding, computed as
    ``head``'s forward would be now (adapters active, dropout drawn in training mode). See the module docstring."""
    if isinstance(head, ModulesToSaveWrapper):
        return x, head.weight, head.bias  # PEFT resolves both to the module its forward runs
    check_head(head)
    base = head.get_base_layer()
    weight, bias = base.weight, base.bias
    if head.disable_adapters or head.merged:
        return x, weight, bias
    inputs, weights = [x], [weight]
    for name in head.active_adapters:
        if name not in head.lora_A:
            continue
        lora_a, lora_b = head.lora_A[name], head.lora_B[name]
        dropout, scale = head.lora_dropout[name], head.scaling[name]
        xa = x if not getattr(head, "cast_input_dtype_enabled", True) else x.to(lora_a.weight.dtype)
        if _variant(head, name) is None:  # plain LoRA
            inputs.append(lora_a(dropout(xa)))
            weights.append(scale * lora_b.weight)
            if lora_b.bias is not None:
                bias = scale * lora_b.bias if bias is None else bias + scale * lora_b.bias
            continue
        # DoRA: the row scale c = m / ||W + s * B @ A|| (detached norm), B @ A taken as PEFT takes it
        dora = head.lora_magnitude_vector[name]
        eye = torch.eye(lora_a.weight.shape[1], device=lora_a.weight.device, dtype=xa.dtype)
        lora_weight = lora_b(lora_a(eye)).T
        base_w = weight.to(xa.dtype)
        c = dora.weight / dora.get_weight_norm(base_w, lora_weight.detach(), scale).detach()
        if isinstance(dropout, torch.nn.Identity) or not head.training:
            weights[0] = weights[0] + (c - 1).unsqueeze(1) * base_w
            u = lora_a(xa)
        else:
            xd = dropout(xa)
            inputs.append(xd)
            weights.append((c - 1).unsqueeze(1) * base_w)
            u = lora_a(xd)
        inputs.append(u)
        weights.append((c * scale).unsqueeze(1) * lora_b.weight)
        if lora_b.bias is not None:
            bias = c * scale * lora_b.bias if bias is None else bias + c * scale * lora_b.bias
    if len(inputs) == 1:
        return x, weights[0], bias
    dtype = x.dtype  # the head's output dtype (PEFT casts the adapters' sum back to it)
    hidden = torch.cat([t.to(dtype) for t in inputs], dim=-1)
    return hidden, torch.cat([w.to(dtype) for w in weights], dim=1), None if bias is None else bias.to(dtype)
