"""The Triton backend's softmax losses (cross-entropy, log-probs, a loss of the log-probs): lm_head logits +
online-softmax statistics, exact gradients, two memory routes, on the engine's loops
(``vpce.backends.triton.engine``).

Fast route (default; cross-entropy with ``mean``/``sum`` and gradients), 6NDV. Per chunk of ``C`` tokens:

1. cuBLAS writes the chunk's logits ``P = X W^T (+ b)`` in the inputs' dtype (one rounding, as ``F.linear``);
   ``kernels.stored_logits`` (stats mode) reads them once for the per-tile row max / sum of exp (and the sums the
   loss options need), and ``kernels.target_logits`` computes each target logit in fp32 from ``X`` and ``W``;
2. per-row reduction of the tile statistics (``kernels.reduce_tiles``); under a group, one packed all-gather of
   (max, sum of exp but the target's, target logit, sum of logits) (``vpce.parallel``) and the combine
   (``kernels.combine_rank_stats``) give every rank the global ``RankStats``; the chunk runs as two halves so
   that the first half's all-gather overlaps the second half's GEMM (with the statistics epilogue one GEMM
   launch for the chunk, its statistics exchanged in the same halves);
3. ``kernels.stored_logits`` (grad mode) overwrites ``P`` with the gradient at unit upstream scale;
4. cuBLAS: ``dX[chunk] = dz @ W`` (fp32 out) and ``dW += dz.T @ X[chunk]`` into an fp32 accumulator; under a
   group the chunk's ``dX`` rows are summed over the group (async, under the dW GEMM; ``HiddenGradReduce``).

Why cuBLAS and two bandwidth passes rather than one fused GEMM with a softmax epilogue: per chunk they cost no
more than the fused GEMM plus the P -> gradient pass it needs, and less where the fused GEMM cannot hide its
epilogue (smaller D, a soft cap; docs/benchmarks.md). The logits are then rounded to the inputs' dtype before the
softmax, as in torch eager, torch.compile and quack; the target logit is not.

Backward scales the held ``dX``, ``dW``, ``db`` by the upstream gradient (and ``1/count`` for ``mean``) and casts
them in one pass. Memory: ``P`` (``C * V_local`` values; by default 2 GiB but at most the fp32 ``dW``
accumulator's size), the fp32 ``dW`` accumulator, fp32 ``dX``.

Lean route (``memory_budget="lean"``, ``reduction="none"``, and ``linear_log_probs``), 8NDV.
Forward runs the fused GEMM (``kernels.logits_tiles``) in stats mode only and keeps the global ``lse`` (and ``E[z]``
for the entropy) per token. Backward recomputes the gradient in blocks with the GEMM in grad mode
(``recompute_grads``; the one block loop ``engine.block_loop``), in the order that holds the smaller fp32 accumulator:
vocab-major while ``N <= V_local`` (each ``[N, Vb]`` block's dW in one GEMM over all tokens, no dW accumulator;
``dX += dz @ W[block]`` into fp32 ``[N, D]``), token-major beyond (each token block's dX finished before the next,
``dW += dz.T @ X[block]`` into fp32 ``[V_local, D]`` or straight into ``main_grad``), so the extra memory stops
growing with N. Memory: one block of the plan's ``block_gib`` (``routing.Sizing.lean_block_gib``) plus the smaller
of the two accumulators.

No-grad: the stats-mode fused GEMM over token chunks; O(N) memory beyond the small per-tile statistics.

The logits are rounded to the inputs' dtype once, as ``F.linear`` rounds them in plain PyTorch; everything after
is fp32. No host syncs, no atomics: every kernel writes each output element from one program.
"""

from __future__ import annotations

import math

import torch

from ... import kernels
from ...formulas.softmax import (Coefficients, RowStats, ce_coefficients, ce_token_outputs, evaluate_loss_fn,
                                 logprob_coefficients, logprob_part_outputs, loss_fn_coefficients,
                                 loss_fn_metric_outputs, store_metric_outputs)
from ...options import Folded, LogProbLossOptions, LogProbOptions, LossOptions
from ...parallel import PendingStats, gather_sequence, start_stats_exchange, start_sum_over_ranks
from ...rank_stats import RankStats
from ...routing import ROW_ALIGN, Call, plan_finish, round_to
from ...speculation import block_flags, split_upstream
from ...targets import TokenTargets
from ..gemm import logits_into, logits_with_stats
from ..grads import FastGrads, pad_rows, scaled, weight_grad_to_main
from .engine import block_loop, chunk_loop

__all__ = ["cross_entropy", "log_probs", "log_probs_formed", "log_prob_loss", "recompute_grads",
           "speculative_grads"]


