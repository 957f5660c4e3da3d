"""Vocab-parallel plumbing: the per-call agreement, shard ranges, the statistics exchange, and autograd-aware
collectives. The statistics themselves and their combine are ``vpce.rank_stats``: plain tensor math, which the
kernels share without importing this module.

Everything that talks to ``torch.distributed`` lives here, with an explicit ``group`` argument; the compute
backends (``vpce.backends.pytorch`` and the Triton kernels) never import ``torch.distributed`` themselves.
docs/design.md has the collective schedule of one call as a timeline.

Vocab layout. The lm_head weight ``[V, D]`` is split by rows over the ranks of ``group``: rank ``r`` holds the
contiguous global ids ``[start_r, start_r + rows_r)``. Shards may be uneven. Rows whose global id is
``>= vocab_size`` are padding (Megatron's ``make_vocab_size_divisible_by``) and are excluded from the softmax.
By default ``start_r`` is the sum of the rows of lower ranks and ``vocab_size`` the sum of all rows.

Agreement (``agree``). Every call under a group starts with exactly one collective, the same on every rank
whatever its arguments: an all-gather of a fixed-size int64 fingerprint of the call (shapes, dtypes, options,
the route, the shard's rows and claimed ``vocab_start``/``vocab_size``, a checksum and the range of the targets,
and any argument error this rank found, with its message; without ``vocab_start`` a checksum of the first weight
rows, and with ``validate=True`` one of the hidden states). Nothing is cached: no rank-local fact (a cache, an
import, a fallback flag) can change the number, order or size of collectives. Then:

* where a rank must read it on the host (CPU tensors, ``validate=True``, or a layout to learn because
  ``vocab_start`` or ``vocab_size`` was not given), every rank reads the same bytes and reaches the same verdict:
  either all go on, or all raise the same ``ValueError``/``TypeError`` naming the field and each rank's value.
  Two mistakes that no shape reveals are caught there too: the whole lm_head passed on every rank without
  ``vocab_start`` (equal, non-constant first rows on every rank: a sharded head's ranks hold different rows), and,
  with ``validate=True`` and no sequence parallelism, hidden states that differ between the ranks;
* otherwise (CUDA, layout given) nothing is read: the verdict is a device scalar, 0 or NaN, that the statistics
  combine adds to every token's max, so a disagreement makes the loss and gradients NaN on every rank and never a
  finite wrong value, with no host sync. That all-gather is left in flight (``PendingPoison``): the call's first
  GEMM, which needs nothing from the other ranks, starts beside it, and the first statistics combine waits for it
  on the stream (``PendingStats.wait``). The collectives and their order are the same as when it was awaited at
  once.

Statistics exchange. Per token chunk each rank packs its local softmax statistics into one ``[k, chunk]`` fp32
tensor (rows and the combine's formulas: ``vpce.rank_stats``) and exchanges them with one all-gather; every rank
combines them identically. One collective per chunk; no logits or weights are ever gathered.
``start_stats_exchange`` starts it with an async work handle; the Triton backend runs each chunk's GEMM as two
halves so that the first half's exchange runs under the second half's GEMM (the statistics epilogue's GEMM
runs the whole chunk in one launch, its statistics exchanged in the same halves: ``_ChunkStats.parts``).

Gradient of the hidden states. Each rank's backend produces only its vocab shard's contribution to ``dX``. Where
the call's plan says so (``vpce.routing``), the hidden states enter the vocab-parallel region through
``enter_vocab_parallel``: identity in forward and an all-reduce of ``dX`` in backward (hidden replicated), or,
with ``sequence_parallel=True``, an all-gather along dim 0 in forward and a reduce-scatter of ``dX`` in backward
(Megatron's sequence parallelism). The Triton fast route has each chunk's final ``dX`` rows in forward and sums
them there, overlapped with its dW GEMMs (``HiddenGradReduce``; SP input through ``gather_sequence``).
"""

from __future__ import annotations

import math
import struct
import sys
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from .double_backward import refuse_double_backward
from .rank_stats import RankStats, combine_rank_stats

