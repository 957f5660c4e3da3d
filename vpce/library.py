"""``torch.library`` registration: the cross-entropy and the distillation loss as opaque custom ops, for
``torch.compile`` and CUDA graphs.

Under ``torch.compile`` the public API routes single-process calls through two ops instead of the autograd
Function of ``vpce.autograd``:

* ``vpce::linear_cross_entropy`` runs the backend's ``cross_entropy`` and returns the loss together with what
  backward needs: the fast route's fp32 ``dX``, ``dW``, ``db`` (scaled in backward by plain, traceable tensor
  ops), or the lean route's per-token statistics; plus the ``mean`` denominator;
* ``vpce::linear_cross_entropy_backward`` runs the lean route's recompute (``vpce.autograd.cross_entropy_grads``).

``vpce::linear_distillation_loss`` and ``vpce::linear_distillation_loss_backward`` do the same for
``linear_distillation_loss`` (``vpce.distill``, ``vpce.distill_stats``; the lean route's ``DistillRows`` as eight
per-token tensors).
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
from .distill_stats import DistillRows
from .formulas import RowStats
from .options import BUDGET_NAMES, DistillOptions, LossOptions
from .parallel import VocabShard
from .routing import Call, plan_cross_entropy, plan_distillation, settle, size_cross_entropy, size_distillation
from .targets import TokenTargets

__all__ = ["linear_cross_entropy"]


def _call(backend, ignore_index, reduction, label_smoothing, z_loss, softcap, memory_budget, vocab_size,
          logit_scale, needs, hidden, weight) -> tuple[LossOptions, Call]:
    budget = memory_budget if memory_budget in BUDGET_NAMES else float(memory_budget)
    opts = LossOptions(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                       z_loss=z_loss, softcap=softcap, memory_budget=budget, logit_scale=logit_scale)
    # the compiled graph's outputs must not depend on free memory: "auto" is the fast route here
    plan = settle(plan_cross_entropy(opts, tuple(needs), backend, False, False), True)
    shard = VocabShard(None, 0, 1, 0, weight.shape[0], vocab_size)
    return opts, Call(shard, size_cross_entropy(plan, opts, shard, hidden.shape[-1], hidden.dtype), tuple(needs))


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
    grads = fast.summed() if fast is not None else (None, None, None)
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


def _scale_held(ctx, grad_loss):
    """The fast route's held fp32 ``dX``, ``dW``, ``db`` times the upstream gradient (over the denominator for
    ``mean``), in the inputs' dtype, ``dW``/``db`` padded to the weight's rows."""
    denominator, dx, dw, db = ctx.saved_tensors
    g = grad_loss / denominator if ctx.reduction == "mean" else grad_loss
    pad = lambda t: F.pad(t, (0, 0) * (t.dim() - 1) + (0, ctx.rows - t.shape[0]))  # noqa: E731
    return (dx * g).to(ctx.dtype), pad((dw * g).to(ctx.dtype)), pad((db * g).to(ctx.dtype))


def _backward(ctx, grad_loss, *_unused):
    nones = (None,) * (len(ctx.args) + 3)  # target, token_weight, class_weight and the options
    if not ctx.fast:
        dx, dw, db = torch.ops.vpce.linear_cross_entropy_backward(*ctx.saved_tensors, grad_loss, *ctx.args)
    else:
        dx, dw, db = _scale_held(ctx, grad_loss)
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


# ------------------------------------------------------------------------------------------------------------
# the distillation loss (``vpce.distill``): the same two-op scheme, both backends


def _distill_call(backend, kind, beta, inv_t, kd_scale, ce_weight, ignore_index, reduction, softcap,
                  teacher_softcap, memory_budget, vocab_size, needs, hidden, weight):
    budget = memory_budget if memory_budget in BUDGET_NAMES else float(memory_budget)
    o = DistillOptions(kind=kind, beta=beta, inv_t=inv_t, kd_scale=kd_scale, ce_weight=ce_weight,
                       ignore_index=ignore_index, reduction=reduction, softcap=softcap,
                       teacher_softcap=teacher_softcap, memory_budget=budget)
    plan = plan_distillation(reduction, budget == "lean", tuple(needs), backend, False, False)
    shard = VocabShard(None, 0, 1, 0, weight.shape[0], vocab_size)
    return o, Call(shard, size_distillation(plan, o, shard, hidden.shape[-1], hidden.dtype), tuple(needs))


def _distill_rows(o, rows):
    """``DistillRows`` from the op's eight row tensors (the ones the options do not use are empty)."""
    m_z, log_s_z, m_y, log_s_y, e, m1, log_s1, q1 = rows
    ce = o.ce_weight > 0
    return DistillRows(m_z, log_s_z, m_y, log_s_y, e if o.extra else None, *((m1, log_s1, q1) if ce else
                                                                            (None,) * 3))


