"""Vocab-parallel plumbing: shard ranges, the statistics exchange, and autograd-aware collectives.

Everything that talks to ``torch.distributed`` lives here, with an explicit ``group`` argument; the compute
backends (``vpce.torch_backend`` and the Triton kernels) never import ``torch.distributed`` themselves.

Vocab layout. The lm_head weight ``[V, D]`` is split by rows over the ranks of ``group``: rank ``r`` holds the
contiguous global ids ``[start_r, start_r + rows_r)``. Shards may be uneven. Rows whose global id is
``>= vocab_size`` are padding (Megatron's ``make_vocab_size_divisible_by``) and are excluded from the softmax.
By default ``start_r`` is the sum of the rows of lower ranks; learning it takes one small all-gather of the shard
sizes the first time a ``(group, rows)`` pair is seen, cached afterwards. Pass ``vocab_start`` and ``vocab_size``
explicitly to skip it (the Megatron integration does).

Statistics exchange. Per token chunk each rank has, over its valid rows, the local max ``m_r``, the local sum of
``exp(z - m_r)`` ``s_r``, a few additive sums (target logit, sum of logits) and, for the entropy, the weighted sum
``w_r = sum_j exp(z_j - m_r) z_j``. They are packed into one ``[k, chunk]`` fp32 tensor and exchanged with a
single all-gather; every rank then combines them identically::

    M = max_r m_r,  S = sum_r s_r exp(m_r - M),  lse = M + log S,  extra = sum_r extra_r,
    E[z] = sum_r w_r exp(m_r - M) / S

so every rank holds the same global ``lse`` and returns the same loss. One collective per chunk; O(chunk * k *
world) bytes; no logits or weights are ever gathered.

Overlap. ``exchange_packed`` starts the all-gather of a rank's packed statistics with an async work handle and
returns a ``PendingStats``; the Triton backend runs each chunk's GEMM as two halves so that the first half's
exchange runs under the second half's GEMM. ``combine_softmax_stats`` is the start-and-wait form.

Gradient of the hidden states. Each rank's backend produces only its vocab shard's contribution to ``dX``. On
the lean and torch routes the hidden states enter the vocab-parallel region through ``enter_vocab_parallel``:
identity in forward and an all-reduce of ``dX`` in backward (hidden replicated), or, with
``sequence_parallel=True``, an all-gather along dim 0 in forward and a reduce-scatter of ``dX`` in backward
(Megatron's sequence parallelism). The Triton fast route has each chunk's final ``dX`` rows in forward and sums
them there, overlapped with its dW GEMMs (``HiddenGradReduce``; SP input through ``gather_sequence``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

__all__ = [
    "VocabShard",
    "resolve_shard",
    "combine_softmax_stats",
    "exchange_packed",
    "combine_packed",
    "PendingStats",
    "HiddenGradReduce",
    "gather_sequence",
    "enter_vocab_parallel",
    "group_rank_and_size",
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


def group_rank_and_size(group) -> tuple[int, int]:
    if group is None:
        return 0, 1
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("group: expected an initialized torch.distributed process group, got one while "
                         "torch.distributed is not initialized")
    return dist.get_rank(group), dist.get_world_size(group)


# torch >= 2.13 names these *_single and deprecates the *_tensor spellings that older releases have.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_tensor(out: torch.Tensor, x: torch.Tensor, *, group, async_op: bool = False):
    """Every rank's ``x`` concatenated along dim 0 into ``out`` (``world * x.shape[0]`` rows)."""
    return _ALL_GATHER(out, x.contiguous(), group=group, async_op=async_op)


def reduce_scatter_tensor(out: torch.Tensor, x: torch.Tensor, *, group):
    """The sum over ranks of ``x``, this rank's ``out.shape[0]`` rows of it into ``out``."""
    return _REDUCE_SCATTER(out, x.contiguous(), group=group)


_SHARD_ROWS: dict[tuple[int, int], tuple[int, ...]] = {}


def _all_shard_rows(group, rows: int, device: torch.device) -> tuple[int, ...]:
    """Rows of every rank's shard: one all-gather of a single int, cached per (group, rows)."""
    key = (id(group), rows)
    hit = _SHARD_ROWS.get(key)
    if hit is None:
        world = dist.get_world_size(group)
        dev = device if dist.get_backend(group) != "gloo" else torch.device("cpu")
        mine = torch.tensor([rows], dtype=torch.int64, device=dev)
        every = torch.empty(world, dtype=torch.int64, device=dev)
        all_gather_tensor(every, mine, group=group)
        hit = tuple(int(v) for v in every.tolist())
        _SHARD_ROWS[key] = hit
    return hit


