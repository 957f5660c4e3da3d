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
import math
import numbers
from typing import Callable, NamedTuple

import torch

from . import parallel, speculation
from .autograd import LinearCrossEntropyFunction, LinearLogProbsFunction, accumulation_dtype
from .grads import check_main_grad
from .options import BACKENDS, BUDGET_NAMES, METRICS, REDUCTIONS, LogProbOptions, LossOptions
from .parallel import CallFacts
from .routing import Call, Plan, plan_cross_entropy, plan_log_probs, resolve_backend, settle, settle_by_memory

__all__ = ["linear_cross_entropy", "linear_log_probs", "LinearCrossEntropy", "CrossEntropyOutput"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def check_number(name: str, value, *, low=None, low_open=False, high_open=None, allow_none=False, high=None):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name}: expected a real number, got {type(value).__name__} {value!r}")
    if value != value:
        raise ValueError(f"{name}: expected a number, got NaN")
    if low is not None and (value < low or (low_open and value == low)):
        raise ValueError(f"{name}: expected {'>' if low_open else '>='} {low}, got {value}")
    if high_open is not None and value >= high_open:
        raise ValueError(f"{name}: expected < {high_open}, got {value}")
    if high is not None and value > high:
        raise ValueError(f"{name}: expected <= {high}, got {value}")


def check_int(name: str, value, *, low=None, allow_none=True):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value}")


def check_bool(name: str, value):
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__}")


def check_memory_budget(value):
    """``"auto"``, ``"fast"``, ``"lean"``, or a number of GiB ``> 0`` (returned as a float)."""
    if isinstance(value, str):
        if value not in BUDGET_NAMES:
            raise ValueError(f"memory_budget: expected one of {BUDGET_NAMES} or a positive number of GiB, "
                             f"got {value!r}")
        return value
    check_number("memory_budget", value, low=0.0, low_open=True)
    return float(value)


def _check_logit_scale(value):
    """A finite number > 0: it multiplies the logits (a negative one would turn the ranking upside down, and 0
    would make every class equally likely whatever the inputs; negate or zero the weight for that)."""
    check_number("logit_scale", value, low=0.0, low_open=True)
    if math.isinf(value):
        raise ValueError(f"logit_scale: expected a finite number > 0, got {value}")


