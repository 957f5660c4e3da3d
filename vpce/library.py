"""``torch.library`` registration: the cross-entropy and the distillation loss as opaque custom ops, for
``torch.compile`` and CUDA graphs.

Under ``torch.compile`` the public API routes single-process calls through two ops per loss instead of the
autograd Functions of ``vpce.autograd``, registered from one scheme (``_Scheme``, ``_register``):

* ``vpce::<loss>`` runs the backend's forward and returns the loss together with what backward needs: the fast
  route's fp32 ``dX``, ``dW``, ``db`` (scaled in backward by plain, traceable tensor ops), or the lean route's
  per-token rows; plus the ``mean`` denominator;
* ``vpce::<loss>_backward`` runs the lean route's recompute.

The losses: ``linear_cross_entropy`` (``vpce.autograd.cross_entropy_grads`` recomputes; ``RowStats`` as three
per-token tensors) and ``linear_distillation_loss`` (``vpce.distill``, ``vpce.formulas.distill``; the lean route's
``DistillRows`` as eight per-token tensors). They call the same plain functions as the eager path, so the compiled
result is the eager one. Fake implementations give the output shapes from the same route decision
(``vpce.routing``), and ``torch.library.register_autograd`` ties each pair together. Neither op syncs with the
host, so a step that uses them can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from .autograd import accumulation_dtype, backend_module, cross_entropy_grads
from .formulas.distill import DistillRows
from .formulas.softmax import RowStats
from .options import BUDGET_NAMES, DistillOptions, LossOptions
from .parallel import VocabShard
from .routing import Call, plan_compiled_cross_entropy, plan_compiled_distillation
from .targets import TokenTargets

__all__ = ["linear_cross_entropy", "linear_distillation_loss"]


@dataclass(frozen=True)
class _Scheme:
    """One loss as two custom ops (``vpce::<name>`` and ``vpce::<name>_backward``) and their autograd."""

    name: str
    tensors: str
    """The schema of the ops' tensor inputs (the first two are the hidden states and the weight)."""
    rows: tuple[str, ...]
    """The names of the lean route's per-token tensors."""
    options: str
    """The schema of the ops' other inputs, ending with ``bool[] needs``."""
    call: Callable
    """``call(*options, hidden, weight) -> (loss options, Call)``."""
    forward: Callable
    """``forward(tensors, opts, call) -> (per-token loss, TokenTargets, rows or None, FastGrads or None)``."""
    recompute: Callable
    """``recompute(tensors, rows, denominator, grad, opts, call) -> (dX, dW, dB)``, any of them None."""
    present: Callable
    """``present(opts)``: which of the rows the options produce."""


def _scale_held(ctx, grad_loss):
    """The fast route's held fp32 ``dX``, ``dW``, ``db`` times the upstream gradient (over the denominator for
    ``mean``), in the inputs' dtype, ``dW``/``db`` padded to the weight's rows."""
    denominator, dx, dw, db = ctx.saved_tensors
    g = grad_loss / denominator if ctx.reduction == "mean" else grad_loss
    pad = lambda t: F.pad(t, (0, 0) * (t.dim() - 1) + (0, ctx.rows - t.shape[0]))  # noqa: E731
    return (dx * g).to(ctx.dtype), pad((dw * g).to(ctx.dtype)), pad((db * g).to(ctx.dtype))


