"""``torch.library`` registration: the cross-entropy as opaque custom ops, for ``torch.compile`` and CUDA graphs.

Under ``torch.compile`` the public API routes single-process calls through two ops instead of calling the
backends' autograd Functions directly:

* ``vpce::linear_cross_entropy`` runs the backend's forward and returns the loss together with what backward
  needs: the fast route's fp32 ``dX``, ``dW``, ``db`` (scaled in backward by plain, traceable tensor ops), or
  the lean route's per-token ``lse``; plus the ``mean`` denominator;
* ``vpce::linear_cross_entropy_backward`` runs the lean route's recompute backward.

Both run the same backend code as the eager path (through ``_Ctx``, the part of an autograd ctx the backends
use), so the compiled result is the eager one. Fake implementations give the output shapes from the same route
decision (``fast_route``), and ``torch.library.register_autograd`` ties them together. Neither op syncs with the
host, so a step that uses them can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import torch_backend
from .options import BUDGET_NAMES, LossOptions
from .parallel import VocabShard

__all__ = ["linear_cross_entropy"]


def _backend(name: str):
    if name == "triton":
        from . import triton_backend
        return triton_backend.TritonLinearCrossEntropy, triton_backend.fast_route
    return torch_backend.TorchLinearCrossEntropy, torch_backend.fast_route


def _options(ignore_index, reduction, label_smoothing, z_loss, softcap, memory_budget) -> LossOptions:
    budget = memory_budget if memory_budget in BUDGET_NAMES else float(memory_budget)
    return LossOptions(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                       z_loss=z_loss, softcap=softcap, memory_budget=budget)


class _Ctx:
    """What the backends' autograd Functions use of their ctx."""

    def __init__(self, needs):
        self.needs_input_grad = tuple(needs) + (False,) * 6
        self.saved_tensors = ()

    def save_for_backward(self, *tensors):
        self.saved_tensors = tensors


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.custom_op("vpce::linear_cross_entropy", mutates_args=())
def _forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, token_weight: Optional[Tensor],
             backend: str, ignore_index: int, reduction: str, label_smoothing: float, z_loss: float,
             softcap: Optional[float], memory_budget: str, vocab_size: int, needs: list[bool]
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    fn, _ = _backend(backend)
    opts = _options(ignore_index, reduction, label_smoothing, z_loss, softcap, memory_budget)
    shard = VocabShard(None, 0, 1, 0, weight.shape[0], vocab_size)
    ctx = _Ctx(needs)
    loss = fn.forward(ctx, hidden, weight, bias, target, token_weight, shard, opts, tuple(needs), False)
    empty = lambda: hidden.new_empty(0, dtype=_acc(hidden.dtype))  # noqa: E731 - a fresh one per output
    grads = getattr(ctx, "grads", None) or [None, None, None]
    lse = ctx.saved_tensors[-1] if ctx.saved_tensors else empty()
    return (loss, ctx.denominator.clone(), lse, *(empty() if g is None else g for g in grads))


@_forward.register_fake
def _(hidden, weight, bias, target, token_weight, backend, ignore_index, reduction, label_smoothing, z_loss,
      softcap, memory_budget, vocab_size, needs):
    _, fast_route = _backend(backend)
    opts = _options(ignore_index, reduction, label_smoothing, z_loss, softcap, memory_budget)
    fast = fast_route(opts, needs, hidden.dtype)
    n, d = hidden.shape
    v = min(weight.shape[0], vocab_size)
    new = lambda *shape: hidden.new_empty(shape, dtype=_acc(hidden.dtype))  # noqa: E731
    loss = new(n) if reduction == "none" else new()
    lse = new(n) if any(needs) and not fast else new(0)
    return (loss, new(), lse, new(n, d) if fast and needs[0] else new(0), new(v, d) if fast and needs[1] else new(0),
            new(v) if fast and needs[2] and bias is not None else new(0))