__all__ = [
    "VocabShard",
    "CallFacts",
    "Agreement",
    "PendingPoison",
    "poison_value",
    "agree",
    "check_group",
    "group_rank_and_size",
    "end_process_group",
    "start_stats_exchange",
    "exchange_softmax_stats",
    "sum_over_ranks",
    "PendingStats",
    "HiddenGradReduce",
    "gather_sequence",
    "start_gather_sequence",
    "PendingGather",
    "enter_vocab_parallel",
    "dtensor_type",
    "from_dtensors",
    "all_gather_tensor",
    "reduce_scatter_tensor",
    "copy_to_vocab_parallel_region",
    "gather_from_sequence_parallel_region",
]


@dataclass(frozen=True)
class VocabShard:
    """Where this rank's weight rows sit in the global vocab."""

    group: Any
    """The process group the vocab is sharded over, or None when not sharded."""
    rank: int
    """This rank's index in ``group`` (0 when not sharded)."""
    world: int
    """Number of ranks in ``group`` (1 when not sharded)."""
    start: int
    """Global vocab id of this rank's first weight row."""
    rows: int
    """Rows of the local weight, padding included."""
    vocab_size: int
    """Real global vocab size; rows with global id >= vocab_size are padding."""

    @property
    def valid_rows(self) -> int:
        """Local rows that are real vocab entries (the first ``valid_rows`` rows)."""
        return max(0, min(self.rows, self.vocab_size - self.start))

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def columns_per_rank(self) -> int:
        """``ceil(vocab_size / world)``: the same on every rank, so chunk sizes derived from it agree."""
        return max(1, math.ceil(self.vocab_size / self.world))


def check_group(group) -> None:
    if group is None:
        return
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: expected an initialized torch.distributed process group, got one while "
                         "torch.distributed is not initialized")
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group: expected a torch.distributed.ProcessGroup or None, got {type(group).__name__}")


def group_rank_and_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    check_group(group)
    return dist.get_rank(group), dist.get_world_size(group)


# torch >= 2.13 names these *_single and deprecates the *_tensor spellings that older releases have.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def end_process_group(finished: bool) -> None:
    """Destroy the default process group (the launchers' and the bench's own), after a barrier where this rank
    ``finished`` its work, so that no rank tears the group down while a peer still uses it. No barrier on an error
    path, where a peer may never reach it. (A gloo rank's abort at exit after all its output, "terminate called
    without an active exception", came back with the barrier in place: ``vpce.bench.__main__`` says what the
    bench does about it.)"""
    if not dist.is_initialized():
        return
    if finished:
        dist.barrier()
    dist.destroy_process_group()


def all_gather_tensor(out: torch.Tensor, x: torch.Tensor, *, group, async_op: bool = False):
    """Every rank's ``x`` concatenated along dim 0 into ``out`` (``world * x.shape[0]`` rows)."""
    return _ALL_GATHER(out, x.contiguous(), group=group, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, x: torch.Tensor, *, group):
    """The sum over ranks of ``x``, this rank's ``out.shape[0]`` rows of it into ``out``."""
    return _REDUCE_SCATTER(out, x.contiguous(), group=group)


# ------------------------------------------------------------------------------------------------------------
# the per-call agreement


@dataclass(frozen=True)
class CallFacts:
    """What one rank knows about a call before any collective; every field but ``rows``, ``vocab_start`` and the
    target range must be equal on every rank. Values are ints (floats by their bit pattern, None as -1)."""

    entry: str = ""
    """Which public function (``"cross_entropy"``, ``"log_probs"``)."""
    fields: tuple[tuple[str, Any], ...] = ()
    """``(name, value)`` pairs that must agree: shapes, dtypes, options, the route."""
    rows: int = -1
    vocab_start: int | None = None
    vocab_size: int | None = None
    target: torch.Tensor | None = None
    """The (flattened) targets: their checksum must agree; their range is checked where the fingerprint is read."""
    ignore_index: int = -100
    error: Exception | None = None
    """An argument error this rank found; with a group, every rank raises it."""
    weight: torch.Tensor | None = None
    """This rank's weight shard where ``vocab_start`` was not given (the layout is learned): the checksum of its
    first rows tells a full lm_head passed on every rank from a sharded one."""
    hidden: torch.Tensor | None = None
    """The hidden states where ``validate=True`` and they must be the same on every rank (no sequence
    parallelism): their checksum must agree."""
    fast_fits: int | None = None
    """Only where the route is left to memory (``memory_budget="auto"`` on a long call): what fits in this rank's
    free device memory (``vpce.routing.FIT_LEAN``, ``FIT_FAST`` or ``FIT_WHOLE``). The agreement returns the
    smallest over the group."""