def _register(s: _Scheme):
    """The scheme's two ops, their fake implementations and their autograd."""
    n_t, n_r = s.tensors.count("Tensor"), len(s.rows)
    rows = ", ".join(f"Tensor {r}" for r in s.rows)

    def forward(*args):
        tensors = args[:n_t]
        hidden = tensors[0]
        opts, call = s.call(*args[n_t:], hidden, tensors[1])
        loss_tok, tg, kept, fast = s.forward(tensors, opts, call)
        empty = lambda: hidden.new_empty(0, dtype=accumulation_dtype(hidden.dtype))  # noqa: E731 - fresh per output
        kept = (None,) * n_r if kept is None else kept
        grads = fast.summed() if fast is not None else (None, None, None)
        return (tg.reduce(loss_tok, opts.reduction), tg.denominator(loss_tok.dtype),
                *(empty() if r is None else r for r in kept), *(empty() if g is None else g for g in grads))

    op = torch.library.custom_op(f"vpce::{s.name}", forward, mutates_args=(), schema=(
        f"({s.tensors}, {s.options}) -> ({', '.join(['Tensor'] * (2 + n_r + 3))})"))

    @op.register_fake
    def _(*args):
        hidden, weight, bias = args[:3]
        opts, call = s.call(*args[n_t:], hidden, weight)
        fast, lean = call.plan.route == "fast", call.plan.route == "lean"
        needs = args[-1]
        n, d = hidden.shape
        v = min(weight.shape[0], call.shard.vocab_size)
        new = lambda *shape: hidden.new_empty(shape, dtype=accumulation_dtype(hidden.dtype))  # noqa: E731
        per_token = [new(n) if lean and p else new(0) for p in s.present(opts)]
        return (new(n) if opts.reduction == "none" else new(), new(), *per_token,
                new(n, d) if fast and needs[0] else new(0), new(v, d) if fast and needs[1] else new(0),
                new(v) if fast and needs[2] and bias is not None else new(0))

    def backward_op(*args):
        tensors, kept, (denominator, grad) = args[:n_t], args[n_t:n_t + n_r], args[n_t + n_r:n_t + n_r + 2]
        hidden = tensors[0]
        opts, call = s.call(*args[n_t + n_r + 2:], hidden, tensors[1])
        dx, dw, db = s.recompute(tensors, kept, denominator, grad, opts, call)
        empty = lambda: hidden.new_empty(0)  # noqa: E731
        return (empty() if dx is None else dx, empty() if dw is None else dw, empty() if db is None else db)

    back = torch.library.custom_op(f"vpce::{s.name}_backward", backward_op, mutates_args=(), schema=(
        f"({s.tensors}, {rows}, Tensor denominator, Tensor grad, {s.options}) -> (Tensor, Tensor, Tensor)"))

    @back.register_fake
    def _(*args):
        hidden, weight, bias, needs = args[0], args[1], args[2], args[-1]
        like = lambda t, need: torch.empty_like(t) if need and t is not None else hidden.new_empty(0)  # noqa: E731
        return like(hidden, needs[0]), like(weight, needs[1]), like(bias, needs[2])

    def setup_context(ctx, inputs, output):
        tensors, opt_args = inputs[:n_t], inputs[n_t:]
        denominator, kept, (dx, dw, db) = output[1], output[2:2 + n_r], output[2 + n_r:]
        opts, call = s.call(*opt_args, tensors[0], tensors[1])
        ctx.args = opt_args
        ctx.fast = call.plan.route == "fast"
        ctx.reduction, ctx.needs = opts.reduction, opt_args[-1]
        ctx.dtype, ctx.rows = tensors[0].dtype, tensors[1].shape[0]
        if ctx.fast:
            ctx.save_for_backward(denominator, dx, dw, db)
        else:
            ctx.save_for_backward(*tensors, *kept, denominator)

    def backward(ctx, grad_loss, *_unused):
        nones = (None,) * (n_t - 3 + len(ctx.args))  # the tensors after the bias, and the options
        if not ctx.fast:
            dx, dw, db = getattr(torch.ops.vpce, f"{s.name}_backward")(*ctx.saved_tensors, grad_loss, *ctx.args)
        else:
            dx, dw, db = _scale_held(ctx, grad_loss)
        needs = ctx.needs
        return (dx if needs[0] else None, dw if needs[1] else None, db if needs[2] else None) + nones

    torch.library.register_autograd(f"vpce::{s.name}", backward, setup_context=setup_context)


def _budget(memory_budget: str) -> str | float:
    return memory_budget if memory_budget in BUDGET_NAMES else float(memory_budget)


def _shard(weight, vocab_size: int) -> VocabShard:
    return VocabShard(None, 0, 1, 0, weight.shape[0], vocab_size)


# ------------------------------------------------------------------------------------------------------------
# the cross-entropy


def _ce_call(backend, ignore_index, reduction, label_smoothing, z_loss, softcap, memory_budget, vocab_size,
             logit_scale, needs, hidden, weight) -> tuple[LossOptions, Call]:
    opts = LossOptions(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                       z_loss=z_loss, softcap=softcap, memory_budget=_budget(memory_budget), logit_scale=logit_scale)
    shard = _shard(weight, vocab_size)
    plan = plan_compiled_cross_entropy(opts, tuple(needs), backend, shard, hidden.shape[-1], hidden.dtype,
                                       weight.dtype != hidden.dtype)  # (this op scales the held gradients: _scale_held)
    return opts, Call(shard, plan, tuple(needs))


def _ce_forward(tensors, opts: LossOptions, call: Call):
    hidden, weight, bias, target, token_weight, class_weight = tensors
    tg = TokenTargets(target, call.shard, opts.ignore_index, token_weight, class_weight)
    loss_tok, rows, fast = backend_module(call.plan.backend).cross_entropy(hidden, weight, bias, tg, opts, call)
    return loss_tok, tg, rows, fast


def _ce_recompute(tensors, rows, denominator, grad, opts: LossOptions, call: Call):
    hidden, weight, bias, target, token_weight, class_weight = tensors
    return cross_entropy_grads(hidden, weight, bias, target, token_weight, RowStats(*rows), grad, denominator, opts,
                               call, class_weight=class_weight)


