"""Public API: ``linear_cross_entropy`` and ``LinearCrossEntropy``.

This layer validates every argument (``ValueError``/``TypeError`` that name the argument, what was expected and
what was given), flattens ``[..., D]`` inputs to 2-D, resolves where this rank's vocab shard sits
(``vpce.parallel``), routes the hidden states through the group's collectives, and dispatches to a backend.
"""

from __future__ import annotations

import numbers
import os

import torch

from . import parallel
from .grads import check_main_grad
from .options import BACKENDS, BUDGET_NAMES, REDUCTIONS, LossOptions
from .torch_backend import TorchLinearCrossEntropy, TorchLinearLogProbs

__all__ = ["linear_cross_entropy", "linear_log_probs", "LinearCrossEntropy"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _triton_available() -> bool:
    try:
        from . import triton_backend  # noqa: F401
    except ImportError:
        return False
    return True


def _check_number(name: str, value, *, low=None, low_open=False, high_open=None, allow_none=False):
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


def _check_int(name: str, value, *, low=None, allow_none=True):
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise ValueError(f"{name}: expected an int >= {low}, got {value}")


def make_options(*, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
                 memory_budget="auto") -> LossOptions:
    """Validate the per-token options once and freeze them into ``LossOptions``."""
    _check_int("ignore_index", ignore_index, allow_none=False)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    _check_number("label_smoothing", label_smoothing, low=0.0, high_open=1.0)
    _check_number("z_loss", z_loss, low=0.0)
    _check_number("softcap", softcap, low=0.0, low_open=True, allow_none=True)
    if isinstance(memory_budget, str):
        if memory_budget not in BUDGET_NAMES:
            raise ValueError(f"memory_budget: expected one of {BUDGET_NAMES} or a positive number of GiB, "
                             f"got {memory_budget!r}")
    else:
        _check_number("memory_budget", memory_budget, low=0.0, low_open=True)
        memory_budget = float(memory_budget)
    return LossOptions(ignore_index=int(ignore_index), reduction=reduction,
                       label_smoothing=float(label_smoothing), z_loss=float(z_loss),
                       softcap=None if softcap is None else float(softcap), memory_budget=memory_budget)


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
        raise ValueError(f"weight: expected shape [V_local, {hidden.shape[-1]}] to match hidden's last dim, "
                         f"got {tuple(weight.shape)}")
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


def _check_target_values(target: torch.Tensor, ignore_index: int, vocab_size: int):
    """Eager range check (a host sync): ids in [0, vocab_size) or ignore_index."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(bad.any()):
        pos = bad.nonzero()[0].tolist()
        raise ValueError(f"target: expected ids in [0, {vocab_size}) or ignore_index={ignore_index}, "
                         f"got {int(target[tuple(pos)])} at index {tuple(pos)}")


def linear_cross_entropy(hidden, weight, target, bias=None, *, ignore_index=-100, reduction="mean",
                         label_smoothing=0.0, z_loss=0.0, softcap=None, token_weight=None, group=None,
                         vocab_start=None, vocab_size=None, sequence_parallel=False, backend="auto",
                         memory_budget="auto", validate=False, accumulate_main_grad=False):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target`` without materializing the logits.

    ``weight`` is the whole lm_head ``[V, D]`` or, under ``group``, this rank's contiguous shard of rows; the
    loss is the exact loss over the global vocab and is the same on every rank, and the gradient of ``hidden``
    is already summed over the group. See ``docs/api.md`` for every option.

    ``validate=True`` checks target ids eagerly on GPU too (a host sync); on CPU the check always runs. Without
    it, an out-of-range target on GPU gives NaN for that token. ``token_weight`` (shape of ``target``) scales each
    token's loss; ``mean`` then divides by the weights' sum over non-ignored tokens. ``accumulate_main_grad``
    adds the weight gradient in fp32 into ``weight.main_grad`` (Megatron's gradient-accumulation fusion).
    """
    opts = make_options(ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing,
                        z_loss=z_loss, softcap=softcap, memory_budget=memory_budget)
    return _linear_cross_entropy(hidden, weight, target, bias, opts, token_weight=token_weight, group=group,
                                 vocab_start=vocab_start, vocab_size=vocab_size,
                                 sequence_parallel=sequence_parallel, backend=backend, validate=validate,
                                 accumulate_main_grad=accumulate_main_grad)


def _resolve_backend(backend, hidden: torch.Tensor) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if hidden.is_cuda and _triton_available() else "torch"
    if backend == "triton":
        if not _triton_available():
            raise ValueError("backend: 'triton' needs the Triton package and vpce's Triton kernels, which could "
                             "not be imported here; use backend='torch' or 'auto'")
        if not hidden.is_cuda and os.environ.get("TRITON_INTERPRET", "0") != "1":
            raise ValueError(f"backend: 'triton' expects CUDA tensors (or TRITON_INTERPRET=1 for the CPU "
                             f"interpreter), got hidden on {hidden.device}")
    return backend


def _check_token_weight(token_weight, target: torch.Tensor):
    if token_weight is None:
        return
    if not isinstance(token_weight, torch.Tensor):
        raise TypeError(f"token_weight: expected a torch.Tensor or None, got {type(token_weight).__name__}")
    if not token_weight.is_floating_point():
        raise TypeError(f"token_weight: expected a floating dtype, got {token_weight.dtype}")
    if token_weight.shape != target.shape:
        raise ValueError(f"token_weight: expected shape {tuple(target.shape)} (target's), "
                         f"got {tuple(token_weight.shape)}")
    if token_weight.device != target.device:
        raise ValueError(f"token_weight: expected device {target.device} (target's), got {token_weight.device}")
    if token_weight.requires_grad:
        raise ValueError("token_weight: expected a tensor that does not require grad (no gradient flows to the "
                         "weights), got requires_grad=True; pass token_weight.detach()")


def _prepare(hidden, weight, target, bias, *, ignore_index, group, vocab_start, vocab_size, sequence_parallel,
             backend, validate):
    """Shared checks and set-up: (this rank's hidden as 2-D, not yet in the vocab-parallel region (see
    ``parallel.enter_vocab_parallel``), local weight, local bias, target, shard, backend, needs, sequence
    parallel); DTensor inputs are unwrapped to this rank's tensors (a ``Shard(0)`` hidden means sequence
    parallel)."""
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"hidden: expected a torch.Tensor, got {type(hidden).__name__}")
    hidden, weight, bias, target, group, vocab_start, vocab_size, sequence_parallel = parallel.from_dtensors(
        hidden, weight, bias, target, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        sequence_parallel=sequence_parallel)
    backend = _resolve_backend(backend, hidden)
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel: expected a bool, got {type(sequence_parallel).__name__}")
    if not isinstance(validate, bool):
        raise TypeError(f"validate: expected a bool, got {type(validate).__name__}")
    _check_int("vocab_start", vocab_start, low=0)
    _check_int("vocab_size", vocab_size, low=1)
    if sequence_parallel and group is None:
        raise ValueError("sequence_parallel: expected a process group in `group` with sequence_parallel=True, "
                         "got group=None")
    _, world = parallel.group_rank_and_size(group)
    _check_tensors(hidden, weight, target, bias, world, sequence_parallel, backend)
    shard = parallel.resolve_shard(group, weight.shape[0], vocab_start, vocab_size, hidden.device)
    # the eager range check syncs with the host: under torch.compile an out-of-range target gives NaN instead
    if (validate or not target.is_cuda) and not torch.compiler.is_compiling():
        _check_target_values(target, ignore_index, shard.vocab_size)
    needs_grad = tuple(torch.is_grad_enabled() and t is not None and t.requires_grad
                       for t in (hidden, weight, bias))
    return hidden.reshape(-1, hidden.shape[-1]), weight, bias, target, shard, backend, needs_grad, sequence_parallel


