"""Call preparation, under every public entry (``vpce.api``, ``vpce.distill``): the argument checks, autocast,
the route (``vpce.routing``) and the group's agreement (``vpce.parallel.agree``).

Each public function describes itself to ``prepare_call`` with one ``Entry`` object: its name in the agreement, its
own checks, its plan, the fields every rank must agree on, and (where a route is left to free memory) how that is
weighed. ``prepare_call`` runs the checks every entry shares around them; under a group an error of any check is
exchanged in the agreement and raised on every rank. No public module is imported here.
"""

from __future__ import annotations

import math
import numbers

import torch

from . import parallel
from .options import BUDGET_NAMES
from .parallel import CallFacts
from .routing import Call, Plan, resolve_backend, settle

__all__ = ["Entry", "prepare_call", "enter", "autocast_dtype", "operand_dtype", "autocast_operands",
           "compute_operands", "check_number", "check_int", "check_bool", "check_memory_budget", "check_logit_scale",
           "check_token_weight", "check_class_weight", "dtype_name"]

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


def check_logit_scale(value):
    """A finite number > 0: it multiplies the logits (a negative one would turn the ranking upside down, and 0
    would make every class equally likely whatever the inputs; negate or zero the weight for that)."""
    check_number("logit_scale", value, low=0.0, low_open=True)
    if math.isinf(value):
        raise ValueError(f"logit_scale: expected a finite number > 0, got {value}")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _check_tensors(hidden, weight, target, bias, world: int, sequence_parallel: bool, backend: str,
                   autocast: torch.dtype | None):
    """``hidden`` after autocast's cast; ``weight`` and ``bias`` as the caller passed them, checked in the dtype they
    compute in (``operand_dtype``)."""
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
    if operand_dtype(weight, autocast) != hidden.dtype:
        raise TypeError(f"weight: expected dtype {hidden.dtype} (hidden's), got {weight.dtype}")
    if bias is not None:
        if bias.shape != (weight.shape[0],):
            raise ValueError(f"bias: expected shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        if operand_dtype(bias, autocast) != hidden.dtype:
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


def check_class_weight(class_weight, weight: torch.Tensor):
    _check_weights("class_weight", class_weight, (weight.shape[0],), "weight's rows: this shard's classes",
                   weight.device)


def autocast_dtype(hidden) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes the GEMMs in on hidden's device, or None outside an autocast region
    (and for a ``hidden`` that is no tensor or a meta tensor: no autocast there; the checks name it)."""
    if not isinstance(hidden, torch.Tensor) or hidden.is_meta or not torch.is_autocast_enabled(hidden.device.type):
        return None
    return torch.get_autocast_dtype(hidden.device.type)


def operand_dtype(t: torch.Tensor, autocast: torch.dtype | None) -> torch.dtype:
    """The dtype ``t`` computes in: ``autocast`` (``autocast_dtype``) for an fp32 tensor, as ``nn.Linear``'s
    operands are cast, else its own."""
    return autocast if autocast is not None and t.dtype == torch.float32 else t.dtype


def autocast_operands(hidden, weight, bias):
    """Under ``torch.autocast`` the GEMM operands are cast to the autocast dtype, as ``nn.Linear``'s are. The casts
    are differentiable, so the gradients come back in the tensors' own dtype; the logits and the statistics stay
    fp32, as on 16-bit inputs. ``vpce.distill`` casts the teacher's three this way; ``prepare_call`` casts hidden,
    and leaves the weight and bias to ``compute_operands``."""
    autocast = autocast_dtype(hidden)
    cast = lambda t: t.to(operand_dtype(t, autocast)) if isinstance(t, torch.Tensor) else t  # noqa: E731
    return cast(hidden), cast(weight), cast(bias)


def compute_operands(dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None):
    """The weight and bias in the compute dtype ``dtype`` (hidden's, after autocast).

    ``prepare_call`` hands the caller's weight and bias on as they are; where autocast casts fp32 parameters, each
    autograd Function (``vpce.autograd``) casts them here in its forward, where autograd records no cast, and
    returns their gradients in the parameters' dtype: the fast route's dW is its fp32 accumulator scaled in place,
    with no 16-bit rounding and no copy. (A 16-bit dW and the fp32 copy autograd's cast made of it were 1.5 GiB
    at the start of backward on a 128k-vocab head.) Differentiable where it runs in grad mode (the
    ``torch.compile`` path, ``vpce.library``'s ops)."""
    cast = lambda t: t if t is None or t.dtype == dtype else t.to(dtype)  # noqa: E731
    return cast(weight), cast(bias)


class Entry:
    """One public entry's part of ``prepare_call``; a subclass per entry, one object per call (it keeps what its
    checks and its plan decide, for the entry to read after ``prepare_call``)."""

    name: str = ""
    """The entry's name in the agreement's fingerprint (``"ce"``, ``"logprob"``, ``"distill"``)."""
    ignore_index: int = -100
    """The target id the agreement's target check skips."""
    weight_cast = False
    """Whether the autograd Function casts the weight (fp32 under autocast): ``memory`` and ``size`` pass it on
    (``vpce.routing._fast_chunk``); set by ``prepare_call`` and agreed by the group."""

    def checks(self, weight: torch.Tensor, cast_by_autocast: bool) -> None:
        """The entry's own argument checks (``ValueError``/``TypeError``), after the shared ones; ``weight``: the
        caller's (autocast casts it only in the autograd Function: ``compute_operands``)."""

    def plan(self, needs: tuple[bool, bool, bool], dtype: torch.dtype, backend: str, sharded: bool,
             sequence_parallel: bool) -> Plan:
        raise NotImplementedError

    def fields(self) -> list:
        """``(name, value)`` pairs of the options every rank must agree on."""
        raise NotImplementedError

    def memory(self, plan: Plan, hidden: torch.Tensor, rows: int, needs: tuple[bool, bool, bool],
               world: int) -> tuple[Plan, bool | None]:
        """A route left to free memory, decided (``vpce.routing.settle_by_memory``, with ``weight_cast``); by
        default nothing to weigh."""
        return plan, None

    def size(self, plan: Plan, shard: parallel.VocabShard, d: int, dtype: torch.dtype) -> Plan:
        """The plan with its chunk and buffer sizes (``vpce.routing.size_cross_entropy`` and its kin), once the
        shard is agreed."""
        raise NotImplementedError


def prepare_call(entry: Entry, hidden, weight, target, bias, *, group, vocab_start, vocab_size, sequence_parallel,
                 backend, validate):
    """Checks, the route, and the group's agreement: ``(hidden 2-D, weight, bias, target, Call)``.

    DTensor inputs are unwrapped to this rank's tensors first (a ``Shard(0)`` hidden means sequence parallel).
    Under ``torch.autocast`` an fp32 hidden is cast to the autocast dtype (differentiably); the weight and bias are
    returned uncast, for the autograd Function to cast in its forward (``compute_operands``), but checked, planned
    and agreed on in the dtype they compute in, hidden's. Under a group, every check's error is exchanged in the
    agreement and raised on every rank.
    """
    hidden, weight, bias, target, group, vocab_start, vocab_size, sequence_parallel = parallel.from_dtensors(
        hidden, weight, bias, target, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        sequence_parallel=sequence_parallel)
    autocast = autocast_dtype(hidden)
    if autocast is not None:
        hidden = hidden.to(operand_dtype(hidden, autocast))
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
        _check_tensors(hidden, weight, target, bias, world, sequence_parallel, backend, autocast)
        entry.weight_cast = weight.dtype != hidden.dtype  # by autocast, in the Function's forward
        entry.checks(weight, entry.weight_cast)
        needs = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad for t in (hidden, weight, bias))
        call_plan = entry.plan(needs, hidden.dtype, backend, world > 1, sequence_parallel)
        call_plan, fast_fits = entry.memory(call_plan, hidden, weight.shape[0], needs, world)
        agreed = [("hidden tokens", hidden.numel() // hidden.shape[-1]), ("hidden size", hidden.shape[-1]),
                  ("hidden dtype", dtype_name(hidden.dtype)),
                  ("weight dtype", dtype_name(operand_dtype(weight, autocast))), ("weight cast", entry.weight_cast),
                  ("bias", bias is not None), ("target dtype", dtype_name(target.dtype)),
                  ("sequence_parallel", sequence_parallel), ("requires_grad", sum(b << i for i, b in enumerate(needs))),
                  *entry.fields(), ("backend", call_plan.backend), ("route", call_plan.route),
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
    facts = CallFacts(entry=entry.name, fields=tuple(agreed), rows=weight.shape[0] if error is None else -1,
                      vocab_start=vocab_start if error is None else None,
                      vocab_size=vocab_size if error is None else None,
                      target=target.reshape(-1) if error is None else None, ignore_index=entry.ignore_index,
                      weight=weight if error is None and world > 1 and vocab_start is None else None,
                      hidden=hidden if error is None and world > 1 and validate is True and not sequence_parallel
                      else None, error=error, fast_fits=fast_fits)
    shard, poison, all_fit = parallel.agree(group, facts, device, read=read)
    if all_fit is not None:  # the route left to memory: fast (in one chunk) only where it fits on every rank
        call_plan = settle(call_plan, all_fit)
    sized = entry.size(call_plan, shard, hidden.shape[-1], hidden.dtype)
    call = Call(shard, sized, needs, poison=poison, history=sized.history)
    return hidden.reshape(-1, hidden.shape[-1]), weight, bias, target, call


def enter(h2: torch.Tensor, call: Call) -> torch.Tensor:
    """The hidden states as the backend needs them (``vpce.routing``: where dX is summed over the group)."""
    if call.plan.dx_reduce == "region":
        return parallel.enter_vocab_parallel(h2, call.shard, call.plan.sequence_parallel)
    return h2
