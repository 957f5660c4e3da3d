"""Public API: ``linear_cross_entropy``, ``linear_log_probs`` and ``LinearCrossEntropy``.

This layer validates every argument (``ValueError``/``TypeError`` that name the argument, what was expected and
what was given), flattens ``[..., D]`` inputs to 2-D, decides the route once (``vpce.routing``), agrees with the
other ranks of ``group`` on the call and on where this rank's vocab shard sits (``vpce.parallel.agree``: under a
group an argument error on any rank makes every rank raise it), routes the hidden states through the group's
collectives, and calls the autograd shell (``vpce.autograd``) or, under ``torch.compile``, the registered op
(``vpce.library``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from .autograd import LinearCrossEntropyFunction, LinearLogProbsFunction, accumulation_dtype
from .backends.grads import check_main_grad
from .options import BACKENDS, METRICS, REDUCTIONS, LogProbOptions, LossOptions
from .prepare import (Entry, check_bool, check_class_weight, check_int, check_logit_scale, check_memory_budget,
                      check_number, check_token_weight, compute_operands, enter, prepare_call)
from .routing import Site, plan_cross_entropy, plan_log_probs, settle_by_memory, size_cross_entropy, size_log_probs

__all__ = ["linear_cross_entropy", "linear_log_probs", "LinearCrossEntropy", "CrossEntropyOutput"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True, kw_only=True)
class CrossEntropyArgs:
    """``linear_cross_entropy``'s per-token options as the caller gave them (the meanings: its docstring), not yet
    checked. ``validate`` checks them and freezes them into ``LossOptions``; the entry calls it inside
    ``prepare_call``, where under a group an error is exchanged and raised on every rank."""

    ignore_index: int = -100
    reduction: str = "mean"
    label_smoothing: float = 0.0
    z_loss: float = 0.0
    softcap: float | None = None
    memory_budget: str | float = "auto"
    logit_scale: float = 1.0
    token_scaling: bool = False
    return_z_loss: bool = False
    return_token_accuracy: bool = False
    return_entropy: bool = False

    def validate(self) -> LossOptions:
        """The checked options (``ValueError``/``TypeError`` naming the argument)."""
        for name in ("token_scaling", "return_z_loss", "return_token_accuracy", "return_entropy"):
            check_bool(name, getattr(self, name))
        asked = dict(zip(METRICS, (self.return_z_loss, self.return_token_accuracy, self.return_entropy)))
        check_int("ignore_index", self.ignore_index, allow_none=False)
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {self.reduction!r}")
        check_number("label_smoothing", self.label_smoothing, low=0.0, high=1.0)  # torch's range: 1.0 included
        check_number("z_loss", self.z_loss, low=0.0)
        check_number("softcap", self.softcap, low=0.0, low_open=True, allow_none=True)
        memory_budget = check_memory_budget(self.memory_budget)
        check_logit_scale(self.logit_scale)
        return LossOptions(ignore_index=int(self.ignore_index), reduction=self.reduction,
                           label_smoothing=float(self.label_smoothing), z_loss=float(self.z_loss),
                           softcap=None if self.softcap is None else float(self.softcap),
                           memory_budget=memory_budget, logit_scale=float(self.logit_scale),
                           token_scaling=self.token_scaling, metrics=tuple(k for k in METRICS if asked[k]))


class CrossEntropyOutput(NamedTuple):
    """What ``linear_cross_entropy`` returns when a metric is asked for (Liger's field names): the loss (with its
    gradient) and the detached metrics, reduced like the loss without ``token_weight``; None where not asked."""

    loss: torch.Tensor
    z_loss: torch.Tensor | None = None
    """The z-loss term ``z_loss * lse**2`` that is part of ``loss`` (0 with ``z_loss=0``)."""
    token_accuracy: torch.Tensor | None = None
    """1 where the target is the argmax of the logits (ties to the lowest global id, as ``torch.argmax``)."""
    entropy: torch.Tensor | None = None
    """The entropy of the softmax, ``lse - sum_j p_j z_j``."""


def linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, softcap=None, token_weight=None, group=None,
                         vocab_start=None, vocab_size=None, sequence_parallel=False, backend="auto",
                         memory_budget="auto", validate=False, accumulate_main_grad=False, logit_scale=1.0,
                         class_weight=None, token_scaling=False, return_z_loss=False, return_token_accuracy=False,
                         return_entropy=False):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target`` without materializing the logits.

    Args:
        hidden: ``[..., D]`` fp32/fp16/bf16 (fp64 on the torch backend).
        weight: ``[V_local, D]``, the whole lm_head or, under ``group``, this rank's contiguous shard of rows.
        target: ``[...]`` int64/int32 global vocab ids, hidden's leading shape (under ``sequence_parallel``: the
            full sequence); ``ignore_index`` marks tokens that count for nothing.
        bias: ``[V_local]`` or None.
        reduction: ``"mean"`` over non-ignored tokens (0 when there are none), ``"sum"``, or ``"none"``. With
            ``"none"`` (Triton backend, one process) a call site's first call recomputes the logits in backward
            (the lean route); a later call forms the gradients in forward, as ``"mean"`` does, when the previous
            backward's upstream gradient was the same on every non-ignored token (the speculative route; exact
            for any upstream gradient, no host sync; docs/api.md, "Caller-reduced outputs").
        label_smoothing: in [0, 1], torch's definition over the real global vocab.
        z_loss: adds ``z_loss * lse**2`` per token.
        softcap: logits become ``softcap * tanh(logits / softcap)`` (Gemma 2).
        token_weight: float, target's shape, no grad: scales each token's loss; ``mean`` divides by the weights'
            sum over non-ignored tokens.
        group: the process group the vocab is sharded over (None: not sharded). Every rank returns the same loss;
            the gradient of ``hidden`` is already summed over the group.
        vocab_start: global id of this shard's first row (default: rows of lower ranks). Passing it and
            ``vocab_size`` keeps a CUDA call free of host syncs.
        vocab_size: real vocab size; rows with global id >= it are padding (default: all rows).
        sequence_parallel: ``hidden`` is this rank's slice along dim 0 (Megatron SP); ``target`` is full.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"``.
        memory_budget: ``"fast"`` (gradients formed in forward), ``"lean"`` (recomputed in backward), ``"auto"``
            (fast where its buffers fit in free device memory, else lean; the same on every rank; see
            docs/api.md), or GiB of live chunk data on the fast route.
        validate: check target ids and the group's agreement eagerly on GPU too (a host sync), and that the hidden
            states are the same on every rank of ``group`` (without ``sequence_parallel``). On CPU the targets and
            the agreement are always checked; on GPU without it a bad target gives NaN for that token and a
            disagreement between ranks NaN everywhere.
        accumulate_main_grad: add the weight gradient in fp32 into ``weight.main_grad`` (Megatron).
        logit_scale: a finite number > 0 that multiplies the logits after the bias and before the soft cap
            (Cohere's ``logit_scale``; Granite's ``1 / logits_scaling``).
        class_weight: float ``[V_local]``, sharded like the weight rows (padding rows ignored), no grad: per-class
            weights with ``torch.nn.functional.cross_entropy(weight=...)``'s semantics, label smoothing included;
            ``mean`` divides by the sum of the target classes' weights over non-ignored tokens.
        token_scaling: multiply each token's loss and gradient by the detached probability of its target (DFT;
            TRL's ``loss_type="dft"``, Liger's ``use_token_scaling``); ``mean`` still divides by the token count.
        return_z_loss, return_token_accuracy, return_entropy: also return these detached metrics from the same
            pass (no extra collective), reduced like the loss but never weighted by ``token_weight``.

    Returns:
        The fp32 loss (fp64 for fp64 inputs): a scalar, or target's shape for ``reduction="none"``. With any
        ``return_*`` set, a ``CrossEntropyOutput(loss, z_loss, token_accuracy, entropy)`` with None where not
        asked. The full contract is docs/api.md in the source distribution.
    """
    args = CrossEntropyArgs(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                            z_loss=z_loss, softcap=softcap, memory_budget=memory_budget, logit_scale=logit_scale,
                            token_scaling=token_scaling, return_z_loss=return_z_loss,
                            return_token_accuracy=return_token_accuracy, return_entropy=return_entropy)
    entry = CrossEntropyEntry(args, target, token_weight, class_weight, accumulate_main_grad)
    return _cross_entropy(entry, hidden, weight, target, bias, group=group, vocab_start=vocab_start,
                          vocab_size=vocab_size, sequence_parallel=sequence_parallel, backend=backend,
                          validate=validate)


