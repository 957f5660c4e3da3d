"""``torch.library`` registration: the cross-entropy as opaque custom ops, for ``torch.compile`` and CUDA graphs.

Under ``torch.compile`` the public API routes single-process calls through two ops instead of the autograd
Function of ``vpce.autograd``:

* ``vpce::linear_cross_entropy`` runs the backend's ``cross_entropy`` and returns the loss together with what
  backward needs: the fast route's fp32 ``dX``, ``dW``, ``db`` (scaled in backward by plain, traceable tensor
  ops), or the lean route's per-token statistics; plus the ``mean`` denominator;
* ``vpce::linear_cross_entropy_backward`` runs the lean route's recompute (``vpce.autograd.cross_entropy_grads``).

They call the same plain functions as the eager path, so the compiled result is the eager one. Fake
implementations give the output shapes from the same route decision (``vpce.routing``), and
``torch.library.register_autograd`` ties them together. Neither op syncs with the host, so a step that uses them
can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .autograd import accumulation_dtype, backend_module, cross_entropy_grads
from .formulas import RowStats
from .options import BUDGET_NAMES, LossOptions
from .parallel import VocabShard
from .routing import Call, plan_cross_entropy, settle
from .targets import TokenTargets

__all__ = ["linear_cross_entropy"]


def _call(backend, ignore_index, reduction, label_smoothing, z_loss, softcap, memory_budget, vocab_size,
          logit_scale, needs, hidden, weight) -> tuple[LossOptions, Call]:
    budget = memory_budget if memory_budget in BUDGET_NAMES else float(memory_budget)
    opts = LossOptions(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                       z_loss=z_loss, softcap=softcap, memory_budget=budget, logit_scale=logit_scale)
    # the compiled graph's outputs must not depend on free memory: "auto" is the fast route here
    plan = settle(plan_cross_entropy(opts, tuple(needs), backend, False, False), True)
    return opts, Call(VocabShard(None, 0, 1, 0, weight.shape[0], vocab_size), plan, tuple(needs))


@torch.library.custom_op("vpce::linear_cross_entropy", mutates_args=())
def _forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor, token_weight: Optional[Tensor],
             class_weight: Optional[Tensor], backend: str, ignore_index: int, reduction: str,
             label_smoothing: float, z_loss: float, softcap: Optional[float], memory_budget: str, vocab_size: int,
             logit_scale: float, needs: list[bool]
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    opts, call = _call(backend, ignore_index, reduction, label_smoothing, z_loss, softcap, memory_budget,
                       vocab_size, logit_scale, needs, hidden, weight)
    tg = TokenTargets(target, call.shard, opts.ignore_index, token_weight, class_weight)
    loss_tok, rows, fast = backend_module(backend).cross_entropy(hidden, weight, bias, tg, opts, call)
    empty = lambda: hidden.new_empty(0, dtype=accumulation_dtype(hidden.dtype))  # noqa: E731 - fresh per output
    rows = rows if rows is not None else (empty(), empty(), empty())
    grads = fast if fast is not None else (None, None, None)
    return (tg.reduce(loss_tok, opts.reduction), tg.denominator(loss_tok.dtype), *rows,
            *(empty() if g is None else g for g in grads))


@_forward.register_fake
def _(hidden, weight, bias, target, token_weight, class_weight, backend, ignore_index, reduction, label_smoothing,
      z_loss, softcap, memory_budget, vocab_size, logit_scale, needs):
    _, call = _call(backend, ignore_index, reduction, label_smoothing, z_loss, softcap, memory_budget, vocab_size,
                    logit_scale, needs, hidden, weight)
    fast, lean = call.plan.route == "fast", call.plan.route == "lean"
    n, d = hidden.shape
    v = min(weight.shape[0], vocab_size)
    new = lambda *shape: hidden.new_empty(shape, dtype=accumulation_dtype(hidden.dtype))  # noqa: E731
    loss = new(n) if reduction == "none" else new()
    per_token = [new(n) if lean else new(0) for _ in range(3)]
    return (loss, new(), *per_token, new(n, d) if fast and needs[0] else new(0),
            new(v, d) if fast and needs[1] else new(0), new(v) if fast and needs[2] and bias is not None else new(0))


@torch.library.custom_op("vpce::linear_cross_entropy_backward", mutates_args=())
def _recompute_backward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], target: Tensor,
                        token_weight: Optional[Tensor], class_weight: Optional[Tensor], m: Tensor, log_s: Tensor,
                        q: Tensor, denominator: Tensor, grad: Tensor, backend: str, ignore_index: int, reduction: str,
                        label_smoothing: float, z_loss: float, softcap: Optional[float], memory_budget: str,
                        vocab_size: int, logit_scale: float, needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    opts, call = _call(backend, ignore_index, reduction, label_smoothing, z_loss, softcap, memory_budget,
                       vocab_size, logit_scale, needs, hidden, weight)
    dx, dw, db = cross_entropy_grads(hidden, weight, bias, target, token_weight, RowStats(m, log_s, q), grad,
                                     denominator, opts, call, class_weight=class_weight)
    empty = lambda: hidden.new_empty(0)  # noqa: E731
    return (empty() if dx is None else dx, empty() if dw is None else dw, empty() if db is None else db)


@_recompute_backward.register_fake
def _(hidden, weight, bias, target, token_weight, class_weight, m, log_s, q, denominator, grad, backend, ignore_index,
      reduction, label_smoothing, z_loss, softcap, memory_budget, vocab_size, logit_scale, needs):
    like = lambda t, need: torch.empty_like(t) if need and t is not None else hidden.new_empty(0)  # noqa: E731
    return like(hidden, needs[0]), like(weight, needs[1]), like(bias, needs[2])


_ARGS = slice(6, None)  # the op's non-tensor arguments (and the needs list)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, target, token_weight, class_weight = inputs[:6]
    loss, denominator, m, log_s, q, dx, dw, db = output
    _, call = _call(*inputs[_ARGS], hidden, weight)
    ctx.args = inputs[_ARGS]
    ctx.fast = call.plan.route == "fast"
    ctx.reduction, ctx.needs = inputs[8], inputs[-1]
    ctx.dtype, ctx.rows = hidden.dtype, weight.shape[0]
    if ctx.fast:
        ctx.save_for_backward(denominator, dx, dw, db)
    else:
        ctx.save_for_backward(hidden, weight, bias, target, token_weight, class_weight, m, log_s, q, denominator)


def _backward(ctx, grad_loss, *_unused):
    nones = (None,) * (len(ctx.args) + 3)  # target, token_weight, class_weight and the options
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
                         vocab_size: int, needs: tuple[bool, bool, bool], class_weight=None) -> Tensor:
    """The loss through the registered op (2-D hidden, 1-D target, single process)."""
    budget = opts.memory_budget if isinstance(opts.memory_budget, str) else repr(opts.memory_budget)
    out = torch.ops.vpce.linear_cross_entropy(hidden, weight, bias, target, token_weight, class_weight, backend,
                                              opts.ignore_index, opts.reduction, opts.label_smoothing, opts.z_loss,
                                              opts.softcap, budget, vocab_size, opts.logit_scale, list(needs))
    return out[0]