def _linear_cross_entropy(hidden, weight, target, bias, opts: LossOptions, *, token_weight=None, group,
                          vocab_start, vocab_size, sequence_parallel, backend, validate,
                          accumulate_main_grad=False):
    if not isinstance(accumulate_main_grad, bool):
        raise TypeError(f"accumulate_main_grad: expected a bool, got {type(accumulate_main_grad).__name__}")
    h2, weight, bias, target, shard, backend, needs_grad, sp = _prepare(
        hidden, weight, target, bias, ignore_index=opts.ignore_index, group=group, vocab_start=vocab_start,
        vocab_size=vocab_size, sequence_parallel=sequence_parallel, backend=backend, validate=validate)
    t1 = target.reshape(-1)
    _check_token_weight(token_weight, target)
    if accumulate_main_grad:
        check_main_grad(weight)
    acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    tw1 = None if token_weight is None else token_weight.reshape(-1).to(acc)
    if torch.compiler.is_compiling():
        if shard.sharded or accumulate_main_grad:
            raise NotImplementedError("vpce under torch.compile supports one process without "
                                      "accumulate_main_grad; call it outside the compiled region under a group")
        from . import library
        loss = library.linear_cross_entropy(h2, weight, bias, t1, tw1, backend, opts, shard.vocab_size, needs_grad)
        return loss.reshape(target.shape) if opts.reduction == "none" else loss
    if backend == "triton":
        from . import triton_backend as tb
        dx_comm = None
        if shard.sharded and tb.REDUCE_DX_IN_FORWARD and tb.fast_route(opts, needs_grad, h2.dtype):
            # the fast route sums dX over the group itself, in forward, overlapped with its dW GEMMs
            dx_comm = "sequence_parallel" if sp else "all_reduce"
        else:
            h2 = parallel.enter_vocab_parallel(h2, shard, sp)
        loss = tb.TritonLinearCrossEntropy.apply(h2, weight, bias, t1, tw1, shard, opts, needs_grad,
                                                 accumulate_main_grad, dx_comm)
    else:
        h2 = parallel.enter_vocab_parallel(h2, shard, sp)
        loss = TorchLinearCrossEntropy.apply(h2, weight, bias, t1, tw1, shard, opts, needs_grad,
                                             accumulate_main_grad)
    return loss.reshape(target.shape) if opts.reduction == "none" else loss