class CrossEntropyEntry(Entry):
    """``linear_cross_entropy`` (and ``LinearCrossEntropy``) in ``prepare_call``: ``options`` are its arguments,
    validated in ``checks``, or ``LossOptions`` validated already (the module)."""

    name = "ce"

    def __init__(self, options: CrossEntropyArgs | LossOptions, target, token_weight, class_weight,
                 accumulate_main_grad: bool):
        self.args = options
        self.opts = options if isinstance(options, LossOptions) else None
        self.target, self.token_weight, self.class_weight = target, token_weight, class_weight
        self.accumulate_main_grad = accumulate_main_grad
        self.ignore_index = options.ignore_index if isinstance(options.ignore_index, int) else -100
        self.weight = None

    def checks(self, w, cast_by_autocast):
        if self.opts is None:
            self.opts = self.args.validate()
        self.weight = w  # the caller's weight, before any autocast cast: the speculative route's call site
        check_token_weight(self.token_weight, self.target)
        check_class_weight(self.class_weight, w)
        check_bool("accumulate_main_grad", self.accumulate_main_grad)
        if self.accumulate_main_grad:
            check_main_grad(w)
            if cast_by_autocast:
                raise ValueError(f"accumulate_main_grad: expected a weight that torch.autocast leaves as it is, got "
                                 f"a {w.dtype} weight cast to {torch.get_autocast_dtype(w.device.type)}; keep the "
                                 f"lm_head weight in the compute dtype or call vpce outside the autocast region")

    def plan(self, needs, dtype, backend_name, sharded, sp):
        o = self.opts
        key = (o, self.token_weight is not None, self.class_weight is not None, self.accumulate_main_grad)
        return plan_cross_entropy(o, needs, backend_name, sharded, sp, Site("ce", self.weight, key))

    def memory(self, p, h, rows, needs, world):
        return settle_by_memory(p, h, rows, needs, self.opts, world, self.weight_cast, whole_ok=True)

    def size(self, plan, shard, d, dtype):
        return size_cross_entropy(plan, self.opts, shard, d, dtype, self.weight_cast)

    def fields(self):
        o = self.opts
        return [("reduction", o.reduction), ("ignore_index", o.ignore_index), ("label_smoothing", o.label_smoothing),
                ("z_loss", o.z_loss), ("softcap", o.softcap), ("memory_budget", o.memory_budget),
                ("token_weight", self.token_weight is not None),
                ("accumulate_main_grad", self.accumulate_main_grad), ("logit_scale", o.logit_scale),
                ("class_weight", self.class_weight is not None), ("token_scaling", o.token_scaling),
                *((f"return_{k}", k in o.metrics) for k in METRICS)]