def make_options(*, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
                 memory_budget="auto", logit_scale=1.0, token_scaling=False, return_z_loss=False,
                 return_token_accuracy=False, return_entropy=False) -> LossOptions:
    """Validate the per-token options once and freeze them into ``LossOptions``."""
    for name, flag in (("token_scaling", token_scaling), ("return_z_loss", return_z_loss),
                       ("return_token_accuracy", return_token_accuracy), ("return_entropy", return_entropy)):
        check_bool(name, flag)
    asked = dict(zip(METRICS, (return_z_loss, return_token_accuracy, return_entropy)))
    check_int("ignore_index", ignore_index, allow_none=False)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    check_number("label_smoothing", label_smoothing, low=0.0, high=1.0)  # torch's range: 1.0 included
    check_number("z_loss", z_loss, low=0.0)
    check_number("softcap", softcap, low=0.0, low_open=True, allow_none=True)
    memory_budget = check_memory_budget(memory_budget)
    _check_logit_scale(logit_scale)
    return LossOptions(ignore_index=int(ignore_index), reduction=reduction,
                       label_smoothing=float(label_smoothing), z_loss=float(z_loss),
                       softcap=None if softcap is None else float(softcap), memory_budget=memory_budget,
                       logit_scale=float(logit_scale), token_scaling=token_scaling,
                       metrics=tuple(k for k in METRICS if asked[k]))


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


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensors(hidden, weight, target, bias, world: int, sequence_parallel: bool, backend: str):
    for name, t in (("hidden", hidden), ("weight", weight), ("target", target)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if bias is not None and not isinstance(bias, torch.Tensor):
        raise TypeError(f"bias: expected a torch.Tensor or None, got {type(bias).__name__}")
    floats = _FLOATS + ((torch.float64,) if backend == "torch" else ())
    if hidden.dtype not in floats:
        raise TypeError(f"hidden: expected dtype in {[str(f) for f in floats]} for backend {backend!r}, "
                        f"got {hidden.dtype}")
    if hidden.dim() < 1:
        raise ValueError("hidden: expected shape [..., D], got a 0-d tensor")
    if weight.dim() != 2:
        raise ValueError(f"weight: expected shape [V_local, D], got {tuple(weight.shape)}")
    if weight.shape[1] != hidden.shape[-1]:
        hint = ""
        if hidden.shape[-1] == weight.shape[0] != weight.shape[1]:
            hint = (f" (hidden's last dim {hidden.shape[-1]} is the vocab size: pass the hidden states that go into "
                    f"the lm_head, not its logits)")
        raise ValueError(f"weight: expected shape [V_local, {hidden.shape[-1]}] to match hidden's last dim, "
                         f"got {tuple(weight.shape)}{hint}")
    if weight.shape[0] == 0 and world == 1:
        raise ValueError("weight: expected at least one row, got shape " f"{tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"weight: expected dtype {hidden.dtype} (hidden's), got {weight.dtype}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if bias.dtype != hidden.dtype:
            raise TypeError(f"bias: expected dtype {hidden.dtype} (hidden's), got {bias.dtype}")
    if target.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"target: expected dtype torch.int64 or torch.int32, got {target.dtype}")
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != hidden.device:
            raise ValueError(f"{name}: expected device {hidden.device} (hidden's), got {t.device}")
    lead = tuple(hidden.shape[:-1])
    if sequence_parallel:
        if hidden.dim() < 2:
            raise ValueError(f"hidden: expected shape [S_local, ..., D] with sequence_parallel=True, "
                             f"got {tuple(hidden.shape)}")
        lead = (lead[0] * world,) + lead[1:]
    if tuple(target.shape) != lead:
        what = " (hidden's leading dims, dim 0 times the group size under sequence_parallel)" \
            if sequence_parallel else " (hidden's leading dims)"
        raise ValueError(f"target: expected shape {lead}{what}, got {tuple(target.shape)}")


def _check_weights(name: str, value, shape: tuple, of: str, device: torch.device):
    """Per-token or per-class loss weights: None, or a floating tensor of ``shape`` on ``device`` with no grad."""
    if value is None:
        return
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor or None, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name}: expected a floating dtype, got {value.dtype}")
    if tuple(value.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)} ({of}), got {tuple(value.shape)}")
    if value.device != device:
        raise ValueError(f"{name}: expected device {device} ({of.split(':')[0]}), got {value.device}")
    if value.requires_grad:
        raise ValueError(f"{name}: expected a tensor that does not require grad (no gradient flows to the "
                         f"weights), got requires_grad=True; pass {name}.detach()")


def check_token_weight(token_weight, target: torch.Tensor):
    _check_weights("token_weight", token_weight, target.shape, "target's", target.device)


def _check_class_weight(class_weight, weight: torch.Tensor):
    _check_weights("class_weight", class_weight, (weight.shape[0],), "weight's rows: this shard's classes",
                   weight.device)


def autocast_operands(hidden, weight, bias):
    """Under ``torch.autocast`` the GEMM operands are cast to the autocast dtype, as ``nn.Linear``'s are. The casts
    are differentiable, so the gradients come back in the parameters' own dtype (fp32 for fp32 parameters); the
    logits and the statistics stay fp32, as on 16-bit inputs."""
    if not isinstance(hidden, torch.Tensor) or hidden.is_meta or not torch.is_autocast_enabled(hidden.device.type):
        return hidden, weight, bias  # (meta: no autocast there; the checks below name the argument)
    dtype = torch.get_autocast_dtype(hidden.device.type)
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype == torch.float32 else t  # noqa: E731
    return cast(hidden), cast(weight), cast(bias)