class _ChunkStats:
    """Per-tile statistics buffers for a chunk of tokens, and the pass that turns them into global per-token
    statistics (one packed collective under a group).

    ``parts`` runs a chunk as sub-chunks: under a group each sub-chunk's exchange is started asynchronously and
    overlaps the next sub-chunk's GEMM; the results come back in order.
    """

    def __init__(self, rows: int, v: int, x: torch.Tensor, sum_z: bool, sum_ez: bool, class_weight=None,
                 sum_sq: bool = False, before: torch.Tensor | None = None, epilogue: bool = False,
                 group_entropy: bool = False):
        n_tiles = max(1, math.ceil(v / kernels.tile_n(x)))
        f32 = dict(dtype=torch.float32, device=x.device)
        # ``epilogue``: the fast route's logits GEMM takes the statistics itself
        # (``vpce.backends.gemm.logits_with_stats``, the hopper extra): one log-sum-exp per row and the share of it
        # outside the target column (``kernels.target_out_of_lse``), which the reduction takes as one tile
        self.epilogue = epilogue
        # there the entropy's sum and the argmax test's maxima come per tile from the gradient pass instead
        # (``grad_outputs``, then ``kernels.grad_metrics``), in one process. Under a group the entropy, where it is
        # an output only, comes from that pass on every rank, epilogue or not (``group_entropy``, a fact of the
        # options and the route that every rank shares): each rank's share of sum_j p_j z_j, summed over the group
        # once the chunks are done (``_GroupEntropy``), so that the ranks exchange the same statistics whichever of
        # them takes the epilogue; the argmax test stays one process's
        self.group_entropy = group_entropy
        self.padding = v == 0  # this rank's rows are all padding
        self.late_ez = sum_ez and (epilogue or group_entropy)
        self.late = self.late_ez or (epilogue and before is not None)
        self.m = torch.empty(rows, n_tiles, **f32) if not epilogue or before is not None else None
        self.s = torch.empty(rows, 1 if epilogue else n_tiles, **f32)
        self.z = torch.empty(rows, 1 if epilogue else n_tiles, **f32) if sum_z else None
        self.ez = torch.empty(rows, n_tiles, **f32) if sum_ez else None
        self.zt = torch.empty(rows, **f32)
        self.class_weight = class_weight if sum_z else None  # sum z becomes sum w_j z_j
        # metrics: log sum p^2, and (``before``: int32 per token, TokenTargets.before) whether the target is the argmax
        self.sq = torch.empty(rows, n_tiles, **f32) if sum_sq else None
        self.mb = torch.empty(rows, n_tiles, **f32) if before is not None else None
        self.before = before
        # the fast route's target logit as P holds it (rounded, beside its fp32 ``zt``): the argmax test compares
        # it with the other logits of P, so that ties are judged on equal terms, across ranks too
        self.zs = torch.empty(rows, **f32) if before is not None else None

    def _local(self, h, w, b, tl_local, sl: slice, r: slice, call: Call, folded: Folded, p, ready=False):
        """Kernel and local reduction for tokens ``sl`` into buffer rows ``r``: this rank's packed statistics
        ``[k, rows]`` (``start_stats_exchange``). ``ready``: the logits of ``p`` are already written
        (``first_logits``)."""
        n_sums = 1 if self.z is not None else 0
        cut = lambda t: None if t is None else t[r]  # noqa: E731
        if call.shard.valid_rows > 0 and self.epilogue:  # P, the statistics and the fp32 target logit: one GEMM
            zt = self.zt[r]
            lse, sum_z = logits_with_stats(p, h[sl], w, tl_local[sl], zt, folded, self.z is not None,
                                           self.class_weight)
            kernels.target_out_of_lse(lse, zt, self.s[r].view(-1), p.dtype, folded=folded,
                                      zs=None if self.zs is None else self.zs[r])
            return kernels.reduce_tiles(lse[:, None], self.s[r], None if sum_z is None else sum_z[:, None], None, zt)
        if call.shard.valid_rows > 0:
            zt, zs = self.zt[r], None
            ez = None if self.late_ez else cut(self.ez)
            stats = dict(folded=folded, tile_m=self.m[r], tile_s=self.s[r], tile_z=cut(self.z),
                         tile_ez=ez, zt=zt, class_weight=self.class_weight, tile_sq=cut(self.sq),
                         tile_mb=cut(self.mb), before=None if self.before is None else self.before[sl])
            if p is not None:
                # the fast route: cuBLAS writes the logits into P (the bias added before the one rounding, as
                # F.linear does), one bandwidth pass takes their statistics, the target logit comes in fp32
                if not ready:
                    logits_into(p, h[sl], w, b)
                kernels.stored_logits(p, None, tl_local[sl], **stats)
                zs = None if self.zs is None else self.zs[r]
                kernels.target_logits(h[sl], w, b, tl_local[sl], zt, folded=folded, logits=p, zs=zs)  # every row
            else:
                zt.fill_(-math.inf)  # stored by the tile that holds the target, if any
                kernels.logits_tiles(h[sl], w, b, tl_local[sl], **stats)
            packed = kernels.reduce_tiles(self.m[r], self.s[r], cut(self.z), ez, zt, cut(self.sq), cut(self.mb), zs)
        else:  # this rank's rows are all padding: no max, no target, every sum 0
            top1 = 2 * (self.mb is not None)  # max before the target, the target logit
            exchanged_ez = self.ez is not None and not self.late_ez
            packed = torch.zeros(3 + n_sums + exchanged_ez + (self.sq is not None) + top1,
                                 sl.stop - sl.start, dtype=torch.float32, device=h.device)
            packed[0] = packed[2] = -math.inf
            if top1:
                packed[-2:] = -math.inf
        return packed

    def _exchange(self, packed: torch.Tensor, call: Call) -> PendingStats:
        """Start the exchange of ``_local``'s packed statistics. The epilogue's carry no metrics' rows (those come
        from the gradient pass, ``late``; under a group the argmax test keeps the statistics pass, and the entropy,
        where ``group_entropy``, is exchanged after the gradient pass instead, ``_GroupEntropy``)."""
        metrics = not self.epilogue
        return start_stats_exchange(packed, 1 if self.z is not None else 0, call.shard, call.poison,
                                    combine=kernels.combine_rank_stats, sum_sq=metrics and self.sq is not None,
                                    max_before=metrics and self.mb is not None)

    def grad_outputs(self, part: slice, r: slice) -> dict:
        """What the gradient pass of tokens ``part`` (buffer rows ``r``) also fills where the metrics come from it
        (``late``): per tile the entropy's sum and the argmax test's maxima; else nothing."""
        if not self.late:
            return {}
        return dict(tile_ez=self.ez[r] if self.late_ez else None, tile_m=self._top1(self.m, r),
                    tile_mb=self._top1(self.mb, r), before=self._top1(self.before, part))

    def _top1(self, t, r):
        """Rows ``r`` of an argmax-test buffer where the gradient pass takes that test (beside the epilogue)."""
        return None if t is None or not self.epilogue else t[r]

    def grad_metrics(self, r: slice, st: RankStats):
        """``(entropy, argmax indicator)`` of buffer rows ``r`` after their gradient pass (``late``), None for
        what is not asked; under a group (``group_entropy``) this rank's share of the entropy's sum in its place."""
        if self.padding:  # no gradient pass: no share of the sums (only under a group, ``group_entropy``)
            return torch.zeros(r.stop - r.start, dtype=torch.float32, device=self.zt.device), None
        return kernels.grad_metrics(st.lse, self.zt[r], tile_ez=self.ez[r] if self.late_ez else None,
                                    tile_m=self._top1(self.m, r), tile_mb=self._top1(self.mb, r),
                                    zs=self._top1(self.zs, r), partial=self.group_entropy)

    @staticmethod
    def _cuts(c: int, call: Call) -> list[int]:
        """Where a chunk of ``c`` tokens is cut into parts, each with its own exchange. Under a group, two halves:
        cuBLAS's logits and the statistics pass run per half, so that the first half's exchange hides behind the
        second half's GEMM. The cuts depend only on what every rank agrees on (the chunk, the group), never on a
        rank's route (``epilogue``), so every rank runs the same exchanges."""
        if call.shard.sharded and c >= 4 * ROW_ALIGN:
            return [0, round_to(c // 2, ROW_ALIGN), c]
        return [0, c]

    @staticmethod
    def first_logits(p, h, w, b, chunk: int, call: Call):
        """The fast route's first GEMM (the first sub-chunk's logits into ``p``), launched before the rest of the
        forward's set-up so that the GPU starts at once; ``parts(..., ready=True)`` then skips it."""
        first = _ChunkStats._cuts(min(chunk, h.shape[0]), call)[1]
        logits_into(p[:first], h[:first], w, b)

    def parts(self, h, w, b, tl_local, sl: slice, call: Call, folded: Folded, p=None, ready=False):
        """Yield ``(part, rows, RankStats)`` for the sub-chunks of tokens ``sl`` (global statistics); ``rows``:
        the part's rows in the chunk buffers (and in ``p``, the fast route's P). ``ready``: ``first_logits``
        wrote the first sub-chunk's logits."""
        cuts = self._cuts(sl.stop - sl.start, call)
        whole = None
        if self.epilogue:
            # the statistics GEMM runs the whole chunk in one launch, its statistics then exchanged in the same
            # parts: with a launch per half the first half's exchange did not run beside the second's GEMM anyway
            # (it got an SM only as that persistent GEMM ended), and one launch is faster (docs/benchmarks.md)
            whole = self._local(h, w, b, tl_local, sl, slice(0, sl.stop - sl.start), call, folded, p)
        pending = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            part, r = slice(sl.start + lo, sl.start + hi), slice(lo, hi)
            if whole is None:
                packed = self._local(h, w, b, tl_local, part, r, call, folded, None if p is None else p[r],
                                     ready=ready and lo == 0)
            else:  # the part's columns of the whole chunk's statistics
                packed = whole if hi - lo == whole.shape[1] else whole[:, lo:hi].contiguous()
            pending.append((part, r, self._exchange(packed, call)))
        for part, r, pend in pending:
            yield part, r, pend.wait()


class _GroupEntropy:
    """The entropy of every token under a group where it is an output only and the gradient pass takes it
    (``_ChunkStats.group_entropy``): each part's ``lse`` as its statistics come, and after the part's gradient pass
    this rank's share of ``sum_j p_j z_j`` (0 on an all-padding shard, which has none) starts on its way to every
    rank (``add``: one async all-gather of the part's ``[C]`` fp32 on every rank, in the parts' order, the same
    collectives whichever rank takes the epilogue). ``total()`` waits for them once the chunks are done and
    sums each part's shares in rank order (``parallel.start_sum_over_ranks``: the same bytes on every rank):
    ``lse - sum``. A part's all-gather is queued before its dX sum, so waiting for it never waits for dX's. Every
    rank of a group takes this path or none (it depends only on the options, the route and the group)."""

    def __init__(self, n: int, device, shard):
        self.lse = torch.empty(n, dtype=torch.float32, device=device)
        self.shard, self.pending = shard, []

    def add(self, part: slice, share: torch.Tensor):
        self.pending.append((part, start_sum_over_ranks(share, self.shard)))

    def total(self) -> torch.Tensor:
        ent = torch.empty_like(self.lse)
        for part, pending in self.pending:
            ent[part] = self.lse[part] - pending.wait()
        self.pending = []
        return ent


class _SoftmaxBlocks:
    """The softmax losses' block step: the fused GEMM in grad mode (``kernels.logits_tiles``) recomputes a block's
    logits and writes their gradient for the per-token ``coef`` into one ``[N_b, V_b]`` buffer."""

    buffers = 1

    def __init__(self, hidden, weight, bias, tg: TokenTargets, rows: RowStats, coef: Coefficients, folded: Folded):
        self.weight, self.bias, self.rows, self.coef = weight, bias, rows, coef
        self.folded = folded
        self.tl_local = tg.local_columns()
        self.cw = None if tg.class_weight is None else tg.class_weight.columns.float()
        self.align = kernels.tile_n(hidden)
        self.like = hidden

    def alloc(self, nb, vb, n, v):
        self.buf = torch.empty(nb, vb, dtype=self.like.dtype, device=self.like.device) if n and v else None

    def tokens(self, tok):
        r = self.rows.rows(tok)
        return (r.m, r.lse, r.q), self.coef.rows(tok)

    def block(self, h, tok, per_tok, v0, v1):
        rows, coef = per_tok
        gz = self.buf[: tok.stop - tok.start, : v1 - v0]
        kernels.logits_tiles(h, self.weight[v0:v1], None if self.bias is None else self.bias[v0:v1],
                             self.tl_local[tok] - v0, folded=self.folded, p=gz, rows=rows,
                             coef=coef, class_weight=None if self.cw is None else self.cw[v0:v1])
        return gz


def recompute_grads(hidden, weight, bias, tg: TokenTargets, rows: RowStats, coef: Coefficients, call: Call,
                    main_weight=None):
    """dX, dW and db of the softmax losses from the logits recomputed in blocks (grad mode) for any per-token
    ``coef`` (``engine.block_loop``); ``main_weight``: add dW in fp32 into its ``main_grad`` instead of returning it."""
    hidden = hidden.contiguous()
    step = _SoftmaxBlocks(hidden, weight, bias, tg, rows, coef, call.plan.folded)
    return block_loop(hidden, weight, bias, call, step, main_weight)


def _softmax_step(hidden, w, b, tl_local, stats: _ChunkStats, p, call: Call, folded: Folded, cw, on_part,
                  on_chunk=None, on_grad=None):
    """The softmax losses' chunk step for ``engine.chunk_loop``: the chunk's statistics (``stats.parts``, in sub-chunks
    whose exchanges overlap), then per part ``on_part(part, stats)``, which stores the part's outputs and returns
    its gradient ``Coefficients`` (the per-loss seam: the cross-entropy's, the log-probs', or a loss of the
    log-probs and the entropy computed while the logits are live), and ``kernels.stored_logits`` in grad mode
    overwrites the part's logits in ``p`` with the gradient. ``on_chunk(sl, [(part, rows, stats), ...])`` instead
    of ``on_part``: every part's coefficients at once, once the whole chunk's statistics are in (a loss over whole
    rows of tokens, such as a sequence-level importance ratio). Without ``p`` (the lean route's and the no-grad
    forward's stats-only launches: ``engine.chunk_loop`` without ``form``), the fused GEMM takes the statistics and
    ``on_part`` only stores the outputs. ``on_grad(part, rows, stats)``: after each part's gradient pass (the
    outputs that pass gives, ``_ChunkStats.grad_outputs``; on an all-padding shard too, which has no such pass)."""

    def step(sl: slice, first: bool):
        # the chunk's rows of P: its own rows where P holds every token (``routing.one_weight_grad_gemm``), else the
        # first rows of a P of one chunk
        pc = None if p is None else p[sl] if p.shape[0] >= sl.stop else p[: sl.stop - sl.start]
        parts = stats.parts(hidden, w, b, tl_local, sl, call, folded, p=pc, ready=first)
        if on_chunk is None:  # each part's coefficients as its statistics come (lazily: in order)
            ready = ((part, r, st, on_part(part, st)) for part, r, st in parts)
        else:
            got = list(parts)
            ready = [(part, r, st, co) for (part, r, st), co in zip(got, on_chunk(sl, got))]
        for part, r, st, co in ready:
            if pc is not None:
                kernels.stored_logits(pc[r], None, tl_local[part], folded=folded,
                                      rows=(st.m, st.lse, st.q), coef=co, class_weight=cw,
                                      **stats.grad_outputs(part, r))  # in place
            if on_grad is not None:  # every rank, an all-padding shard too (``_GroupEntropy`` exchanges there)
                on_grad(part, r, st)
        return pc
    return step


def _first_chunk(hidden, w, b, call: Call, early: bool = True, every_token: bool = False):
    """``(P, chunk)`` of the fast and speculative routes, the first chunk's logits GEMM already launched
    (``early``; not where the GEMM takes the statistics too, ``_ChunkStats(epilogue=True)``: it needs the
    targets). ``every_token``: P holds every token's row, not one chunk's (``routing.one_weight_grad_gemm``)."""
    n = hidden.shape[0]
    v = call.shard.valid_rows
    chunk = min(max(n, 1), call.plan.sizes.chunk)
    p = None
    if v > 0:
        p = torch.empty(n if every_token else chunk, v, dtype=hidden.dtype, device=hidden.device)
        if n > 0 and early:
            _ChunkStats.first_logits(p, hidden, w, b, chunk, call)
    return p, chunk


def _fast_operands(hidden, weight, bias, call: Call):
    """``(hidden, weight, bias)`` as a forward chunk loop reads them: every token of the group's sequence where the
    fast route sums dX in forward under sequence parallelism (gathered here), contiguous, and this rank's valid
    vocab rows only."""
    if call.plan.dx_reduce == "forward" and call.plan.sequence_parallel:
        hidden = gather_sequence(hidden, call.shard)
    v = call.shard.valid_rows
    return hidden.contiguous(), weight[:v], None if bias is None else bias[:v]


def cross_entropy(hidden, weight, bias, tg: TokenTargets, opts: LossOptions, call: Call):
    """Per-token loss ``[N]`` (weighted, 0 on ignored tokens), and what backward needs: the fast route's
    unscaled ``FastGrads`` (with ``dx_reduce == "forward"``: already summed over the group, this rank's slice
    under sequence parallelism), the lean route's ``RowStats``, or both (the speculative route)."""
    shard, plan = call.shard, call.plan
    hidden, w, b = _fast_operands(hidden, weight, bias, call)
    n, d = hidden.shape
    dev = hidden.device
    v = shard.valid_rows
    formed = plan.route in ("fast", "speculative")
    smooth = opts.label_smoothing > 0
    # how the gradients are finished, decided once (``routing.plan_finish``) from this call's facts: whether the
    # hopper extra takes P's GEMMs, and the statistics in the logits GEMM's epilogue. With one process the entropy
    # and the argmax test then come from the gradient pass (``_ChunkStats.late``); under a group the entropy does on
    # the fast route on every rank, epilogue or not (``_GroupEntropy``). Under a group the epilogue's GEMM starts
    # after the set-up (it needs the targets), not before it as cuBLAS's first GEMM does; the statistics exchanged
    # are the same tensor either way, so the choice is no collective's.
    folded = call.plan.folded
    fin = plan_finish(call, opts, hidden, w, b is not None)
    epilogue, one_dw = fin.epilogue, fin.one_dw
    if formed:
        p, chunk = _first_chunk(hidden, w, b, call, early=not epilogue, every_token=one_dw)
    tl_local = tg.local_columns()
    cw = None if tg.class_weight is None else tg.class_weight.columns.float()
    loss_tok = torch.empty(n, dtype=torch.float32, device=dev)
    entropy = "entropy" in opts.metrics
    before = tg.before.to(torch.int32) if "token_accuracy" in opts.metrics else None
    metrics = {k: torch.empty(n, dtype=torch.float32, device=dev) for k in opts.metrics}
    tg.metrics = metrics
    if opts.token_scaling:
        tg.scaling = torch.empty(n, dtype=torch.float32, device=dev)
    keep = plan.route in ("lean", "speculative")
    rows = RowStats.empty(n, torch.float32, dev) if keep else None
    unit = tg.row_scale(torch.ones((), device=dev).expand(n)) if formed else None
    if fin.fold_mean:  # dX in the hidden's dtype in forward: backward's scale is the upstream gradient alone
        unit = unit / tg.denominator(torch.float32)

    group = _GroupEntropy(n, dev, shard) if entropy and plan.route == "fast" and shard.sharded else None
    # from the gradient pass (``on_grad``)
    late = ("entropy", "token_accuracy") if epilogue else ("entropy",) if group is not None else ()

    def on_part(part, st):
        ce_token_outputs(st, opts, shard.vocab_size, tg, part, loss_tok, metrics, skip=late)
        if group is not None:
            group.lse[part] = st.lse
        if keep:
            rows.store(part, st)
        if not formed:
            return None
        scale = unit[part] if tg.scaling is None else unit[part] * tg.scaling[part]
        return ce_coefficients(scale, st.lse, opts, shard.vocab_size, tg.class_rows(part))

    if not formed:  # stats-only launches
        p, chunk = None, min(max(n, 1), plan.sizes.chunk)
    stats = _ChunkStats(chunk, v, hidden, smooth, entropy, cw, before=before, epilogue=epilogue,
                        group_entropy=group is not None)

    def on_grad(part, r, st):
        ent, top = stats.grad_metrics(r, st)
        if group is not None:
            group.add(part, ent)
        elif ent is not None:
            metrics["entropy"][part] = tg.metric(ent, part)
        if top is not None:
            metrics["token_accuracy"][part] = tg.metric(top, part)

    step = _softmax_step(hidden, w, b, tl_local, stats, p, call, folded, cw, on_part,
                         on_grad=on_grad if stats.late else None)
    grads = chunk_loop(hidden, w, b, chunk, call, step, form=formed, finish=fin, whole_p=p if one_dw else None)
    if group is not None:
        metrics["entropy"] = tg.metric(group.total(), slice(None))
    return loss_tok, rows, None if grads is None else grads._replace(mean_folded=fin.fold_mean)


def log_probs(hidden, weight, bias, tg: TokenTargets, lp: LogProbOptions, call: Call) -> RankStats:
    """Global statistics of every token for ``linear_log_probs`` (the lean route: backward recomputes)."""
    n = hidden.shape[0]
    hidden = hidden.contiguous()
    v = call.shard.valid_rows
    w = weight[:v]
    b = None if bias is None else bias[:v]
    tl_local = tg.local_columns()
    chunk = min(max(n, 1), call.plan.sizes.chunk)  # stats-only launches
    stats = _ChunkStats(chunk, v, hidden, lp.mean_logits, lp.entropy, sum_sq=lp.log_sum_sq,
                        before=tg.before.to(torch.int32) if lp.top1 else None)
    parts = []
    step = _softmax_step(hidden, w, b, tl_local, stats, None, call, call.plan.folded, None,
                         lambda _, st: parts.append(st))
    chunk_loop(hidden, w, b, chunk, call, step, form=False)
    return RankStats.cat(parts, int(lp.mean_logits), int(lp.entropy), hidden.new_empty(0, dtype=torch.float32),
                         lp.log_sum_sq, lp.top1)


def log_probs_formed(hidden, weight, bias, tg: TokenTargets, lp: LogProbOptions, call: Call):
    """``linear_log_probs`` on the speculative route (one process; no entropy gradient): the fast route's chunk
    loop at unit upstream gradient on ``log p_t`` of every non-ignored token. Returns the global statistics of
    every token (``RankStats``, as ``log_probs``), the ``RowStats`` the fallback needs, and the unit-scale
    ``FastGrads``."""
    n = hidden.shape[0]
    dev = hidden.device
    hidden = hidden.contiguous()
    v = call.shard.valid_rows
    w = weight[:v]
    b = None if bias is None else bias[:v]
    p, chunk = _first_chunk(hidden, w, b, call)
    tl_local = tg.local_columns()
    ones = torch.ones(n, dtype=torch.float32, device=dev)
    unit = logprob_coefficients(tg, ones, None, None, call.plan.folded.inv_t, like=ones)
    rows = RowStats.empty(n, torch.float32, dev)
    stats = _ChunkStats(chunk, v, hidden, lp.mean_logits, lp.entropy, sum_sq=lp.log_sum_sq,
                        before=tg.before.to(torch.int32) if lp.top1 else None)
    parts = []

    def on_part(part, st):
        parts.append(st)
        rows.store(part, st)
        return unit.rows(part)

    step = _softmax_step(hidden, w, b, tl_local, stats, p, call, call.plan.folded, None, on_part)
    grads = chunk_loop(hidden, w, b, chunk, call, step)
    st = RankStats.cat(parts, int(lp.mean_logits), int(lp.entropy), hidden.new_empty(0, dtype=torch.float32),
                       lp.log_sum_sq, lp.top1)
    return st, rows, grads


def log_prob_loss(hidden, weight, bias, tg: TokenTargets, o: LogProbLossOptions, call: Call, inputs: dict):
    """``linear_log_prob_loss`` on the fast route: the chunk loop with ``loss_fn`` evaluated per part while the
    part's logits are live (``on_part``; scope ``"sequence"``: on the chunk's whole rows once all of its parts'
    statistics are in, ``on_chunk``), its per-token gradients the gradient pass's coefficients. Returns ``(loss,
    log_probs, entropy or None, FastGrads, metrics)`` (with ``dx_reduce == "forward"``: dX already summed over the
    group; ``metrics``: ``is_top1`` and ``mean_logits`` by name where ``o`` asks, from the same statistics)."""
    shard = call.shard
    hidden, w, b = _fast_operands(hidden, weight, bias, call)
    n, d = hidden.shape
    dev = hidden.device
    v = shard.valid_rows
    # finished as the cross-entropy's fast route is (``routing.plan_finish``); the statistics in the logits GEMM's
    # epilogue only where the loss needs no other statistic before its gradient pass (an entropy that is only an
    # output then comes from that pass, ``_ChunkStats.late``; under a group on every rank, ``_GroupEntropy``)
    fin = plan_finish(call, o.finish_options(), hidden, w, b is not None, not o.stats_beyond_lse())
    p, chunk = _first_chunk(hidden, w, b, call, early=not fin.epilogue, every_token=fin.one_dw)
    logp = torch.zeros(n, dtype=torch.float32, device=dev)
    ent = torch.zeros(n, dtype=torch.float32, device=dev) if o.entropy_stats else None
    fn_ent = (lambda sl: ent[sl]) if o.entropy else (lambda sl: None)  # what loss_fn gets
    group = _GroupEntropy(n, dev, shard) if o.entropy_stats and not o.entropy and shard.sharded else None
    late_ent = fin.epilogue or group is not None  # the entropy from the gradient pass (``on_grad``)
    total = []

    metrics = loss_fn_metric_outputs(o, n, dev)

    def outputs(part, st):
        logp[part], en = logprob_part_outputs(tg, st, part, o.entropy_stats and not late_ent)
        if en is not None:
            ent[part] = en
        if group is not None:
            group.lse[part] = st.lse
        store_metric_outputs(metrics, tg, st, part, shard.vocab_size)

    def on_grad(part, r, st):
        value = stats.grad_metrics(r, st)[0]
        if group is not None:
            group.add(part, value)
        else:
            ent[part] = tg.token_loss(value, part)

    def on_part(part, st):
        outputs(part, st)
        ev = evaluate_loss_fn(o, logp[part], fn_ent(part), tg.keep, inputs, part)
        total.append(ev.value)
        return loss_fn_coefficients(tg, part, ev, st, call.plan.folded.inv_t)

    def on_chunk(sl, got):
        for part, _, st in got:
            outputs(part, st)
        ev = evaluate_loss_fn(o, logp[sl], fn_ent(sl), tg.keep, inputs, sl)
        total.append(ev.value)
        return [loss_fn_coefficients(tg, part, ev.rows(slice(part.start - sl.start, part.stop - sl.start)), st,
                                     call.plan.folded.inv_t) for part, _, st in got]

    stats = _ChunkStats(chunk, v, hidden, o.mean_logits, o.entropy_stats,
                        before=tg.before.to(torch.int32) if o.top1 else None, epilogue=fin.epilogue,
                        group_entropy=group is not None)
    step = _softmax_step(hidden, w, b, tg.local_columns(), stats, p, call, call.plan.folded, None, on_part,
                         on_chunk=on_chunk if o.scope == "sequence" else None, on_grad=on_grad if stats.late else None)
    grads = chunk_loop(hidden, w, b, chunk, call, step, finish=fin, whole_p=p if fin.one_dw else None)
    if group is not None:
        ent = tg.token_loss(group.total(), slice(None))
    loss = torch.stack(total).sum() if total else torch.zeros((), dtype=torch.float32, device=dev)
    return loss, logp, ent, grads, metrics


def speculative_grads(held: FastGrads, hidden, weight, bias, tg: TokenTargets, rows: RowStats, g: torch.Tensor,
                      coefficients, call: Call, main_weight=None, dtypes=None):
    """The speculative route's backward (``vpce.speculation``): the held unit-scale gradients finished for the
    per-token upstream gradient ``g [N]`` (fp32), exact for any ``g``, with no host sync.

    ``dX = diag(g) dX_unit`` (ignored tokens' ``g`` taken as 0), scaled and cast in one pass. dW and db: where ``g``
    is uniform over the non-ignored tokens, ``c dW_unit`` scaled and cast in one pass, as on the fast route.
    Otherwise ``dW_unit`` times 0, then the gradient recomputed in token blocks of the forward's chunk over the
    whole vocab (the lean route's token-major order, in a buffer the size of the forward's ``P``), every kernel
    gated by its block's device flag. ``coefficients(r)``: the gradient ``Coefficients`` of every token at per-token
    upstream gradient ``r``; the blocks are the forward's chunks (the plan's ``chunk``). Returns ``(dX, dW, db,
    uniform)`` in ``dtypes`` (default: the inputs' dtype; fp32 parameters that autocast cast get their fp32
    accumulators, ``grads.scaled``), dW padded to the weight's rows, or added into ``main_weight.main_grad``;
    ``uniform`` is a 0-d bool on the device."""
    n, d = hidden.shape
    dtype, dw_dtype, db_dtype = dtypes or (hidden.dtype,) * 3
    v, n_rows = call.shard.valid_rows, weight.shape[0]
    dw, db = held.dw, held.db
    if n == 0:
        uniform, gk = torch.ones((), dtype=torch.bool, device=hidden.device), g
        last = g.new_ones(())
    else:
        uniform, c, gk = split_upstream(g, tg.keep)
        last = torch.where(uniform, c, 1.0)  # the final cast's factor: c, or 1 after the recompute
        if (dw is not None or db is not None) and v > 0:
            r = torch.where(uniform, 0.0, gk)  # all 0 when uniform: every block's kernels skip
            chunk = min(n, call.plan.sizes.chunk)
            flags = block_flags(r, chunk)
            mispredicted = (~uniform).to(torch.int32).reshape(1)
            zero = g.new_zeros(())
            for acc in (dw, db):
                if acc is not None:
                    kernels.gated_scale_(acc, zero, mispredicted)  # NaN in dW_unit stays NaN, as the lean route's
            _gated_recompute(hidden.contiguous(), weight[:v], None if bias is None else bias[:v], tg, rows,
                             coefficients(r), flags, chunk, call.plan.folded, dw, db)
    if main_weight is not None and dw is not None:
        dw = weight_grad_to_main(main_weight, dw, last)
    elif dw is not None:
        dw = pad_rows(scaled(dw, last, dw_dtype, kernels.scale_cast), n_rows, dw_dtype)
    dx = held.summed_dx()  # after dW's cast: dX's sum over the group runs beside it
    dx = None if dx is None else kernels.row_scale_cast(dx, gk, dtype)
    return dx, dw, None if db is None else pad_rows(db.mul_(last), n_rows, db_dtype), uniform


def _gated_recompute(hidden, w, b, tg: TokenTargets, rows: RowStats, coef: Coefficients, flags: torch.Tensor,
                     chunk: int, folded: Folded, dw, db):
    """``dw += dz^T X`` (``db += sum dz``) over the token blocks of ``chunk`` tokens whose flag is set, ``dz``
    recomputed in grad mode with ``coef`` over the whole vocab into one ``[chunk, V]`` buffer; a block whose flag
    is 0 costs two launches of one short wave each."""
    n = hidden.shape[0]
    block = torch.empty(chunk, w.shape[0], dtype=hidden.dtype, device=hidden.device)
    tl_local = tg.local_columns()
    cw = None if tg.class_weight is None else tg.class_weight.columns.float()
    for i, n0 in enumerate(range(0, n, chunk)):
        tok = slice(n0, min(n, n0 + chunk))
        h, flag, gz = hidden[tok], flags[i:i + 1], block[: tok.stop - tok.start]
        per_row = rows.rows(tok)
        kernels.logits_tiles(h, w, b, tl_local[tok], folded=folded, p=gz,
                             rows=(per_row.m, per_row.lse, per_row.q), coef=coef.rows(tok), class_weight=cw,
                             flag=flag, round_logits=True)  # the logits the forward's statistics came from
        kernels.gated_weight_grad_(dw, db, gz, h, flag)