def _cross_entropy(entry: CrossEntropyEntry, hidden, weight, target, bias, *, group, vocab_start, vocab_size,
                   sequence_parallel, backend, validate):
    h2, weight, bias, target, call = prepare_call(
        entry, hidden, weight, target, bias, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        sequence_parallel=sequence_parallel, backend=backend, validate=validate)
    opts, token_weight, class_weight = entry.opts, entry.token_weight, entry.class_weight
    accumulate_main_grad = entry.accumulate_main_grad
    t1 = target.reshape(-1)
    tw1 = None if token_weight is None else token_weight.reshape(-1).to(accumulation_dtype(h2.dtype))
    cw1 = None if class_weight is None else class_weight.to(accumulation_dtype(h2.dtype)).contiguous()
    if torch.compiler.is_compiling():
        if call.shard.sharded or accumulate_main_grad:
            raise NotImplementedError("vpce under torch.compile supports one process without "
                                      "accumulate_main_grad; call it outside the compiled region under a group")
        if opts.metrics or opts.token_scaling:
            raise NotImplementedError("vpce under torch.compile does not yet return metrics or apply "
                                      "token_scaling; call it outside the compiled region for those")
        from . import library
        with torch.autocast(h2.device.type, enabled=False):  # hidden is in the compute dtype; the parameters, cast:
            loss = library.linear_cross_entropy(h2, *compute_operands(h2.dtype, weight, bias), t1, tw1,
                                                call.plan.backend, opts, call.shard.vocab_size, call.needs_grad, cw1)
    else:
        call = dataclasses.replace(call, main_grad=accumulate_main_grad)
        with torch.autocast(h2.device.type, enabled=False):  # (the Function casts the parameters)
            loss = LinearCrossEntropyFunction.apply(enter(h2, call), weight, bias, t1, tw1, opts, call, cw1)
    shape = (lambda x: x.reshape(target.shape)) if opts.reduction == "none" else (lambda x: x)
    if not opts.metrics:
        return shape(loss)
    got = dict(zip(opts.metrics, (shape(x) for x in loss[1:])))
    return CrossEntropyOutput(shape(loss[0]), *(got.get(k) for k in METRICS))