def prepare_call(entry: str, hidden, weight, target, bias, *, group, vocab_start, vocab_size, sequence_parallel,
             backend, validate, ignore_index: int, local_checks: Callable[[torch.Tensor, bool], None],
             plan: Callable[[tuple, torch.dtype, str, bool, bool], Plan], fields: Callable[[], list],
             memory: Callable[..., tuple[Plan, bool | None]] = lambda p, *_: (p, None)):
    """Checks, the route, and the group's agreement: ``(hidden 2-D, weight, bias, target, Call)``.

    DTensor inputs are unwrapped to this rank's tensors first (a ``Shard(0)`` hidden means sequence parallel).
    Under a group, every check's error is exchanged in the agreement and raised on every rank.
    """
    hidden, weight, bias, target, group, vocab_start, vocab_size, sequence_parallel = parallel.from_dtensors(
        hidden, weight, bias, target, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        sequence_parallel=sequence_parallel)
    original_weight = weight
    hidden, weight, bias = autocast_operands(hidden, weight, bias)
    _, world = parallel.group_rank_and_size(group)
    error, call_plan, needs, agreed, fast_fits = None, None, (False, False, False), [], None
    try:
        if not isinstance(hidden, torch.Tensor):
            raise TypeError(f"hidden: expected a torch.Tensor, got {type(hidden).__name__}")
        if hidden.is_meta:  # (the others must be on hidden's device: their checks name them)
            raise ValueError(f"hidden: expected a tensor with data (cpu, cuda), got device {hidden.device}; a model "
                             f"built on the meta device needs its weights materialized before vpce computes")
        backend = resolve_backend(backend, hidden)
        check_bool("sequence_parallel", sequence_parallel)
        check_bool("validate", validate)
        check_int("vocab_start", vocab_start, low=0)
        check_int("vocab_size", vocab_size, low=1)
        if sequence_parallel and group is None:
            raise ValueError("sequence_parallel: expected a process group in `group` with sequence_parallel=True, "
                             "got group=None")
        _check_tensors(hidden, weight, target, bias, world, sequence_parallel, backend)
        local_checks(original_weight, weight is not original_weight)
        needs = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias))
        call_plan = plan(needs, hidden.dtype, backend, world > 1, sequence_parallel)
        call_plan, fast_fits = memory(call_plan, hidden, weight.shape[0], needs, world)
        agreed = [("hidden tokens", hidden.numel() // hidden.shape[-1]), ("hidden size", hidden.shape[-1]),
                  ("hidden dtype", dtype_name(hidden.dtype)), ("weight dtype", dtype_name(weight.dtype)),
                  ("bias", bias is not None), ("target dtype", dtype_name(target.dtype)),
                  ("sequence_parallel", sequence_parallel), ("requires_grad", sum(b << i for i, b in enumerate(needs))),
                  *fields(), ("backend", call_plan.backend), ("route", call_plan.route),
                  ("dx_reduce", call_plan.dx_reduce)]  # the options before the route they decide
    except (ValueError, TypeError) as e:
        if world == 1:
            raise
        error = e
    device = hidden.device if isinstance(hidden, torch.Tensor) else torch.device("cpu")
    compiling = torch.compiler.is_compiling()
    # read the agreement on the host where it costs nothing (CPU), where asked (validate), or where the layout must
    # be learned; else it is decided on the device (NaN on disagreement, no sync)
    learn_layout = world > 1 and (vocab_start is None or vocab_size is None)
    read = not compiling and (device.type != "cuda" or validate is not False or learn_layout or fast_fits is not None)
    facts = CallFacts(entry=entry, fields=tuple(agreed), rows=weight.shape[0] if error is None else -1,
                      vocab_start=vocab_start if error is None else None,
                      vocab_size=vocab_size if error is None else None,
                      target=target.reshape(-1) if error is None else None, ignore_index=ignore_index, error=error,
                      fast_fits=fast_fits)
    shard, poison, all_fit = parallel.agree(group, facts, device, read=read)
    if all_fit is not None:  # the route left to memory: fast only where it fits on every rank
        call_plan = settle(call_plan, all_fit)
    call = Call(shard, call_plan, needs, poison=poison)
    return hidden.reshape(-1, hidden.shape[-1]), weight, bias, target, call


def _enter(h2: torch.Tensor, call: Call) -> torch.Tensor:
    """The hidden states as the backend needs them (``vpce.routing``: where dX is summed over the group)."""
    if call.plan.dx_reduce == "region":
        return parallel.enter_vocab_parallel(h2, call.shard, call.plan.sequence_parallel)
    return h2


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
        validate: check target ids and the group's agreement eagerly on GPU too (a host sync). On CPU they are
            always checked; on GPU without it a bad target gives NaN for that token and a disagreement between
            ranks NaN everywhere.
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
    box = {}

    def checks():
        box["opts"] = make_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                                   z_loss=z_loss, softcap=softcap, memory_budget=memory_budget,
                                   logit_scale=logit_scale, token_scaling=token_scaling,
                                   return_z_loss=return_z_loss, return_token_accuracy=return_token_accuracy,
                                   return_entropy=return_entropy)
    return _cross_entropy(hidden, weight, target, bias, box, checks, token_weight=token_weight, group=group,
                          vocab_start=vocab_start, vocab_size=vocab_size, sequence_parallel=sequence_parallel,
                          backend=backend, validate=validate, accumulate_main_grad=accumulate_main_grad,
                          ignore_index=ignore_index, class_weight=class_weight)