@torch.library.custom_op("vpce::linear_distillation_loss", mutates_args=())
def _distill_forward(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], t_hidden: Tensor, t_weight: Tensor,
                     t_bias: Optional[Tensor], target: Tensor, token_weight: Optional[Tensor], backend: str, kind: str,
                     beta: float, inv_t: float, kd_scale: float, ce_weight: float, ignore_index: int,
                     reduction: str, softcap: Optional[float], teacher_softcap: Optional[float], memory_budget: str,
                     vocab_size: int, needs: list[bool]) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                  Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
                                                                  Tensor]:
    """(loss, the ``mean`` denominator, the lean route's eight ``DistillRows`` tensors, the fast route's
    ``dX``, ``dW``, ``db``); what a route does not produce is an empty tensor."""
    o, call = _distill_call(backend, kind, beta, inv_t, kd_scale, ce_weight, ignore_index, reduction, softcap,
                            teacher_softcap, memory_budget, vocab_size, needs, hidden, weight)
    tg = TokenTargets(target, call.shard, o.ignore_index, token_weight)
    loss_tok, rows, fast = backend_module(backend).distill_forward(hidden, weight, bias, t_hidden, t_weight, t_bias,
                                                                   tg, o, call)
    empty = lambda: hidden.new_empty(0, dtype=accumulation_dtype(hidden.dtype))  # noqa: E731 - fresh per output
    rows = tuple(empty() if r is None else r for r in rows) if rows is not None else tuple(empty() for _ in range(8))
    grads = fast.summed() if fast is not None else (None, None, None)
    return (tg.reduce(loss_tok, o.reduction), tg.denominator(loss_tok.dtype), *rows,
            *(empty() if g is None else g for g in grads))


@_distill_forward.register_fake
def _(hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight, backend, kind, beta, inv_t, kd_scale,
      ce_weight, ignore_index, reduction, softcap, teacher_softcap, memory_budget, vocab_size, needs):
    _, call = _distill_call(backend, kind, beta, inv_t, kd_scale, ce_weight, ignore_index, reduction, softcap,
                            teacher_softcap, memory_budget, vocab_size, needs, hidden, weight)
    fast, lean = call.plan.route == "fast", call.plan.route == "lean"
    n, d = hidden.shape
    v = min(weight.shape[0], vocab_size)
    new = lambda *shape: hidden.new_empty(shape, dtype=accumulation_dtype(hidden.dtype))  # noqa: E731
    present = (True,) * 4 + (kind != "forward_kl",) + (ce_weight > 0,) * 3
    rows = [new(n) if lean and p else new(0) for p in present]
    return (new(n) if reduction == "none" else new(), new(), *rows, new(n, d) if fast and needs[0] else new(0),
            new(v, d) if fast and needs[1] else new(0), new(v) if fast and needs[2] and bias is not None else new(0))


