"""Knowledge distillation without logits: ``linear_distillation_loss``, the divergence between a student head
``hidden @ weight.T (+ bias)`` and a teacher head ``teacher_hidden @ teacher_weight.T (+ teacher_bias)`` over a
vocab that may be sharded over a tensor-parallel group, with exact loss and exact student gradients.

This module is the public entry: argument checks (``DistillArgs.validate``, the teacher against the student),
then ``vpce.prepare.prepare_call`` with a ``DistillEntry``, then the autograd shell
(``vpce.autograd.LinearDistillationFunction``) or, under ``torch.compile``, the registered op (``vpce.library``).
What is computed, the statistics and their exchange: ``vpce.formulas.distill``; the backends:
``vpce.backends.pytorch.distill_forward``, ``vpce.backends.triton.distill_forward``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import parallel
from .autograd import LinearDistillationFunction, accumulation_dtype
from .options import DIVERGENCES, REDUCTIONS, DistillOptions
from .prepare import (Entry, autocast_dtype, autocast_operands, check_bool, check_int, check_memory_budget,
                      check_number, check_token_weight, compute_operands, dtype_name, enter, operand_dtype,
                      prepare_call)
from .routing import plan_distillation, size_distillation

__all__ = ["linear_distillation_loss", "DistillOptions", "DIVERGENCES"]


@dataclass(frozen=True, kw_only=True)
class DistillArgs:
    """``linear_distillation_loss``'s per-token options as the caller gave them (the meanings: its docstring), not
    yet checked; ``validate`` freezes them into ``DistillOptions`` (as ``vpce.api.CrossEntropyArgs``)."""

    divergence: str = "forward_kl"
    beta: float | None = None
    temperature: float = 1.0
    temperature_squared: bool = False
    ce_weight: float = 0.0
    has_target: bool = False
    """Whether a ``target`` was given (without one no token is ignored)."""
    ignore_index: int = -100
    reduction: str = "mean"
    softcap: float | None = None
    teacher_softcap: float | None = None
    memory_budget: str | float = "auto"

    def validate(self) -> DistillOptions:
        """The checked options (``ValueError``/``TypeError`` naming the argument)."""
        divergence, beta, temperature, ce_weight = self.divergence, self.beta, self.temperature, self.ce_weight
        if divergence not in DIVERGENCES:
            raise ValueError(f"divergence: expected one of {DIVERGENCES}, got {divergence!r}")
        if divergence == "jsd":
            check_number("beta", beta, low=0.0, allow_none=True)
            if beta is not None and beta > 1:
                raise ValueError(f"beta: expected a number in [0, 1], got {beta}")
        elif beta is not None:
            raise ValueError(f"beta: expected None with divergence={divergence!r} (beta is the JSD's mixture "
                             f"weight; pass divergence='jsd'), got {beta!r}")
        check_number("temperature", temperature, low=0.0, low_open=True)
        if temperature == math.inf:
            raise ValueError("temperature: expected a finite number > 0, got inf")
        check_bool("temperature_squared", self.temperature_squared)
        check_number("ce_weight", ce_weight, low=0.0)
        if ce_weight > 1:
            raise ValueError(f"ce_weight: expected a number in [0, 1], got {ce_weight}")
        if ce_weight > 0 and not self.has_target:
            raise ValueError(f"target: expected a tensor of hard labels with ce_weight={ce_weight}, got None")
        check_int("ignore_index", self.ignore_index, allow_none=False)
        if self.reduction not in REDUCTIONS:
            raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {self.reduction!r}")
        check_number("softcap", self.softcap, low=0.0, low_open=True, allow_none=True)
        check_number("teacher_softcap", self.teacher_softcap, low=0.0, low_open=True, allow_none=True)
        memory_budget = check_memory_budget(self.memory_budget)
        beta = 0.5 if beta is None else float(beta)
        kind = divergence if divergence != "jsd" or 0 < beta < 1 else ("forward_kl" if beta == 0 else "reverse_kl")
        t = float(temperature)
        return DistillOptions(kind=kind, beta=beta, temperature=t,
                              kd_scale=(1 - ce_weight) * (t * t if self.temperature_squared else 1.0),
                              ce_weight=float(ce_weight), ignore_index=int(self.ignore_index) if self.has_target
                              else -1, reduction=self.reduction,
                              softcap=None if self.softcap is None else float(self.softcap),
                              teacher_softcap=None if self.teacher_softcap is None else float(self.teacher_softcap),
                              memory_budget=memory_budget)


def _is_dtensor(x) -> bool:
    dtensor = parallel.dtensor_type()
    return dtensor is not None and isinstance(x, dtensor)


def _check_teacher(hidden, weight, t_hidden, t_weight, t_bias, sequence_parallel):
    """The teacher's tensors (after autocast's cast) against the student's (already checked, as the caller passed
    them): the student's compute dtype, device, tokens and vocab rows."""
    dtype = operand_dtype(hidden, autocast_dtype(hidden))
    for name, t in (("teacher_hidden", t_hidden), ("teacher_weight", t_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t_bias is not None and not isinstance(t_bias, torch.Tensor):
        raise TypeError(f"teacher_bias: expected a torch.Tensor or None, got {type(t_bias).__name__}")
    for name, t in (("teacher_hidden", t_hidden), ("teacher_weight", t_weight), ("teacher_bias", t_bias)):
        if t is None:
            continue
        if t.device != hidden.device:  # first: autocast casts only the tensors on its device
            raise ValueError(f"{name}: expected device {hidden.device} (hidden's), got {t.device}")
        if t.dtype != dtype:
            raise TypeError(f"{name}: expected dtype {dtype} (hidden's), got {t.dtype}")
    lead = tuple(hidden.shape[:-1])
    if t_hidden.dim() < 1 or tuple(t_hidden.shape[:-1]) != lead:
        what = "this rank's slice, as hidden" if sequence_parallel else "hidden's leading dims"
        raise ValueError(f"teacher_hidden: expected shape [{', '.join(map(str, lead))}, D_teacher] ({what}), got "
                         f"{tuple(t_hidden.shape)}")
    if t_weight.dim() != 2 or t_weight.shape != (weight.shape[0], t_hidden.shape[-1]):
        raise ValueError(f"teacher_weight: expected shape ({weight.shape[0]}, {t_hidden.shape[-1]}) (the student "
                         f"weight's vocab rows, teacher_hidden's last dim), got {tuple(t_weight.shape)}")
    if t_bias is not None and t_bias.shape != (weight.shape[0],):
        raise ValueError(f"teacher_bias: expected shape ({weight.shape[0]},), got {tuple(t_bias.shape)}")


class DistillEntry(Entry):
    """``linear_distillation_loss`` in ``prepare_call``: ``args`` its options, validated in ``checks``;
    ``originals`` the caller's seven tensors (student hidden, weight, bias; teacher hidden, weight, bias; target),
    ``teacher`` the teacher's three after autocast."""

    name = "distill"

    def __init__(self, args: DistillArgs, originals: tuple, teacher: tuple, target, token_weight, sequence_parallel):
        self.args, self.originals, self.teacher = args, originals, teacher
        self.target, self.token_weight, self.sequence_parallel = target, token_weight, sequence_parallel
        ignore_index = args.ignore_index
        self.ignore_index = (ignore_index if isinstance(ignore_index, int) else -100) if args.has_target else -1
        self.o = None

    def checks(self, _weight, _cast):
        for name, x in zip(("hidden", "weight", "bias", "teacher_hidden", "teacher_weight", "teacher_bias",
                            "target"), self.originals):
            if _is_dtensor(x):
                raise TypeError(f"{name}: expected a plain torch.Tensor (linear_distillation_loss takes this rank's "
                                f"local shards with group=, vocab_start=), got a DTensor")
        self.o = self.args.validate()
        _check_teacher(*self.originals[:2], *self.teacher, self.sequence_parallel)
        check_token_weight(self.token_weight, self.target)

    def plan(self, needs, _dtype, backend_name, sharded, sp):
        o = self.o
        return plan_distillation(o.reduction, o.memory_budget == "lean", needs, backend_name, sharded, sp)

    def size(self, plan, shard, d, dtype):
        return size_distillation(plan, self.o, shard, d, dtype)

    def fields(self):
        o, a = self.o, self.args
        t_hidden, _, t_bias = self.teacher
        divergence = a.divergence
        short = {"forward_kl": "fwd_kl", "reverse_kl": "rev_kl"}.get(divergence, divergence)  # read in messages
        return [("divergence", short), ("beta", o.beta), ("temperature", o.temperature),
                ("temperature_squared", a.temperature_squared), ("ce_weight", o.ce_weight),
                ("target given", a.has_target), ("reduction", o.reduction), ("ignore_index", o.ignore_index),
                ("softcap", o.softcap), ("teacher_softcap", o.teacher_softcap), ("memory_budget", o.memory_budget),
                ("token_weight", self.token_weight is not None), ("teacher hidden size", t_hidden.shape[-1]),
                ("teacher dtype", dtype_name(t_hidden.dtype)), ("teacher_bias", t_bias is not None)]


def linear_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, target=None, bias=None,
                             teacher_bias=None, *, divergence="forward_kl", beta=None, temperature=1.0,
                             temperature_squared=False, ce_weight=0.0, ignore_index=-100, reduction="mean",
                             token_weight=None, softcap=None, teacher_softcap=None, group=None, vocab_start=None,
                             vocab_size=None, sequence_parallel=False, backend="auto", memory_budget="auto",
                             validate=False):
    """Distillation loss between a student head ``hidden @ weight.T (+ bias)`` and a teacher head
    ``teacher_hidden @ teacher_weight.T (+ teacher_bias)`` without materializing either's logits.

    Args:
        hidden: the student's ``[..., D_s]`` fp32/fp16/bf16 (fp64 too) hidden states.
        weight: ``[V_local, D_s]``, the student's lm_head or, under ``group``, this rank's rows of it.
        teacher_hidden: ``[..., D_t]``, hidden's leading shape and dtype; the hidden sizes may differ.
        teacher_weight: ``[V_local, D_t]``, the same vocab rows as ``weight``.
        target: None, or ``[...]`` int64/int32 global ids (the full sequence under ``sequence_parallel``):
            tokens whose target is ``ignore_index`` count for nothing, and with ``ce_weight > 0`` the hard labels
            of the cross-entropy term.
        bias, teacher_bias: ``[V_local]`` or None.
        divergence: ``"forward_kl"`` (KL(teacher || student)), ``"reverse_kl"`` (KL(student || teacher)) or
            ``"jsd"``, the generalized Jensen-Shannon divergence with ``beta`` (default 0.5; 0 and 1 give the
            forward and reverse KL, as TRL's ``generalized_jsd_loss`` defines them).
        beta: the JSD's weight of the teacher in the mixture; only with ``divergence="jsd"``.
        temperature: > 0, divides both heads' (capped) logits of the divergence.
        temperature_squared: multiply the divergence by ``temperature**2`` (Hinton et al.).
        ce_weight: in [0, 1]; the loss is ``(1 - ce_weight) * divergence + ce_weight * cross_entropy`` of the
            untempered student logits against ``target``.
        reduction: ``"mean"`` over non-ignored tokens (weighted by ``token_weight``), ``"sum"`` or ``"none"``.
        token_weight: float, target's (or hidden's leading) shape, no grad: scales each token's loss.
        softcap, teacher_softcap: each head's logits become ``c * tanh(logits / c)`` before the temperature.
        group, vocab_start, vocab_size, sequence_parallel, validate: as in ``linear_cross_entropy``; both heads are
            sharded over ``group`` with the same rows. Under ``sequence_parallel`` both hidden states are this
            rank's slices.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"`` (the chunked PyTorch
            backend; float64 too).
        memory_budget: ``"auto"``/``"fast"`` (gradients formed in forward), ``"lean"`` (recomputed in backward),
            or GiB of live chunk data.

    Returns:
        The fp32 loss (fp64 for fp64 inputs): a scalar, or the tokens' shape for ``reduction="none"``. The teacher
        gets no gradient: its tensors are used detached, whether or not they require grad.
    """
    originals = (hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, target)
    has_target = target is not None
    if not has_target and isinstance(hidden, torch.Tensor) and hidden.dim() >= 1:
        _, world = parallel.group_rank_and_size(group)
        lead = tuple(hidden.shape[:-1])
        if sequence_parallel is True and lead:
            lead = (lead[0] * world,) + lead[1:]
        target = torch.zeros(lead, dtype=torch.int64, device=hidden.device)  # no token ignored (ignore_index -1)
    teacher_hidden, teacher_weight, teacher_bias = autocast_operands(teacher_hidden, teacher_weight, teacher_bias)
    entry = DistillEntry(DistillArgs(divergence=divergence, beta=beta, temperature=temperature,
                                     temperature_squared=temperature_squared, ce_weight=ce_weight,
                                     has_target=has_target, ignore_index=ignore_index, reduction=reduction,
                                     softcap=softcap, teacher_softcap=teacher_softcap, memory_budget=memory_budget),
                         originals, (teacher_hidden, teacher_weight, teacher_bias), target, token_weight,
                         sequence_parallel)
    h2, weight2, bias2, target, call = prepare_call(
        entry, hidden, weight, target, bias, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        sequence_parallel=sequence_parallel, backend=backend, validate=validate)
    o = entry.o
    t2 = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    if call.plan.sequence_parallel and call.shard.sharded and call.plan.dx_reduce != "forward":
        t2 = parallel.gather_sequence(t2.contiguous(), call.shard)  # (the Triton fast route gathers it itself)
    tw = teacher_weight.detach()
    tb = None if teacher_bias is None else teacher_bias.detach()
    tw1 = None if token_weight is None else token_weight.reshape(-1).to(accumulation_dtype(h2.dtype))
    if torch.compiler.is_compiling():
        if call.shard.sharded:
            raise NotImplementedError("vpce.linear_distillation_loss under torch.compile supports one process; call "
                                      "it outside the compiled region under a group")
        from . import library
        with torch.autocast(h2.device.type, enabled=False):
            loss = library.linear_distillation_loss(h2, *compute_operands(h2.dtype, weight2, bias2), t2, tw, tb,
                                                    target.reshape(-1), tw1, call.plan.backend, o,
                                                    call.shard.vocab_size, call.needs_grad)
        return loss.reshape(target.shape) if o.reduction == "none" else loss
    with torch.autocast(h2.device.type, enabled=False):  # (the Function casts the student's parameters)
        loss = LinearDistillationFunction.apply(enter(h2, call), weight2, bias2, t2, tw, tb, target.reshape(-1), tw1,
                                                o, call)
    return loss.reshape(target.shape) if o.reduction == "none" else loss