_EQUAL = ("call", "vocab_start given", "vocab_size", "host check")  # compared first, before ``fields``
_N_FIELDS = 40                       # slots for ``_EQUAL`` and ``fields``: a (type, payload) pair each
_MSG_WORDS = 32                      # 256 bytes of error message
# fingerprint layout: head, then the (type, payload) pairs, then the message words
_ERR, _ROWS, _START, _TSUM, _TMIN, _TMIN_AT, _TMAX, _TMAX_AT, _FITS, _WSUM, _WVARIED, _HSUM = range(12)
_HEAD = 12
_WEIGHT_ROWS = 4                     # rows of the weight checksummed (a full head repeated on every rank)
_BITS = {2: torch.int16, 4: torch.int32, 8: torch.int64}
_ERROR_TYPES = {1: ValueError, 2: TypeError}
_NONE, _INT, _FLOAT, _STR, _LONG_STR = range(5)


def _encode(value) -> tuple[int, int]:
    """A field value as (type, int64 payload); ``_decode`` reads it back the same way on every rank."""
    if value is None:
        return _NONE, 0
    if isinstance(value, (bool, int)):
        return _INT, int(value)
    if isinstance(value, float):
        return _FLOAT, struct.unpack("<q", struct.pack("<d", value))[0]
    raw = str(value).encode()
    if len(raw) <= 8:
        return _STR, int.from_bytes(raw.ljust(8, b"\0"), "little", signed=True)
    code = 1469598103934665603
    for byte in raw:  # FNV-1a: the same in every process (str hashes are salted per process)
        code = ((code ^ byte) * 1099511628211) % 2**63
    return _LONG_STR, code


def _decode(kind: int, payload: int) -> str:
    if kind == _NONE:
        return "None"
    if kind == _FLOAT:
        return repr(struct.unpack("<d", struct.pack("<q", payload))[0])
    if kind == _STR:
        return repr(payload.to_bytes(8, "little", signed=True).rstrip(b"\0").decode(errors="replace"))
    if kind == _LONG_STR:
        return f"<string #{payload % 10**6:06d}>"
    return str(payload)


def _checksum(x: torch.Tensor) -> torch.Tensor:
    """An int64 checksum of a 2-D float tensor's bits, the same on any rank that holds the same values, and
    changed by an edit of any element or by moving a row or a column; no copy of ``x`` is made."""
    bits = x.detach().view(_BITS[x.element_size()])
    pos = lambda n: torch.arange(n, device=x.device, dtype=torch.int64) % 65521 + 1  # noqa: E731
    rows = bits.sum(dim=1, dtype=torch.int64)
    cols = bits.sum(dim=0, dtype=torch.int64)
    return (rows * pos(rows.numel())).sum() + 7 * (cols * pos(cols.numel())).sum()