def linear_log_probs(hidden, weight, target, bias=None, *, temperature=1.0, softcap=None, return_entropy=False,
                     ignore_index=-100, group=None, vocab_start=None, vocab_size=None, sequence_parallel=False,
                     backend="auto", validate=False):
    """Per-token ``log p(target)`` under ``softmax(softcap(hidden @ weight.T + bias) / temperature)``, and with
    ``return_entropy=True`` also the entropy of that distribution, without materializing the logits.

    Outputs have ``target``'s shape (fp32; fp64 for fp64 inputs on the torch backend); ignored targets give 0 for
    both. Gradients are exact for any upstream gradients on both outputs, sharded or not (the building block
    for PPO/GRPO-style losses). Vocab sharding, ``sequence_parallel``, ``vocab_size`` and ``validate`` work as in
    ``linear_cross_entropy``.
    """
    _check_int("ignore_index", ignore_index, allow_none=False)
    _check_number("temperature", temperature, low=0.0, low_open=True)
    _check_number("softcap", softcap, low=0.0, low_open=True, allow_none=True)
    if not isinstance(return_entropy, bool):
        raise TypeError(f"return_entropy: expected a bool, got {type(return_entropy).__name__}")
    h2, weight, bias, target, shard, backend, needs_grad, sp = _prepare(
        hidden, weight, target, bias, ignore_index=ignore_index, group=group, vocab_start=vocab_start,
        vocab_size=vocab_size, sequence_parallel=sequence_parallel, backend=backend, validate=validate)
    h2 = parallel.enter_vocab_parallel(h2, shard, sp)
    t1 = target.reshape(-1)
    if backend == "triton":
        from .triton_backend import TritonLinearLogProbs as Fn
    else:
        Fn = TorchLinearLogProbs
    out = Fn.apply(h2, weight, bias, t1, shard, None if softcap is None else float(softcap),
                   1.0 / float(temperature), int(ignore_index), return_entropy, needs_grad)
    if return_entropy:
        return out[0].reshape(target.shape), out[1].reshape(target.shape)
    return out.reshape(target.shape)


class LinearCrossEntropy(torch.nn.Module):
    """Module form of ``linear_cross_entropy``; options are validated once, at construction.

    ``forward(hidden, weight, target, bias=None, token_weight=None)``; the weight is passed in (not owned) so that a tied or
    Megatron-owned lm_head weight can be used as is.
    """

    def __init__(self, *, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0, softcap=None,
                 group=None, vocab_start=None, vocab_size=None, sequence_parallel=False, backend="auto",
                 memory_budget="auto", validate=False, accumulate_main_grad=False):
        super().__init__()
        self.options = make_options(ignore_index=ignore_index, reduction=reduction,
                                    label_smoothing=label_smoothing, z_loss=z_loss, softcap=softcap,
                                    memory_budget=memory_budget)
        if backend not in BACKENDS:
            raise ValueError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        _check_int("vocab_start", vocab_start, low=0)
        _check_int("vocab_size", vocab_size, low=1)
        self.group, self.vocab_start, self.vocab_size = group, vocab_start, vocab_size
        self.sequence_parallel, self.backend, self.validate = sequence_parallel, backend, validate
        self.accumulate_main_grad = accumulate_main_grad

    def forward(self, hidden, weight, target, bias=None, token_weight=None):
        return _linear_cross_entropy(hidden, weight, target, bias, self.options, token_weight=token_weight,
                                     group=self.group, vocab_start=self.vocab_start, vocab_size=self.vocab_size,
                                     sequence_parallel=self.sequence_parallel, backend=self.backend,
                                     validate=self.validate, accumulate_main_grad=self.accumulate_main_grad)

    def extra_repr(self) -> str:
        o = self.options
        return (f"reduction={o.reduction!r}, ignore_index={o.ignore_index}, label_smoothing={o.label_smoothing}, "
                f"z_loss={o.z_loss}, softcap={o.softcap}, backend={self.backend!r}, "
                f"memory_budget={o.memory_budget!r}, sharded={self.group is not None}")