def linear_log_probs(hidden, weight, target, bias=None, *, temperature=1.0, softcap=None, return_entropy=False,
                     ignore_index=-100, group=None, vocab_start=None, vocab_size=None, sequence_parallel=False,
                     backend="auto", validate=False, logit_scale=1.0, return_top1=False, return_mean_logits=False,
                     return_log_sum_sq_probs=False, memory_budget="auto"):
    """Per-token ``log p(target)`` under ``softmax(softcap(logit_scale * (hidden @ weight.T + bias)) /
    temperature)``, and with
    ``return_entropy=True`` also the entropy of that distribution, without materializing the logits.

    Args:
        hidden, weight, target, bias, group, vocab_start, vocab_size, sequence_parallel, backend, validate: as in
            ``linear_cross_entropy``.
        temperature: > 0; divides the (capped) logits.
        softcap: logits become ``softcap * tanh(logits / softcap)`` before the temperature.
        return_entropy: also return the entropy.
        ignore_index: targets equal to it give 0 for every output.
        logit_scale: a finite number > 0 that multiplies the logits before the soft cap and the temperature.
        return_top1: also return whether the target is the argmax (bool; ties go to the lowest global id, as
            ``torch.argmax``); TRL's ``is_top1``.
        return_mean_logits: also return the mean of the (capped, tempered) logits over the real vocab.
        return_log_sum_sq_probs: also return ``log sum_j p_j^2``.
        memory_budget: ``"auto"`` (default), ``"fast"``, ``"lean"`` or GiB, as for ``linear_cross_entropy``: whether
            the speculative route may hold the fast route's buffers (``"lean"``: never; ``"auto"``: where they fit
            in free device memory; a number: the size of its logits chunk).

    Speculative route (Triton backend, one process): the first call of a call site (this weight, these options)
    recomputes the logits in backward (the lean route); a later call forms the gradients in forward, as
    ``reduction="mean"`` does, when the previous backward's upstream gradient on ``log_probs`` was the same on every
    non-ignored token (``.sum()``, ``.mean()``, SFT's masked mean) and the entropy, if returned, got none (logged
    only, as trainers do). Backward is exact for any upstream gradients on either route, with no host sync
    (docs/api.md, "Caller-reduced outputs"). A frozen weight (only dX needed) takes the speculative route from the
    first call.

    Returns:
        ``log_probs`` alone, or, when anything else is asked, the tuple of the fields asked for in the order
        ``(log_probs, entropy, is_top1, mean_logits, log_sum_sq_probs)``; each of target's shape, fp32 (fp64 for
        fp64 inputs on the torch backend; ``is_top1`` bool). Gradients are exact for any upstream gradients on
        ``log_probs`` and ``entropy``, sharded or not (the building block for PPO/GRPO-style losses); the last
        three are detached.
    """
    entry = LogProbsEntry(LogProbsArgs(ignore_index=ignore_index, temperature=temperature, softcap=softcap,
                                       return_entropy=return_entropy, logit_scale=logit_scale, return_top1=return_top1,
                                       return_mean_logits=return_mean_logits,
                                       return_log_sum_sq_probs=return_log_sum_sq_probs, memory_budget=memory_budget))
    h2, weight, bias, target, call = prepare_call(
        entry, hidden, weight, target, bias, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        sequence_parallel=sequence_parallel, backend=backend, validate=validate)
    lp = entry.lp
    with torch.autocast(h2.device.type, enabled=False):  # (the Function casts the parameters)
        out = LinearLogProbsFunction.apply(enter(h2, call), weight, bias, target.reshape(-1), lp, call)
    if isinstance(out, tuple):
        return tuple(x.reshape(target.shape) for x in out)
    return out.reshape(target.shape)


