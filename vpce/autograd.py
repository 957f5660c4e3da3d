"""The autograd shells: one ``torch.autograd.Function`` per public loss, the same for both backends.

Each is a thin wrapper over the chosen backend's plain functions (``vpce.backends.pytorch`` or ``vpce.backends.triton``:
``cross_entropy``, ``log_probs``, ``recompute_grads``, ``scale_cast``; for the distillation ``distill_forward``,
``distill_recompute_grads``), chosen in one place (``backend_module``), and the shared formulas
(``vpce.formulas.softmax``, ``vpce.formulas.distill``): forward runs the backend and keeps what backward needs; backward
either finishes the fast route's held gradients (``vpce.backends.grads.finish_fast_grads``), recomputes them (the lean
route), or finishes the speculative route's unit-scale gradients for a per-token upstream gradient
(``vpce.speculation``; ``backends.triton.speculative_grads``; a second backward there recomputes, as the lean route). A
call eligible for the speculative route reports to its ``Call.history`` whether its upstream gradient was uniform,
whichever route it took. The ``torch.library`` ops (``vpce.library``) call the same functions.

Under ``torch.autocast`` each Function gets the caller's fp32 weight and bias and casts them to hidden's dtype in
its forward (``computed_operands``); the gradients go back in each input's own dtype (``ctx.dtypes``), the fast and
speculative routes' dW and db as their fp32 accumulators.
"""

from __future__ import annotations

import torch

from .backends.grads import finish_fast_grads
from .double_backward import refuse_double_backward
from .formulas.distill import DistillRows
from .formulas.softmax import (RowStats, ce_coefficients, evaluate_loss_fn, logprob_coefficients, logprob_extras,
                       logprob_outputs, logprob_part_outputs, loss_fn_coefficients, loss_fn_metric_outputs,
                       store_metric_outputs)
from .options import DistillOptions, LogProbLossOptions, LogProbOptions, LossOptions
from .prepare import compute_operands
from .routing import Call
from .speculation import split_upstream
from .targets import ClassWeights, TokenTargets

__all__ = ["backend_module", "LinearCrossEntropyFunction", "LinearLogProbsFunction", "LinearDistillationFunction",
           "LogProbLossFunction", "cross_entropy_grads"]


def backend_module(name: str):
    """The backend's module: ``vpce.backends.triton`` or ``vpce.backends.pytorch`` (imported on first use: the
    Triton backend loads Triton; ``kernels.launch.start`` gives a cold process's first compiles a head start)."""
    if name == "triton":
        from .backends import triton as triton_backend
        from .kernels import launch
        launch.start()
        return triton_backend
    from .backends import pytorch as torch_backend
    return torch_backend


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def computed_operands(ctx, hidden, weight, bias):
    """In a Function's forward: the weight and bias in hidden's dtype, the compute dtype (where autocast casts fp32
    parameters, cast here, where autograd records no cast: ``vpce.prepare.compute_operands``); ``ctx.dtypes``: the
    dtypes the gradients go back in, each input's own ``(dX, dW, db)``."""
    ctx.dtypes = tuple(hidden.dtype if t is None else t.dtype for t in (hidden, weight, bias))
    return compute_operands(hidden.dtype, weight, bias)


def report_uniform(call: Call, g: torch.Tensor | None, keep: torch.Tensor, g_other: torch.Tensor | None = None):
    """Tell an eligible call's history (``vpce.speculation``) whether its per-token upstream gradient ``g`` (None:
    not used, zeros) was uniform over the non-ignored tokens ``keep``; never where a second output (the entropy)
    got a gradient ``g_other``, which the speculative route does not form in forward."""
    if call.history is None:
        return
    if g_other is not None:
        call.history.report(torch.zeros((), dtype=torch.bool, device=keep.device))
        return
    if g is None or g.numel() == 0:
        call.history.report(torch.ones((), dtype=torch.bool, device=keep.device))
        return
    call.history.report(split_upstream(g, keep)[0])


def cross_entropy_grads(hidden, weight, bias, target, token_weight, rows: RowStats, grad: torch.Tensor,
                        denominator: torch.Tensor, opts: LossOptions, call: Call, main_weight=None,
                        class_weight=None, scaling=None):
    """The lean route's backward: per-token row scales from the upstream gradient, then the recompute.
    ``class_weight``: forward's ``ClassWeights`` (or, in one process, the raw ``[V_local]`` weights);
    ``scaling``: the forward's per-token factor (``token_scaling``), or None."""
    g = grad.detach().to(rows.m.dtype)
    if opts.reduction == "mean":
        g = g / denominator
    tg = TokenTargets(target, call.shard, opts.ignore_index, token_weight, class_weight)
    g = g.expand(hidden.shape[0]) if g.dim() == 0 else g.reshape(-1)
    report_uniform(call, g, tg.keep)
    scale = tg.row_scale(g if scaling is None else g * scaling)
    coef = ce_coefficients(scale, rows.lse, opts, call.shard.vocab_size, tg.class_rows(slice(None)))
    return backend_module(call.plan.backend).recompute_grads(hidden, weight, bias, tg, rows, coef, call,
                                                             main_weight)