_register(_Scheme(
    "linear_cross_entropy",
    "Tensor hidden, Tensor weight, Tensor? bias, Tensor target, Tensor? token_weight, Tensor? class_weight",
    ("m", "log_s", "q"),
    "str backend, SymInt ignore_index, str reduction, float label_smoothing, float z_loss, float? softcap, "
    "str memory_budget, SymInt vocab_size, float logit_scale, bool[] needs",
    _ce_call, _ce_forward, _ce_recompute, lambda opts: (True,) * 3))


def linear_cross_entropy(hidden, weight, bias, target, token_weight, backend: str, opts: LossOptions,
                         vocab_size: int, needs: tuple[bool, bool, bool], class_weight=None) -> Tensor:
    """The loss through the registered op (2-D hidden, 1-D target, single process)."""
    budget = opts.memory_budget if isinstance(opts.memory_budget, str) else repr(opts.memory_budget)
    out = torch.ops.vpce.linear_cross_entropy(hidden, weight, bias, target, token_weight, class_weight, backend,
                                              opts.ignore_index, opts.reduction, opts.label_smoothing, opts.z_loss,
                                              opts.softcap, budget, vocab_size, opts.logit_scale, list(needs))
    return out[0]


# ------------------------------------------------------------------------------------------------------------
# the distillation loss (``vpce.distill``)


def _distill_call(backend, kind, beta, temperature, kd_scale, ce_weight, ignore_index, reduction, softcap,
                  teacher_softcap, memory_budget, vocab_size, needs, hidden, weight):
    budget = _budget(memory_budget)
    o = DistillOptions(kind=kind, beta=beta, temperature=temperature, kd_scale=kd_scale, ce_weight=ce_weight,
                       ignore_index=ignore_index, reduction=reduction, softcap=softcap,
                       teacher_softcap=teacher_softcap, memory_budget=budget)
    shard = _shard(weight, vocab_size)
    return o, Call(shard, plan_compiled_distillation(o, tuple(needs), backend, shard, hidden.shape[-1], hidden.dtype),
                   tuple(needs))


def _distill_present(o: DistillOptions) -> tuple[bool, ...]:
    """Which of ``DistillRows``' eight tensors the options use."""
    return (True,) * 4 + (o.extra,) + (o.ce_weight > 0,) * 3


def _distill_forward(tensors, o: DistillOptions, call: Call):
    hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight = tensors
    tg = TokenTargets(target, call.shard, o.ignore_index, token_weight)
    loss_tok, rows, fast = backend_module(call.plan.backend).distill_forward(hidden, weight, bias, t_hidden, t_weight,
                                                                             t_bias, tg, o, call)
    return loss_tok, tg, rows, fast


def _distill_recompute(tensors, rows, denominator, grad, o: DistillOptions, call: Call):
    hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight = tensors
    g = grad.detach().to(denominator.dtype)
    if o.reduction == "mean":
        g = g / denominator
    tg = TokenTargets(target, call.shard, o.ignore_index, token_weight)
    scale = tg.row_scale(g.expand(hidden.shape[0]) if g.dim() == 0 else g.reshape(-1))
    rows = DistillRows(*(r if p else None for r, p in zip(rows, _distill_present(o))))  # the unused ones: empty
    return backend_module(call.plan.backend).distill_recompute_grads(hidden, weight, bias, t_hidden, t_weight, t_bias,
                                                                     tg, rows, scale, o, call)


_register(_Scheme(
    "linear_distillation_loss",
    "Tensor hidden, Tensor weight, Tensor? bias, Tensor t_hidden, Tensor t_weight, Tensor? t_bias, Tensor target, "
    "Tensor? token_weight",
    ("m_z", "log_s_z", "m_y", "log_s_y", "e", "m1", "log_s1", "q1"),
    "str backend, str kind, float beta, float temperature, float kd_scale, float ce_weight, SymInt ignore_index, "
    "str reduction, float? softcap, float? teacher_softcap, str memory_budget, SymInt vocab_size, bool[] needs",
    _distill_call, _distill_forward, _distill_recompute, _distill_present))


def linear_distillation_loss(hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight, backend: str,
                             o, vocab_size: int, needs: tuple[bool, bool, bool]) -> Tensor:
    """The distillation loss through the registered op (2-D hidden states, 1-D target, single process; ``o``: the
    ``DistillOptions``)."""
    budget = o.memory_budget if isinstance(o.memory_budget, str) else repr(o.memory_budget)
    out = torch.ops.vpce.linear_distillation_loss(hidden, weight, bias, t_hidden, t_weight, t_bias, target,
                                                  token_weight, backend, o.kind, o.beta, o.temperature, o.kd_scale,
                                                  o.ce_weight, o.ignore_index, o.reduction, o.softcap,
                                                  o.teacher_softcap, budget, vocab_size, list(needs))
    return out[0]