def _fingerprint(facts: CallFacts, device: torch.device, read: bool) -> torch.Tensor:
    pairs = [facts.entry, facts.vocab_start is not None, facts.vocab_size, read]
    pairs = [_encode(v) for v in pairs] + [_encode(v) for _, v in facts.fields]
    if len(pairs) > _N_FIELDS:
        raise RuntimeError(f"vpce: {len(pairs)} agreement fields, room for {_N_FIELDS}")
    pairs += [(_NONE, 0)] * (_N_FIELDS - len(pairs))
    head = [0] * _HEAD
    msg = [0] * _MSG_WORDS
    if facts.error is not None:
        head[_ERR] = 2 if isinstance(facts.error, TypeError) else 1
        raw = str(facts.error).encode()[: 8 * _MSG_WORDS].ljust(8 * _MSG_WORDS, b"\0")
        msg = [int.from_bytes(raw[8 * i: 8 * i + 8], "little", signed=True) for i in range(_MSG_WORDS)]
    head[_ROWS] = facts.rows
    head[_START] = -1 if facts.vocab_start is None else facts.vocab_start
    head[_FITS] = -1 if facts.fast_fits is None else int(facts.fast_fits)
    host = torch.tensor(head + [x for pair in pairs for x in pair] + msg, dtype=torch.int64)
    out = host.to(device, non_blocking=True) if device.type == "cuda" else host
    t = facts.target
    if t is not None and facts.error is None and t.numel():
        t = t.reshape(-1).to(torch.int64)
        pos = torch.arange(t.numel(), device=t.device, dtype=torch.int64)
        out[_TSUM] = ((t + 7) * (pos % 65521 + 1)).sum()  # any edit of the targets changes it
        if read:
            keep = t != facts.ignore_index
            big = torch.iinfo(torch.int64).max
            lo = torch.where(keep, t, big)
            hi = torch.where(keep, t, -big)
            out[_TMIN], out[_TMIN_AT] = lo.min(), lo.argmin()
            out[_TMAX], out[_TMAX_AT] = hi.max(), hi.argmax()
    w = facts.weight
    if w is not None and facts.error is None and w.numel():
        w = w[:_WEIGHT_ROWS].reshape(-1, w.shape[-1])
        out[_WSUM] = _checksum(w)
        out[_WVARIED] = (w != w.reshape(-1)[0]).any()
    h = facts.hidden
    if h is not None and facts.error is None and h.numel():
        out[_HSUM] = _checksum(h.reshape(-1, h.shape[-1]))
    return out


class PendingPoison:
    """The agreement decided on the device, its all-gather still in flight: ``value()`` (first called by the first
    statistics combine, ``PendingStats.wait``) orders the stream after it and gives the 0-d fp32 poison scalar, 0 or
    NaN where the ranks disagreed. No host sync."""

    def __init__(self, work, every: torch.Tensor, vocab_size: int | None, device: torch.device):
        self._work, self._every, self._vocab_size, self._device = work, every, vocab_size, device
        self._value = None

    def value(self) -> torch.Tensor:
        if self._value is None:
            if self._work is not None:
                self._work.wait()
                self._work = None
            every = self._every
            pairs = every[:, _HEAD:_HEAD + 2 * _N_FIELDS]
            bad = (pairs != pairs[:1]).any() | (every[:, _ERR] != 0).any()
            starts, order = every[:, _START].sort()
            ends = starts + every[:, _ROWS][order]
            bad = bad | (starts[0] != 0) | (starts[1:] != ends[:-1]).any() | (ends[-1] < (self._vocab_size or 0))
            self._value = torch.where(bad, math.nan, 0.0).to(device=self._device, dtype=torch.float32)
            self._every = None
        return self._value


def poison_value(poison) -> torch.Tensor | None:
    """The poison scalar of a call (``Agreement.poison``), waiting for the agreement where it is still in flight."""
    return poison.value() if isinstance(poison, PendingPoison) else poison


class Agreement(NamedTuple):
    shard: VocabShard
    poison: torch.Tensor | PendingPoison | None
    """A 0-d fp32 device scalar (0, or NaN where the ranks disagreed) to add to every token's max, the same still in
    flight (``PendingPoison``: the agreement decided on the device), or None."""
    fast_fits: int | None = None
    """The smallest ``CallFacts.fast_fits`` of the group (read on the host), or this rank's own without a group."""


def _layout_error(rows: list[int], starts: list[int], vocab_size: int) -> str | None:
    end = 0
    for start, n, r in sorted(zip(starts, rows, range(len(rows)))):
        if start != end:
            what = "overlaps the shard before it" if start < end else "leaves a gap after the shard before it"
            return (f"vocab_start: expected shards that tile [0, total rows) without gap or overlap, got rank {r}'s "
                    f"rows [{start}, {start + n}) which {what} (ending at {end}); starts by rank {starts}, "
                    f"rows by rank {rows}")
        end = start + n
    if vocab_size > end:
        return f"vocab_size: expected at most the {end} rows of all shards together, got {vocab_size}"
    return None