class LinearCrossEntropyFunction(torch.autograd.Function):
    """``hidden [N, D]`` (this rank's slice under sequence parallelism when the backend reduces dX in forward),
    ``target [N]``, optional ``token_weight [N]`` and ``class_weight [V_local]`` (fp32/fp64, no grad); returns the
    fp32 (fp64) loss per ``opts.reduction``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, token_weight, opts: LossOptions, call: Call, class_weight=None):
        ctx.main_weight = weight if call.main_grad else None  # (never cast: refused under autocast)
        weight, bias = computed_operands(ctx, hidden, weight, bias)
        tg = TokenTargets(target, call.shard, opts.ignore_index, token_weight, class_weight)
        loss_tok, rows, fast = backend_module(call.plan.backend).cross_entropy(hidden, weight, bias, tg, opts, call)
        ctx.opts, ctx.call, ctx.fast = opts, call, fast  # fast: None after its one use
        ctx.denominator = tg.denominator(loss_tok.dtype)
        ctx.rows = weight.shape[0]
        if rows is not None:
            cw = tg.class_weight if tg.class_weight is not None else (None,) * len(ClassWeights._fields)
            ctx.save_for_backward(hidden, weight, bias, target, token_weight, *rows, tg.scaling, *cw)
        loss = tg.reduce(loss_tok, opts.reduction)
        if not opts.metrics:
            return loss
        metrics = [tg.reduce_metric(tg.metrics[k], opts.reduction) for k in opts.metrics]
        ctx.mark_non_differentiable(*metrics)
        return (loss, *metrics)

    @staticmethod
    def backward(ctx, grad, *_metrics):  # the metrics are detached: their gradients are ignored
        refuse_double_backward("linear_cross_entropy")
        with torch.autocast(grad.device.type, enabled=False):  # (a backward called inside an autocast region)
            return LinearCrossEntropyFunction._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        none = (None,) * 5
        route, call, opts = ctx.call.plan.route, ctx.call, ctx.opts
        if route != "fast":
            hidden, weight, bias, target, token_weight, *saved = ctx.saved_tensors
            k = len(RowStats._fields)
            rows, scaling, cw = RowStats(*saved[:k]), saved[k], saved[k + 1:]
            cw = None if cw[0] is None else ClassWeights(*cw)
            if route == "speculative" and ctx.fast is not None:
                grads, ctx.fast = ctx.fast, None
                tg = TokenTargets(target, call.shard, opts.ignore_index, token_weight, cw)
                g = grad.detach().to(rows.m.dtype).reshape(-1)  # reduction="none": one per token
                lse, vocab, class_rows = rows.lse, call.shard.vocab_size, tg.class_rows(slice(None))

                def coefficients(r):
                    return ce_coefficients(tg.row_scale(r if scaling is None else r * scaling), lse, opts, vocab,
                                           class_rows)

                *out, uniform = backend_module(call.plan.backend).speculative_grads(
                    grads, hidden, weight, bias, tg, rows, g, coefficients, call, ctx.main_weight, ctx.dtypes)
                if call.history is not None:
                    call.history.report(uniform)
                return (*out, *none)
            # the lean route, or a second backward of the speculative one (its held gradients are used up)
            return (*cross_entropy_grads(hidden, weight, bias, target, token_weight, rows, grad,
                                         ctx.denominator, opts, call, ctx.main_weight, cw, scaling), *none)
        if ctx.fast is None:
            raise RuntimeError("vpce: this loss formed its gradients in forward and they were already used by a "
                               "first backward; for a second backward through the same loss compute it with "
                               "memory_budget='lean' (through vpce.nn: memory_budget='lean', or "
                               "options=LinearCrossEntropyOptions(allow_retain_graph=True)), or recompute the loss")
        g = grad.detach().to(ctx.denominator.dtype)
        grads, ctx.fast = ctx.fast, None
        if ctx.opts.reduction == "mean" and not grads.mean_folded:
            g = g / ctx.denominator
        scale_cast = backend_module(ctx.call.plan.backend).scale_cast
        return (*finish_fast_grads(grads, g, ctx.dtypes, ctx.rows, ctx.main_weight, scale_cast), *none)


class LinearLogProbsFunction(torch.autograd.Function):
    """Per-token ``log p(target)`` (and entropy) of ``softmax(cap(x) / T)``; ignored tokens give 0 for both.
    The lean route (forward keeps the statistics; backward recomputes), or the speculative route (the gradients of
    ``log p_t`` formed in forward at unit scale; ``vpce.speculation``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, lp: LogProbOptions, call: Call):
        weight, bias = computed_operands(ctx, hidden, weight, bias)
        tg = TokenTargets(target, call.shard, lp.ignore_index)
        backend = backend_module(call.plan.backend)
        ctx.fast = None
        if call.plan.route == "speculative":
            st, _, ctx.fast = backend.log_probs_formed(hidden, weight, bias, tg, lp, call)
        else:
            st = backend.log_probs(hidden, weight, bias, tg, lp, call)
        logp, ent = logprob_outputs(tg, st, lp.entropy)
        if any(call.needs_grad):
            centred = st.expectations[0] - st.m if lp.entropy else None
            ctx.save_for_backward(hidden, weight, bias, target, st.m, st.log_s, st.q, centred)
        ctx.lp, ctx.call = lp, call
        ctx.set_materialize_grads(False)  # an output used only for logging gets no zero-filled gradient
        extras = logprob_extras(tg, st, lp, call.shard.vocab_size)
        ctx.mark_non_differentiable(*extras)
        if not lp.entropy and not extras:
            return logp
        return (logp, *([ent] if lp.entropy else []), *extras)

    @staticmethod
    def backward(ctx, g_logp, *rest):
        refuse_double_backward("linear_log_probs")
        g_ent = rest[0] if ctx.lp.entropy else None  # (the extras after it are detached)
        with torch.autocast(ctx.saved_tensors[0].device.type, enabled=False):
            return LinearLogProbsFunction._backward(ctx, g_logp, g_ent)

    @staticmethod
    def _backward(ctx, g_logp, g_ent):
        hidden, weight, bias, target, m, log_s, q, centred = ctx.saved_tensors
        lp, call = ctx.lp, ctx.call
        tg = TokenTargets(target, call.shard, lp.ignore_index)
        g = None if g_logp is None else g_logp.detach().to(m.dtype).reshape(-1)
        grads, ctx.fast = ctx.fast, None
        if grads is not None and g_ent is None:  # the speculative route, its guess that the entropy is only logged
            dx, dw, db, uniform = backend_module(call.plan.backend).speculative_grads(
                grads, hidden, weight, bias, tg, RowStats(m, log_s, q), torch.zeros_like(m) if g is None else g,
                lambda r: logprob_coefficients(tg, r, None, None, call.plan.folded.inv_t, like=m), call,
                None, ctx.dtypes)
            if call.history is not None:
                call.history.report(uniform)
            return dx, dw, db, None, None, None
        # the lean route, a second backward, or an entropy with a gradient (known on the host: the speculative
        # route's held gradients are dropped, and the call site learns it)
        report_uniform(call, g, tg.keep, g_ent)
        coef = logprob_coefficients(tg, g_logp, g_ent, centred, call.plan.folded.inv_t, like=m)
        grads = backend_module(call.plan.backend).recompute_grads(hidden, weight, bias, tg, RowStats(m, log_s, q),
                                                                  coef, call)
        return (*grads, None, None, None)