def _cross_entropy(hidden, weight, target, bias, box: dict, make: Callable[[], None], *, token_weight, group,
                   vocab_start, vocab_size, sequence_parallel, backend, validate, accumulate_main_grad,
                   ignore_index, class_weight=None):
    def local_checks(w, cast_by_autocast):
        make()
        box["weight"] = w  # the caller's weight, before any autocast cast: the speculative route's call site
        check_token_weight(token_weight, target)
        _check_class_weight(class_weight, w)
        check_bool("accumulate_main_grad", accumulate_main_grad)
        if accumulate_main_grad:
            check_main_grad(w)
            if cast_by_autocast:
                raise ValueError(f"accumulate_main_grad: expected a weight that torch.autocast leaves as it is, got "
                                 f"a {w.dtype} weight cast to {torch.get_autocast_dtype(w.device.type)}; keep the "
                                 f"lm_head weight in the compute dtype or call vpce outside the autocast region")

    def plan(needs, dtype, backend_name, sharded, sp):
        o = box["opts"]
        speculate = False
        if o.reduction == "none" and not o.lean:
            key = (o, token_weight is not None, class_weight is not None, accumulate_main_grad)
            speculate, box["history"] = speculation.decide("ce", box["weight"], key, backend_name, sharded, needs)
        return plan_cross_entropy(o, needs, backend_name, sharded, sp, speculate)

    def memory(p, h, rows, needs, world):
        return settle_by_memory(p, h, rows, needs, box["opts"], world)

    def fields():
        o = box["opts"]
        return [("reduction", o.reduction), ("ignore_index", o.ignore_index), ("label_smoothing", o.label_smoothing),
                ("z_loss", o.z_loss), ("softcap", o.softcap), ("memory_budget", o.memory_budget),
                ("token_weight", token_weight is not None), ("accumulate_main_grad", accumulate_main_grad),
                ("logit_scale", o.logit_scale), ("class_weight", class_weight is not None),
                ("token_scaling", o.token_scaling), *((f"return_{k}", k in o.metrics) for k in METRICS)]

    h2, weight, bias, target, call = prepare_call(
        "ce", hidden, weight, target, bias, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        sequence_parallel=sequence_parallel, backend=backend, validate=validate,
        ignore_index=ignore_index if isinstance(ignore_index, int) else -100, local_checks=local_checks,
        plan=plan, fields=fields, memory=memory)
    opts = box["opts"]
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
        with torch.autocast(h2.device.type, enabled=False):  # the operands are already in the compute dtype
            loss = library.linear_cross_entropy(h2, weight, bias, t1, tw1, call.plan.backend, opts,
                                                call.shard.vocab_size, call.needs_grad, cw1)
    else:
        call = Call(call.shard, call.plan, call.needs_grad, accumulate_main_grad, call.poison, box.get("history"))
        with torch.autocast(h2.device.type, enabled=False):
            loss = LinearCrossEntropyFunction.apply(_enter(h2, call), weight, bias, t1, tw1, opts, call, cw1)
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
    box = {}

    def local_checks(w, _cast):
        box["weight"] = w  # the caller's weight, before any autocast cast: the speculative route's call site
        box["budget"] = check_memory_budget(memory_budget)
        check_int("ignore_index", ignore_index, allow_none=False)
        check_number("temperature", temperature, low=0.0, low_open=True)
        check_number("softcap", softcap, low=0.0, low_open=True, allow_none=True)
        check_bool("return_entropy", return_entropy)
        _check_logit_scale(logit_scale)
        check_bool("return_top1", return_top1)
        check_bool("return_mean_logits", return_mean_logits)
        check_bool("return_log_sum_sq_probs", return_log_sum_sq_probs)

    def fields():
        return [("ignore_index", ignore_index), ("temperature", float(temperature)),
                ("softcap", None if softcap is None else float(softcap)), ("return_entropy", return_entropy),
                ("logit_scale", float(logit_scale)), ("return_top1", return_top1),
                ("return_mean_logits", return_mean_logits), ("return_log_sum_sq_probs", return_log_sum_sq_probs),
                ("memory_budget", box["budget"])]

    def plan(needs, dtype, backend_name, sharded, sp):
        speculate = False
        if box["budget"] != "lean":
            speculate, box["history"] = speculation.decide("logprob", box["weight"], tuple(fields()), backend_name,
                                                           sharded, needs)
        return plan_log_probs(needs, backend_name, sharded, sp, speculate)

    def memory(p, h, rows, needs, world):
        return settle_by_memory(p, h, rows, needs, LossOptions(memory_budget=box["budget"]), world)

    h2, weight, bias, target, call = prepare_call(
        "logprob", hidden, weight, target, bias, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        sequence_parallel=sequence_parallel, backend=backend, validate=validate,
        ignore_index=ignore_index if isinstance(ignore_index, int) else -100, local_checks=local_checks,
        plan=plan, fields=fields, memory=memory)
    call = dataclasses.replace(call, history=box.get("history"))
    # the logit scale s folds into the cap and the temperature: cap_c(s x) / T = cap_{c/s}(x) * (s / T)
    s = float(logit_scale)
    lp = LogProbOptions(ignore_index=int(ignore_index), softcap=None if softcap is None else float(softcap) / s,
                        inv_t=s / float(temperature), entropy=return_entropy, top1=return_top1,
                        mean_logits=return_mean_logits, log_sum_sq=return_log_sum_sq_probs,
                        memory_budget=box["budget"])
    with torch.autocast(h2.device.type, enabled=False):  # the operands are already in the compute dtype
        out = LinearLogProbsFunction.apply(_enter(h2, call), weight, bias, target.reshape(-1), lp, call)
    if isinstance(out, tuple):
        return tuple(x.reshape(target.shape) for x in out)
    return out.reshape(target.shape)


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
        self.options = make_options(ignore_index=ignore_index, reduction=reduction,
                                    label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                                    memory_budget=memory_budget, logit_scale=logit_scale,
                                    token_scaling=token_scaling, return_z_loss=return_z_loss,
                                    return_token_accuracy=return_token_accuracy, return_entropy=return_entropy)
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        check_int("vocab_start", vocab_start, low=0)
        check_int("vocab_size", vocab_size, low=1)
        self.group, self.vocab_start, self.vocab_size = group, vocab_start, vocab_size
        self.sequence_parallel, self.backend, self.validate = sequence_parallel, backend, validate
        self.accumulate_main_grad = accumulate_main_grad

    def forward(self, hidden, weight, target, bias=None, token_weight=None, class_weight=None):
        box = {"opts": self.options}
        return _cross_entropy(hidden, weight, target, bias, box, lambda: None, token_weight=token_weight,
                              group=self.group, vocab_start=self.vocab_start, vocab_size=self.vocab_size,
                              sequence_parallel=self.sequence_parallel, backend=self.backend,
                              validate=self.validate, accumulate_main_grad=self.accumulate_main_grad,
                              ignore_index=self.options.ignore_index, class_weight=class_weight)

    def extra_repr(self) -> str:
        o = self.options
        return (f"reduction={o.reduction!r}, ignore_index={o.ignore_index}, label_smoothing={o.label_smoothing}, "
                f"z_loss={o.z_loss}, softcap={o.softcap}, logit_scale={o.logit_scale}, backend={self.backend!r}, "
                f"memory_budget={o.memory_budget!r}, sharded={self.group is not None}")