@dataclass(frozen=True, kw_only=True)
class LogProbsArgs:
    """``linear_log_probs``' per-token options as the caller gave them (the meanings: its docstring), not yet
    checked; ``validate`` freezes them into ``LogProbOptions`` (as ``CrossEntropyArgs``)."""

    ignore_index: int = -100
    temperature: float = 1.0
    softcap: float | None = None
    return_entropy: bool = False
    logit_scale: float = 1.0
    return_top1: bool = False
    return_mean_logits: bool = False
    return_log_sum_sq_probs: bool = False
    memory_budget: str | float = "auto"

    def validate(self) -> LogProbOptions:
        """The checked options (``ValueError``/``TypeError`` naming the argument)."""
        budget = check_memory_budget(self.memory_budget)
        check_int("ignore_index", self.ignore_index, allow_none=False)
        check_number("temperature", self.temperature, low=0.0, low_open=True)
        check_number("softcap", self.softcap, low=0.0, low_open=True, allow_none=True)
        check_bool("return_entropy", self.return_entropy)
        check_logit_scale(self.logit_scale)
        check_bool("return_top1", self.return_top1)
        check_bool("return_mean_logits", self.return_mean_logits)
        check_bool("return_log_sum_sq_probs", self.return_log_sum_sq_probs)
        return LogProbOptions(ignore_index=int(self.ignore_index),
                              softcap=None if self.softcap is None else float(self.softcap),
                              logit_scale=float(self.logit_scale), temperature=float(self.temperature),
                              entropy=self.return_entropy, top1=self.return_top1,
                              mean_logits=self.return_mean_logits, log_sum_sq=self.return_log_sum_sq_probs,
                              memory_budget=budget)


class LogProbsEntry(Entry):
    """``linear_log_probs`` in ``prepare_call``: its arguments, validated in ``checks`` into ``lp``."""

    name = "logprob"

    def __init__(self, args: LogProbsArgs):
        self.args = args
        self.ignore_index = args.ignore_index if isinstance(args.ignore_index, int) else -100
        self.weight = self.lp = None

    def checks(self, w, _cast):
        self.weight = w  # the caller's weight, before any autocast cast: the speculative route's call site
        self.lp = self.args.validate()

    def fields(self):
        lp = self.lp
        return [("ignore_index", lp.ignore_index), ("temperature", lp.temperature), ("softcap", lp.softcap),
                ("return_entropy", lp.entropy), ("logit_scale", lp.logit_scale), ("return_top1", lp.top1),
                ("return_mean_logits", lp.mean_logits), ("return_log_sum_sq_probs", lp.log_sum_sq),
                ("memory_budget", lp.memory_budget)]

    def plan(self, needs, dtype, backend_name, sharded, sp):
        site = Site("logprob", self.weight, tuple(self.fields())) if self.lp.memory_budget != "lean" else None
        return plan_log_probs(needs, backend_name, sharded, sp, site, self.lp.folded)

    def memory(self, p, h, rows, needs, world):
        return settle_by_memory(p, h, rows, needs, self.lp.chunk_options(), world, self.weight_cast)

    def size(self, plan, shard, d, dtype):
        return size_log_probs(plan, self.lp, shard, d, dtype, self.weight_cast)


class LinearCrossEntropy(torch.nn.Module):
    """Module form of ``linear_cross_entropy``; options are validated once, at construction.

    ``forward(hidden, weight, target, bias=None, token_weight=None, class_weight=None)``; the weight is passed in
    (not owned) so that a tied or Megatron-owned lm_head weight can be used as is.
    """

    def __init__(self, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
                 group=None, vocab_start=None, vocab_size=None, sequence_parallel=False, backend="auto",
                 memory_budget="auto", validate=False, accumulate_main_grad=False, logit_scale=1.0,
                 token_scaling=False, return_z_loss=False, return_token_accuracy=False, return_entropy=False):
        super().__init__()
        self.options = CrossEntropyArgs(
            ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss,
            softcap=softcap, memory_budget=memory_budget, logit_scale=logit_scale, token_scaling=token_scaling,
            return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
            return_entropy=return_entropy).validate()
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        check_int("vocab_start", vocab_start, low=0)
        check_int("vocab_size", vocab_size, low=1)
        self.group, self.vocab_start, self.vocab_size = group, vocab_start, vocab_size
        self.sequence_parallel, self.backend, self.validate = sequence_parallel, backend, validate
        self.accumulate_main_grad = accumulate_main_grad

    def forward(self, hidden, weight, target, bias=None, token_weight=None, class_weight=None):
        entry = CrossEntropyEntry(self.options, target, token_weight, class_weight, self.accumulate_main_grad)
        return _cross_entropy(entry, hidden, weight, target, bias, group=self.group, vocab_start=self.vocab_start,
                              vocab_size=self.vocab_size, sequence_parallel=self.sequence_parallel,
                              backend=self.backend, validate=self.validate)

    def extra_repr(self) -> str:
        o = self.options
        return (f"reduction={o.reduction!r}, ignore_index={o.ignore_index}, label_smoothing={o.label_smoothing}, "
                f"z_loss={o.z_loss}, softcap={o.softcap}, logit_scale={o.logit_scale}, backend={self.backend!r}, "
                f"memory_budget={o.memory_budget!r}, sharded={self.group is not None}")