def agree(group, facts: CallFacts, device: torch.device, *, read: bool) -> Agreement:
    """Exchange this call's fingerprint (see the module docstring) and return this rank's ``VocabShard``.

    ``read``: decide on the host (every rank raises the same error on disagreement); else a poison scalar for
    the device. With no group there is nothing to exchange: ``facts.error`` is raised as it is.
    """
    rank, world = group_rank_and_size(group)
    if world == 1:
        if facts.error is not None:
            raise facts.error
        if facts.vocab_start not in (None, 0):
            raise ValueError(f"vocab_start: expected None or 0 when the vocab is not sharded (group of one rank), "
                             f"got {facts.vocab_start}")
        size = facts.rows if facts.vocab_size is None else facts.vocab_size
        if size > facts.rows:
            raise ValueError(f"vocab_size: expected at most the weight's {facts.rows} rows, got {size}")
        if read and facts.target is not None:
            _check_target_range(facts.target, facts.ignore_index, size)
        return Agreement(VocabShard(None, 0, 1, 0, facts.rows, size), None, facts.fast_fits)

    if dist.get_backend(group) == "gloo":
        dev = torch.device("cpu")
    else:  # NCCL needs CUDA tensors, even where this rank's arguments were not tensors at all
        dev = device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
    mine = _fingerprint(facts, dev, read)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=dev)
    work = all_gather_tensor(every, mine, group=group, async_op=not read)
    every = every.view(world, -1)

    if not read:  # decided on the device: no host sync, the all-gather left in flight beside the first GEMM
        if facts.error is not None:  # this rank cannot go on; the others see its error flag and turn NaN
            work.wait()  # its share of the all-gather done first (a process that exits at once would cut it)
            raise facts.error
        poison = PendingPoison(work, every, facts.vocab_size, device)
        return Agreement(VocabShard(group, rank, world, facts.vocab_start, facts.rows, facts.vocab_size), poison)

    host = every.cpu()
    err = host[:, _ERR].tolist()
    if any(err):
        r = next(i for i, e in enumerate(err) if e)
        raw = b"".join(int(w).to_bytes(8, "little", signed=True) for w in host[r, -_MSG_WORDS:].tolist())
        text = raw.rstrip(b"\0").decode(errors="replace")
        # the same text on every rank (the first failing rank's message), chained to this rank's own error
        raise _ERROR_TYPES[err[r]](f"{text} (found on rank {r} of the group; every rank raises it)") from facts.error
    names = [*_EQUAL, *(name for name, _ in facts.fields)]
    hp = host[:, _HEAD:_HEAD + 2 * _N_FIELDS].view(world, _N_FIELDS, 2)
    differ = (hp != hp[:1]).any(2).any(0).tolist()
    for i, bad in enumerate(differ):
        if bad:
            got = [_decode(int(k), int(v)) for k, v in hp[:, i].tolist()]
            raise ValueError(f"{names[i] if i < len(names) else 'field'}: expected the same value on every rank of "
                             f"the group, got {', '.join(got)} on ranks {', '.join(map(str, range(world)))}")
    rows = host[:, _ROWS].tolist()
    starts = host[:, _START].tolist() if facts.vocab_start is not None else \
        [sum(rows[:r]) for r in range(world)]
    size = sum(rows) if facts.vocab_size is None else facts.vocab_size
    msg = _layout_error(rows, starts, size)
    if msg is not None:
        raise ValueError(msg)
    if facts.target is not None and facts.target.numel():
        for r in range(world):  # every rank's targets against the agreed vocab: the first offender, on every rank
            lo, hi = int(host[r, _TMIN]), int(host[r, _TMAX])
            if lo < 0 or hi >= size:
                value, at = (lo, int(host[r, _TMIN_AT])) if lo < 0 else (hi, int(host[r, _TMAX_AT]))
                _raise_bad_target(facts.target, facts.ignore_index, size, value, at,
                                  f" on rank {r} of the group")
    if facts.weight is not None and facts.vocab_start is None:
        wsums, varied = host[:, _WSUM].tolist(), host[:, _WVARIED].tolist()
        if len(set(rows)) == 1 and len(set(wsums)) == 1 and all(varied):
            raise ValueError(f"weight: expected this rank's shard of the lm_head rows under a group of {world} ranks "
                             f"(vocab_start not given: each rank's rows follow those of the lower ranks), got the same "
                             f"{rows[0]} rows on every rank (a full lm_head on each rank?); pass each rank's own "
                             f"rows, with vocab_start and vocab_size where they are not stacked by rank")
    if facts.hidden is not None:
        hsums = host[:, _HSUM].tolist()
        if len(set(hsums)) > 1:
            raise ValueError(f"hidden: expected the same hidden states on every rank of the group (each rank computes "
                             f"every token's loss over its vocab shard; with sequence_parallel=True each passes its "
                             f"own slice), got different hidden states (checksums {hsums} on ranks 0..{world - 1})")
    sums = host[:, _TSUM].tolist()
    if any(s != sums[0] for s in sums):
        raise ValueError(f"target: expected the same targets on every rank of the group (each rank computes every "
                         f"token's loss), got different targets (checksums {sums} on ranks 0..{world - 1})")
    fits = host[:, _FITS].tolist()
    fast_fits = None if facts.fast_fits is None else min(fits)
    return Agreement(VocabShard(group, rank, world, starts[rank], rows[rank], size), None, fast_fits)