@torch.library.custom_op("vpce::linear_cross_entropy_backward", mutates_args=())
def _recompute_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                        token_weight: Optional[Tensor], lse: Tensor, denominator: Tensor, grad: Tensor,
                        backend: str, ignore_index: int, reduction: str, label_smoothing: float, z_loss: float,
                        softcap: Optional[float], memory_budget: str, vocab_size: int, needs: list[bool]
                        ) -> tuple[Tensor, Tensor, Tensor]:
    fn, _ = _backend(backend)
    opts = _options(ignore_index, reduction, label_smoothing, z_loss, softcap, memory_budget)
    ctx = _Ctx(needs)
    ctx.saved_tensors = (hidden, weight, bias, target, token_weight, lse)
    ctx.shard = VocabShard(None, 0, 1, 0, weight.shape[0], vocab_size)
    ctx.opts, ctx.fast, ctx.eager, ctx.denominator = opts, False, False, denominator
    ctx.chunk = torch_backend.chunk_tokens(opts.chunk_gib(), ctx.shard, hidden.dtype, softcap is not None)
    ctx.like = (hidden.dtype, weight.shape[0])
    dx, dw, db, *_ = fn.backward(ctx, grad)
    empty = lambda: hidden.new_empty(0)  # noqa: E731
    return (empty() if dx is None else dx, empty() if dw is None else dw, empty() if db is None else db)


@_recompute_backward.register_fake
def _(hidden, weight, bias, target, token_weight, lse, denominator, grad, backend, ignore_index, reduction,
      label_smoothing, z_loss, softcap, memory_budget, vocab_size, needs):
    like = lambda t, need: torch.empty_like(t) if need and t is not None else hidden.new_empty(0)  # noqa: E731
    return like(hidden, needs[0]), like(weight, needs[1]), like(bias, needs[2])


_ARGS = slice(5, None)  # the op's non-tensor arguments (and the needs list)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, token_weight = inputs[:5]
    backend, _, reduction, *_ , needs = inputs[5:]
    loss, denominator, lse, dx, dw, db = output
    _, fast_route = _backend(backend)
    ctx.args = inputs[_ARGS]
    ctx.fast = fast_route(_options(*inputs[6:12]), needs, hidden.dtype)
    ctx.reduction, ctx.needs = reduction, needs
    ctx.dtype, ctx.rows = hidden.dtype, weight.shape[0]
    if ctx.fast:
        ctx.save_for_backward(denominator, dx, dw, db)
    else:
        ctx.save_for_backward(hidden, weight, bias, target, token_weight, lse, denominator)


def _backward(ctx, grad_loss, *_unused):
    nones = (None,) * (len(ctx.args) + 2)
    if not ctx.fast:
        dx, dw, db = torch.ops.vpce.linear_cross_entropy_backward(*ctx.saved_tensors, grad_loss, *ctx.args)
    else:
        denominator, dx, dw, db = ctx.saved_tensors
        g = grad_loss / denominator if ctx.reduction == "mean" else grad_loss
        pad = lambda t: F.pad(t, (0, 0) * (t.dim() - 1) + (0, ctx.rows - t.shape[0]))  # noqa: E731
        dx = (dx * g).to(ctx.dtype)
        dw, db = pad((dw * g).to(ctx.dtype)), pad((db * g).to(ctx.dtype))
    needs = ctx.needs
    return (dx if needs[0] else None, dw if needs[1] else None, db if needs[2] else None) + nones


torch.library.register_autograd("vpce::linear_cross_entropy", _backward, setup_context=_setup_context)


def linear_cross_entropy(hidden, weight, bias, target, token_weight, backend: str, opts: LossOptions,
                         vocab_size: int, needs: tuple[bool, bool, bool]) -> Tensor:
    """The loss through the registered op (2-D hidden, 1-D target, single process)."""
    budget = opts.memory_budget if isinstance(opts.memory_budget, str) else repr(opts.memory_budget)
    out = torch.ops.vpce.linear_cross_entropy(hidden, weight, bias, target, token_weight, backend, opts.ignore_index,
                                              opts.reduction, opts.label_smoothing, opts.z_loss, opts.softcap,
                                              budget, vocab_size, list(needs))
    return out[0]