def resolve_shard(group, rows: int, vocab_start: int | None, vocab_size: int | None,
                  device: torch.device) -> VocabShard:
    """Build the ``VocabShard`` of this rank; validates ``vocab_start`` / ``vocab_size`` against the shards."""
    rank, world = group_rank_and_size(group)
    if world == 1 and vocab_start not in (None, 0):
        raise ValueError(f"vocab_start: expected None or 0 when the vocab is not sharded (group of one rank), "
                         f"got {vocab_start}")
    if world == 1:
        size = rows if vocab_size is None else vocab_size
        if size > rows:
            raise ValueError(f"vocab_size: expected at most the weight's {rows} rows, got {size}")
        return VocabShard(group if world > 1 else None, 0, 1, 0, rows, size)
    if vocab_start is None or vocab_size is None:
        every = _all_shard_rows(group, rows, device)
        total = sum(every)
        start = sum(every[:rank]) if vocab_start is None else vocab_start
        size = total if vocab_size is None else vocab_size
        if size > total:
            raise ValueError(f"vocab_size: expected at most the {total} rows of all shards together, got {size}")
    else:
        start, size = vocab_start, vocab_size
    return VocabShard(group, rank, world, start, rows, size)


def combine_packed(every: torch.Tensor, n_sums: int) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's packed statistics ``[W, R, C]`` (rows: max, sum of exp, ``n_sums`` additive statistics, then
    the weighted sums) -> ``(lse, sums, expectations)``; the same bytes in the same order on every rank."""
    m_all, s_all = every[:, 0], every[:, 1]
    m = m_all.amax(0)
    # Ranks with m_r = -inf contribute exp(-inf) * 0 = 0; a rank with m_r = +inf or NaN makes lse NaN.
    rescale = torch.exp(m_all - m)
    s = (s_all * rescale).sum(0)
    expect = [(every[:, 2 + n_sums + i] * rescale).sum(0) / s for i in range(every.shape[1] - 2 - n_sums)]
    return m + torch.log(s), [every[:, 2 + i].sum(0) for i in range(n_sums)], expect


class PendingStats:
    """One token chunk's softmax statistics on their way to every rank of the group (an async all-gather);
    ``wait()`` gives the global ``(lse, sums, expectations)``. Work queued between the exchange and ``wait()``
    (the next chunk's GEMM) overlaps the collective: on NCCL ``wait()`` only orders the streams, no host sync."""

    def __init__(self, every: torch.Tensor, n_sums: int, work=None, combine=combine_packed):
        self.every, self.n_sums, self.work, self.combine = every, n_sums, work, combine

    def wait(self) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.combine(self.every, self.n_sums)


def exchange_packed(packed: torch.Tensor, n_sums: int, shard: VocabShard, combine=combine_packed) -> PendingStats:
    """Start the exchange of this rank's packed ``[R, C]`` statistics (see ``combine_packed`` for the rows): one
    async all-gather under a group; ``combine`` (a backend's fused form of ``combine_packed``) runs in ``wait``."""
    if not shard.sharded:
        return PendingStats(packed.unsqueeze(0), n_sums, combine=combine)
    out = packed.new_empty((shard.world * packed.shape[0],) + tuple(packed.shape[1:]))
    work = all_gather_tensor(out, packed, group=shard.group, async_op=True)
    return PendingStats(out.view((shard.world,) + tuple(packed.shape)), n_sums, work, combine)


def combine_softmax_stats(local_max: torch.Tensor, local_sumexp: torch.Tensor, sums: list[torch.Tensor],
                          shard: VocabShard, weighted: list[torch.Tensor] = ()
                          ) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Global ``lse`` per token, the global value of each additive statistic in ``sums``, and the global
    softmax expectation of each statistic in ``weighted`` (given locally as ``sum_j exp(z_j - m_r) f_j``).

    ``local_max`` may be ``-inf`` (with ``local_sumexp == 0``) on a rank whose shard is all padding.
    NaN or inf in any rank's statistics propagates into ``lse``.
    """
    return exchange_packed(torch.stack([local_max, local_sumexp, *sums, *weighted]), len(sums), shard).wait()


def gather_sequence(hidden: torch.Tensor, shard: VocabShard) -> torch.Tensor:
    """Every rank's ``[N / world, D]`` slice concatenated along dim 0 (no autograd: see ``HiddenGradReduce``)."""
    out = hidden.new_empty((hidden.shape[0] * shard.world,) + tuple(hidden.shape[1:]))
    all_gather_tensor(out, hidden, group=shard.group)
    return out


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


def from_dtensors(hidden, weight, bias, target, *, group, vocab_start, vocab_size, sequence_parallel):
    """torchtitan-style inputs: a ``weight`` DTensor sharded ``Shard(0)`` on a 1-D mesh gives the group and this
    rank's ``vocab_start`` (``torch.chunk`` layout: ``ceil(V / world)`` rows per rank); ``bias`` must then be a
    DTensor of the same layout. ``hidden`` may be a DTensor ``Replicate()`` (hidden replicated) or ``Shard(0)``
    (sequence parallel); ``target`` a ``Replicate()`` DTensor. The local tensors come back; ``to_local`` carries
    the gradients back as DTensors with the same placements.
    """
    try:
        from torch.distributed.tensor import DTensor, Replicate, Shard
    except ImportError:  # pragma: no cover - torch without DTensor
        return hidden, weight, bias, target, group, vocab_start, vocab_size, sequence_parallel
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