def _raise_bad_target(target: torch.Tensor, ignore_index: int, vocab_size: int, value: int, flat_at: int,
                      where: str = ""):
    pos = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat_at), tuple(target.shape)))
    raise ValueError(f"target: expected ids in [0, {vocab_size}) or ignore_index={ignore_index}, got {value} at "
                     f"index {pos}{where}")


def _check_target_range(target: torch.Tensor, ignore_index: int, vocab_size: int):
    """Eager range check (a host sync): ids in [0, vocab_size) or ignore_index."""
    bad = (target != ignore_index) & ((target < 0) | (target >= vocab_size))
    if bool(bad.any()):
        flat = int(bad.reshape(-1).nonzero()[0])
        _raise_bad_target(target, ignore_index, vocab_size, int(target.reshape(-1)[flat]), flat)


# ------------------------------------------------------------------------------------------------------------
# the statistics exchange


class PendingStats:
    """One token chunk's softmax statistics on their way to every rank of the group (an async all-gather);
    ``wait()`` gives the global ``RankStats``. Work queued between the exchange and ``wait()`` (the next chunk's
    GEMM) overlaps the collective: on NCCL ``wait()`` only orders the streams, no host sync."""

    def __init__(self, every: torch.Tensor, n_sums: int, combine: Callable, poison, work=None, extra=None):
        self.every, self.n_sums, self.combine, self.poison, self.work = every, n_sums, combine, poison, work
        self.extra = extra or {}

    def wait(self) -> RankStats:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.combine(self.every, self.n_sums, poison_value(self.poison), **self.extra)


def start_stats_exchange(packed: torch.Tensor, n_sums: int, shard: VocabShard, poison=None,
                         combine: Callable = combine_rank_stats, sum_sq: bool = False,
                         max_before: bool = False) -> PendingStats:
    """Start the exchange of this rank's packed ``[R, C]`` statistics (rows as in ``combine_rank_stats``): one
    async all-gather under a group; ``combine`` (``combine_rank_stats`` or a backend's fused form) runs in
    ``wait``. ``sum_sq`` and ``max_before`` ride in the same collective (metrics: no collective of their own)."""
    extra = {k: v for k, v in (("sum_sq", sum_sq), ("max_before", max_before)) if v}
    if not shard.sharded:
        return PendingStats(packed.unsqueeze(0), n_sums, combine, poison, extra=extra)
    out = packed.new_empty((shard.world * packed.shape[0],) + tuple(packed.shape[1:]))
    work = all_gather_tensor(out, packed, group=shard.group, async_op=True)
    return PendingStats(out.view((shard.world,) + tuple(packed.shape)), n_sums, combine, poison, work, extra)


def exchange_softmax_stats(packed: torch.Tensor, n_sums: int, shard: VocabShard, poison=None, sum_sq: bool = False,
                           max_before: bool = False) -> RankStats:
    """Exchange and combine at once (``start_stats_exchange(...).wait()``)."""
    return start_stats_exchange(packed, n_sums, shard, poison, sum_sq=sum_sq, max_before=max_before).wait()


class PendingSum:
    """``start_sum_over_ranks``'s all-gather in flight: ``wait()`` orders the current stream after it (that collective
    alone, not the ones queued after it) and returns the sum in rank order."""

    def __init__(self, every: torch.Tensor, world: int, work=None):
        self.every, self.world, self.work = every, world, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.every if self.world == 1 else self.every.view(self.world, -1).sum(0)