@torch.library.custom_op("vpce::linear_distillation_loss_backward", mutates_args=())
def _distill_recompute(hidden: Tensor, weight: Tensor, bias: Optional[Tensor], t_hidden: Tensor, t_weight: Tensor,
                       t_bias: Optional[Tensor], target: Tensor, token_weight: Optional[Tensor], m_z: Tensor,
                       log_s_z: Tensor, m_y: Tensor, log_s_y: Tensor, e: Tensor, m1: Tensor, log_s1: Tensor,
                       q1: Tensor, denominator: Tensor, grad: Tensor, backend: str, kind: str, beta: float,
                       inv_t: float, kd_scale: float, ce_weight: float, ignore_index: int, reduction: str,
                       softcap: Optional[float], teacher_softcap: Optional[float], memory_budget: str,
                       vocab_size: int, needs: list[bool]) -> tuple[Tensor, Tensor, Tensor]:
    o, call = _distill_call(backend, kind, beta, inv_t, kd_scale, ce_weight, ignore_index, reduction, softcap,
                            teacher_softcap, memory_budget, vocab_size, needs, hidden, weight)
    g = grad.detach().to(denominator.dtype)
    if reduction == "mean":
        g = g / denominator
    tg = TokenTargets(target, call.shard, o.ignore_index, token_weight)
    scale = tg.row_scale(g.expand(hidden.shape[0]) if g.dim() == 0 else g.reshape(-1))
    rows = _distill_rows(o, (m_z, log_s_z, m_y, log_s_y, e, m1, log_s1, q1))
    dx, dw, db = backend_module(backend).distill_recompute_grads(hidden, weight, bias, t_hidden, t_weight, t_bias,
                                                                 tg, rows, scale, o, call)
    empty = lambda: hidden.new_empty(0)  # noqa: E731
    return (empty() if dx is None else dx, empty() if dw is None else dw, empty() if db is None else db)


@_distill_recompute.register_fake
def _(hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight, m_z, log_s_z, m_y, log_s_y, e, m1,
      log_s1, q1, denominator, grad, backend, kind, beta, inv_t, kd_scale, ce_weight, ignore_index, reduction,
      softcap, teacher_softcap, memory_budget, vocab_size, needs):
    like = lambda t, need: torch.empty_like(t) if need and t is not None else hidden.new_empty(0)  # noqa: E731
    return like(hidden, needs[0]), like(weight, needs[1]), like(bias, needs[2])


_DISTILL_ARGS = slice(8, None)  # the op's non-tensor arguments (and the needs list)


def _distill_setup_context(ctx, inputs, output):
    loss, denominator, *rest = output
    rows, (dx, dw, db) = rest[:8], rest[8:]
    weight = inputs[1]
    _, call = _distill_call(*inputs[_DISTILL_ARGS], inputs[0], weight)
    ctx.args = inputs[_DISTILL_ARGS]
    ctx.fast = call.plan.route == "fast"
    ctx.reduction, ctx.needs = inputs[15], inputs[-1]
    ctx.dtype, ctx.rows = inputs[0].dtype, weight.shape[0]
    if ctx.fast:
        ctx.save_for_backward(denominator, dx, dw, db)
    else:
        ctx.save_for_backward(*inputs[:8], *rows, denominator)


def _distill_backward(ctx, grad_loss, *_unused):
    nones = (None,) * (5 + len(ctx.args))  # the teacher's tensors, target, token_weight and the options
    if not ctx.fast:
        dx, dw, db = torch.ops.vpce.linear_distillation_loss_backward(*ctx.saved_tensors, grad_loss, *ctx.args)
    else:
        dx, dw, db = _scale_held(ctx, grad_loss)
    needs = ctx.needs
    return (dx if needs[0] else None, dw if needs[1] else None, db if needs[2] else None) + nones


torch.library.register_autograd("vpce::linear_distillation_loss", _distill_backward,
                                setup_context=_distill_setup_context)


def linear_distillation_loss(hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight, backend: str,
                             o, vocab_size: int, needs: tuple[bool, bool, bool]) -> Tensor:
    """The distillation loss through the registered op (2-D hidden states, 1-D target, single process; ``o``: the
    ``DistillOptions``)."""
    budget = o.memory_budget if isinstance(o.memory_budget, str) else repr(o.memory_budget)
    out = torch.ops.vpce.linear_distillation_loss(hidden, weight, bias, t_hidden, t_weight, t_bias, target,
                                                  token_weight, backend, o.kind, o.beta, o.inv_t, o.kd_scale,
                                                  o.ce_weight, o.ignore_index, o.reduction, o.softcap,
                                                  o.teacher_softcap, budget, vocab_size, list(needs))
    return out[0]
