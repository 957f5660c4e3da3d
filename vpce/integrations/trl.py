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

__all__ = ["apply", "remove", "is_applied", "VpceLogProbHead", "OPTIONS"]

#: Keywords ``apply`` accepts.
OPTIONS = ("backend", "validate", "memory_budget", "group")
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

    def apply(self, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=("log_probs",)):
        unknown = sorted(set(outputs) - set(_OUTPUTS))
        if unknown:
            raise ValueError(f"outputs: expected fields among {_OUTPUTS}, got {unknown}")
        if logit_scale != 1.0:  # cap(s * (h W^T + b)) = cap((s h) W^T + s b)
            hidden = hidden * logit_scale
            bias = None if bias is None else bias * logit_scale
        device = hidden.device.type
        if not torch.is_autocast_enabled(device) and weight.dtype != hidden.dtype:
            # TRL casts the weight to the hidden states' dtype outside autocast (cast_lm_head_to_fp32)
            weight = weight.to(hidden.dtype)
            bias = None if bias is None else bias.to(hidden.dtype)
        shard = {}
        if self.group is not None:
            import torch.distributed as dist

            world, rank = dist.get_world_size(self.group), dist.get_rank(self.group)
            rows = math.ceil(weight.shape[0] / world)
            start = min(rank * rows, weight.shape[0])
            shard = dict(group=self.group, vocab_start=start, vocab_size=weight.shape[0])
            weight = weight[start:start + rows]
            bias = None if bias is None else bias[start:start + rows]
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
    """
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise TypeError(f"options: expected keywords among {OPTIONS}, got {unknown}")
    head = VpceLogProbHead(**options)
    _trl_utils()[0]._ChunkedLogProbFunction = head
    return head


def remove() -> None:
    """Restore TRL's own fused head. Harmless when not applied."""
    utils, original = _trl_utils()
    utils._ChunkedLogProbFunction = original


def is_applied() -> bool:
    """Whether TRL's fused heads currently run on vpce."""
    return isinstance(_trl_utils()[0]._ChunkedLogProbFunction, VpceLogProbHead)