def start_sum_over_ranks(local: torch.Tensor, shard: VocabShard) -> PendingSum:
    """``sum_over_ranks`` started asynchronously: one all-gather of ``local`` (1-D, the same length on every rank)
    that runs beside what is queued before ``wait()``."""
    if not shard.sharded:
        return PendingSum(local, 1)
    out = local.new_empty(shard.world * local.numel())
    return PendingSum(out, shard.world, all_gather_tensor(out, local.contiguous(), group=shard.group, async_op=True))


def sum_over_ranks(local: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """The sum over the group of every rank's 1-D ``local`` (the same length on every rank): one all-gather, then
    a sum in rank order, so that every rank gets the same bytes (a reduction inside the collective need not).
    Used once per call for the class weights' per-token target weights and their total."""
    return start_sum_over_ranks(local, shard).wait()


# ------------------------------------------------------------------------------------------------------------
# the gradient of the hidden states


def gather_sequence(hidden: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Every rank's ``[N / world, D]`` slice concatenated along dim 0 (no autograd: see ``HiddenGradReduce``)."""
    return start_gather_sequence(hidden, shard).wait()


class PendingGather:
    """An all-gather in flight (``start_gather_sequence``): ``wait()`` orders the current stream after it and
    returns the gathered tensor."""

    def __init__(self, out: torch.Tensor, work):
        self.out, self.work = out, work

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.out


def start_gather_sequence(hidden: torch.Tensor, shard: VocabShard) -> PendingGather:
    """``gather_sequence`` without ordering the current stream after it yet, so that work queued before ``wait()``
    (the distillation's first student GEMM, under the teacher's gather) runs beside the collective."""
    out = hidden.new_empty((hidden.shape[0] * shard.world,) + tuple(hidden.shape[1:]))
    return PendingGather(out, all_gather_tensor(out, hidden, group=shard.group, async_op=True))


class HiddenGradReduce:
    """Sums a ``dX`` that is formed chunk by chunk in forward (the Triton fast route) over the group while later
    chunks compute: ``add(rows)`` starts an async all-reduce of those rows (hidden replicated) or, with sequence
    parallelism, an async reduce of each piece of them to the rank whose slice holds it; ``finish()`` orders the
    current stream after all of them and returns the summed ``dX`` (or this rank's slice).

    The loss's upstream gradient is applied afterwards, in backward: this assumes it is the same on every rank,
    as it is when each rank uses the (replicated) loss the same way.
    """

    def __init__(self, dx: torch.Tensor, shard: VocabShard, sequence_parallel: bool):
        self.dx, self.shard, self.sp = dx, shard, sequence_parallel
        self.local = dx.shape[0] // shard.world
        self.works = []

    def add(self, rows: slice):
        g = self.shard.group
        if not self.sp:
            self.works.append(dist.all_reduce(self.dx[rows], group=g, async_op=True))
            return
        a = rows.start
        while a < rows.stop:
            owner = a // self.local
            b = min(rows.stop, (owner + 1) * self.local)
            dst = dist.get_global_rank(g, owner)
            self.works.append(dist.reduce(self.dx[a:b], dst=dst, group=g, async_op=True))
            a = b

    def finish(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works = []
        if not self.sp:
            return self.dx
        r = self.shard.rank
        return self.dx[r * self.local:(r + 1) * self.local]


class _CopyToVocabParallel(torch.autograd.Function):
    """Identity in forward; all-reduce (sum) of the gradient over the group in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("copy_to_vocab_parallel_region")
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherSequenceParallel(torch.autograd.Function):
    """All-gather along dim 0 in forward; reduce-scatter of the gradient along dim 0 in backward."""

    @staticmethod
    def forward(ctx, x, group, world):
        ctx.group, ctx.world = group, world
        out = x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))
        all_gather_tensor(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("gather_from_sequence_parallel_region")
        grad = grad.contiguous()
        out = grad.new_empty((grad.shape[0] // ctx.world,) + tuple(grad.shape[1:]))
        reduce_scatter_tensor(out, grad, group=ctx.group)
        return out, None, None


def copy_to_vocab_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity in forward; the gradient is summed over ``group`` in backward (hidden states replicated)."""
    return _CopyToVocabParallel.apply(x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gather along dim 0 in forward; reduce-scatter of the gradient along dim 0 in backward."""
    return _GatherSequenceParallel.apply(x, group, dist.get_world_size(group))


def enter_vocab_parallel(hidden: torch.Tensor, shard: VocabShard, sequence_parallel: bool) -> torch.Tensor:
    """Hidden states as every rank of the group needs them, with the matching gradient collective."""
    if sequence_parallel and shard.sharded:
        return gather_from_sequence_parallel_region(hidden, shard.group)
    if shard.sharded and torch.is_grad_enabled() and hidden.requires_grad:
        return copy_to_vocab_parallel_region(hidden, shard.group)
    return hidden


def dtensor_type():
    """The ``DTensor`` class where ``torch.distributed.tensor`` is loaded in this process, else None: a tensor can
    only be a DTensor once that module is loaded, and importing it for the check (sympy, torch.fx) would add
    seconds to a process's first call."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


def from_dtensors(hidden, weight, bias, target, *, group, vocab_start, vocab_size, sequence_parallel):
    """torchtitan-style inputs: a ``weight`` DTensor sharded ``Shard(0)`` on a 1-D mesh gives the group and this
    rank's ``vocab_start`` (``torch.chunk`` layout: ``ceil(V / world)`` rows per rank); ``bias`` must then be a
    DTensor of the same layout. ``hidden`` may be a DTensor ``Replicate()`` (hidden replicated) or ``Shard(0)``
    (sequence parallel); ``target`` a ``Replicate()`` DTensor. The local tensors come back; ``to_local`` carries
    the gradients back as DTensors with the same placements.
    """
    DTensor = dtensor_type()
    if DTensor is None:  # no DTensor exists in this process
        return hidden, weight, bias, target, group, vocab_start, vocab_size, sequence_parallel
    from torch.distributed.tensor import Replicate, Shard

    if not isinstance(weight, DTensor):
        for name, t in (("hidden", hidden), ("bias", bias), ("target", target)):
            if isinstance(t, DTensor):
                raise ValueError(f"{name}: expected a plain tensor when weight is not a DTensor, got a DTensor")
        return hidden, weight, bias, target, group, vocab_start, vocab_size, sequence_parallel
    mesh = weight.device_mesh
    if mesh.ndim != 1 or tuple(weight.placements) != (Shard(0),):
        raise ValueError(f"weight: expected a DTensor sharded Shard(0) on a 1-D device mesh, got placements "
                         f"{tuple(weight.placements)} on a {mesh.ndim}-D mesh")
    mesh_group = mesh.get_group()
    if group is not None and group is not mesh_group:
        raise ValueError("group: expected None or the weight DTensor's mesh group, got another group")
    rows, world, rank = weight.shape[0], mesh.size(), mesh.get_local_rank()
    start = min(rank * -(-rows // world), rows)
    if vocab_start is not None and vocab_start != start:
        raise ValueError(f"vocab_start: expected None or {start} (the weight DTensor's layout), got {vocab_start}")
    if bias is not None:
        if not isinstance(bias, DTensor) or tuple(bias.placements) != (Shard(0),) or bias.device_mesh != mesh:
            raise ValueError("bias: expected a DTensor sharded Shard(0) on the weight's mesh (weight is a DTensor)")
        bias = bias.to_local()
    if isinstance(hidden, DTensor):
        if hidden.device_mesh != mesh or tuple(hidden.placements) not in ((Replicate(),), (Shard(0),)):
            raise ValueError(f"hidden: expected a DTensor Replicate() or Shard(0) on the weight's mesh, got "
                             f"{tuple(hidden.placements)}")
        sequence_parallel = sequence_parallel or tuple(hidden.placements) == (Shard(0),)
        hidden = hidden.to_local()
    if isinstance(target, DTensor):
        if tuple(target.placements) != (Replicate(),):
            raise ValueError(f"target: expected a Replicate() DTensor (every rank needs every target), got "
                             f"{tuple(target.placements)}")
        target = target.to_local()
    vocab_size = rows if vocab_size is None else vocab_size
    return hidden, weight.to_local(), bias, target, mesh_group, start, vocab_size, sequence_parallel