class LinearDistillationFunction(torch.autograd.Function):
    """Student ``hidden [N, D_s]``, ``weight``, ``bias``; teacher ``t_hidden [N, D_t]``, ``t_weight``, ``t_bias``
    (detached: no gradient); ``target [N]``; ``token_weight [N]`` or None. Returns the loss per ``o.reduction``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight, o: DistillOptions,
                call: Call):
        weight, bias = computed_operands(ctx, hidden, weight, bias)  # (the teacher's: cast by vpce.distill)
        tg = TokenTargets(target, call.shard, o.ignore_index, token_weight)
        forward = backend_module(call.plan.backend).distill_forward
        loss_tok, rows, fast = forward(hidden, weight, bias, t_hidden, t_weight, t_bias, tg, o, call)
        ctx.o, ctx.call, ctx.fast = o, call, fast  # fast: None after its one use
        ctx.denominator = tg.denominator(loss_tok.dtype)
        ctx.rows = weight.shape[0]
        if rows is not None:
            ctx.save_for_backward(hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight, *rows)
        return tg.reduce(loss_tok, o.reduction)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("linear_distillation_loss")
        with torch.autocast(grad.device.type, enabled=False):
            return LinearDistillationFunction._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        none = (None,) * 7
        o, call = ctx.o, ctx.call
        g = grad.detach().to(ctx.denominator.dtype)
        if o.reduction == "mean":
            g = g / ctx.denominator
        if call.plan.route != "fast":
            hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight, *rows = ctx.saved_tensors
            tg = TokenTargets(target, call.shard, o.ignore_index, token_weight)
            scale = tg.row_scale(g.expand(hidden.shape[0]) if g.dim() == 0 else g.reshape(-1))
            recompute = backend_module(call.plan.backend).distill_recompute_grads
            return (*recompute(hidden, weight, bias, t_hidden, t_weight, t_bias, tg, DistillRows(*rows), scale, o,
                               call), *none)
        if ctx.fast is None:
            raise RuntimeError("vpce: this loss formed its gradients in forward and they were already used by a "
                               "first backward; for a second backward through the same loss compute it with "
                               "memory_budget='lean', or recompute the loss")
        grads, ctx.fast = ctx.fast, None
        scale_cast = backend_module(call.plan.backend).scale_cast
        return (*finish_fast_grads(grads, g, ctx.dtypes, ctx.rows, None, scale_cast), *none)


class LogProbLossFunction(torch.autograd.Function):
    """``sum(loss_fn(log_probs, entropy, **inputs))`` (``vpce.post_training``) with its gradients formed in forward;
    backward scales them by the upstream scalar. The fast route: the backend's chunk loop evaluates ``loss_fn`` per
    chunk (``backends.triton.log_prob_loss``). Otherwise two passes, both in forward: the statistics of every token
    (the backend's ``log_probs``), ``loss_fn`` on all of them, then the gradients recomputed (``recompute_grads``).
    Also returns the detached per-token ``log_probs`` and ``entropy`` (zeros unless computed), and ``is_top1`` and
    ``mean_logits`` (``o.top1``, ``o.mean_logits``; empty unless asked)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, o: LogProbLossOptions, call: Call, inputs: dict):
        weight, bias = computed_operands(ctx, hidden, weight, bias)
        tg = TokenTargets(target, call.shard, o.ignore_index)
        backend = backend_module(call.plan.backend)
        if call.plan.route == "fast":
            loss, logp, ent, grads, metrics = backend.log_prob_loss(hidden, weight, bias, tg, o, call, inputs)
        else:
            st = backend.log_probs(hidden, weight, bias, tg, o.stats_options(), call)
            everything = slice(None)
            logp, ent = logprob_part_outputs(tg, st, everything, o.entropy_stats)
            metrics = loss_fn_metric_outputs(o, hidden.shape[0], hidden.device)
            store_metric_outputs(metrics, tg, st, everything, call.shard.vocab_size)
            ev = evaluate_loss_fn(o, logp, ent if o.entropy else None, tg.keep, inputs, everything)
            loss, grads = ev.value, None
            if any(call.needs_grad):
                coef = loss_fn_coefficients(tg, everything, ev, st, call.plan.folded.inv_t)
                grads = backend.recompute_grads(hidden, weight, bias, tg, RowStats.of(st), coef, call)
        ctx.grads, ctx.rows = grads, weight.shape[0]
        ctx.fast, ctx.backend = call.plan.route == "fast", call.plan.backend
        ent = torch.zeros_like(logp) if ent is None else ent
        top1 = metrics.get("is_top1", logp.new_zeros(0, dtype=torch.bool))
        mean_logits = metrics.get("mean_logits", logp.new_zeros(0))
        ctx.mark_non_differentiable(logp, ent, top1, mean_logits)
        return loss, logp, ent, top1, mean_logits

    @staticmethod
    def backward(ctx, g_loss, *_):
        refuse_double_backward("linear_log_prob_loss")
        grads, ctx.grads = ctx.grads, None
        if grads is None:
            raise RuntimeError("vpce.linear_log_prob_loss: a second backward through the same graph is not supported "
                               "(its gradients are formed in forward and handed out once)")
        none = (None, None, None, None)
        if g_loss is None:
            return (None, None, None, *none)
        if ctx.fast:
            g = g_loss.detach().to(torch.float32)
            return (*finish_fast_grads(grads, g, ctx.dtypes, ctx.rows, None, backend_module(ctx.backend).scale_cast),
                    *none)
        g = g_loss.detach()
        scale = lambda t, dtype: None if t is None else (t * g.to(t.dtype)).to(dtype)  # noqa: E731
        return (*(scale(t, dtype) for t, dtype in zip(grads, ctx.dtypes)), *none)
