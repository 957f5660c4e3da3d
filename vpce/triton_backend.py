"""Triton backend: lm_head logits + online-softmax statistics, exact gradients, two memory routes.

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

Measured on one H200 (docs/benchmarks.md, 2026-11-23 run 83140c1): per 4096-token chunk cuBLAS plus the two
bandwidth passes cost the same as the fused Triton GEMM with its epilogue plus the P -> gradient pass it needed on
the Llama-3-8B head (D = 4096), 3 % less on the Gemma-2-2B head (D = 2304, where the fused GEMM could not hide its
epilogue) and 4-5 % less with a soft cap. The logits are then rounded to the inputs' dtype before the softmax, as
in torch eager, torch.compile and quack; the target logit is not.

Backward scales the held ``dX``, ``dW``, ``db`` by the upstream gradient (and ``1/count`` for ``mean``) and casts
them in one pass. Memory: ``P`` (``C * V_local`` values; by default 2 GiB but at most the fp32 ``dW``
accumulator's size), the fp32 ``dW`` accumulator, fp32 ``dX``.

Lean route (``memory_budget="lean"``, ``reduction="none"``, and ``linear_log_probs``), 8NDV.
Forward runs the fused GEMM (``kernels.logits_tiles``) in stats mode only and keeps the global ``lse`` (and ``E[z]``
for the entropy) per token. Backward recomputes the gradient in blocks with the GEMM in grad mode
(``recompute_grads``; the one block loop ``_block_loop``), in the order that holds the smaller fp32 accumulator:
vocab-major while ``N <= V_local`` (each ``[N, Vb]`` block's dW in one GEMM over all tokens, no dW accumulator;
``dX += dz @ W[block]`` into fp32 ``[N, D]``), token-major beyond (each token block's dX finished before the next,
``dW += dz.T @ X[block]`` into fp32 ``[V_local, D]`` or straight into ``main_grad``), so the extra memory stops
growing with N. Memory: one block of the plan's ``block_gib`` (``routing.Sizing.lean_block_gib``) plus the smaller
of the two accumulators.

No-grad: the stats-mode fused GEMM over token chunks; O(N) memory beyond the small per-tile statistics.

The distillation (``distill_forward``, ``distill_recompute_grads``; ``vpce.formulas.distill``):
cuBLAS writes both heads' chunk logits, bandwidth-bound Triton kernels (``vpce.kernels.distill``) read
them. The formulas, the packed statistics and their exchange are ``vpce.formulas.distill``', shared with
the torch backend.

Fast route (``mean``/``sum`` with gradients), per chunk of ``C`` tokens:

1. cuBLAS writes the student's logits ``h W^T (+ b)`` and the teacher's ``h' W'^T (+ b')`` into two ``[C, V_local]``
   buffers in the inputs' dtype (``torch.mm(..., out=)``, the bias through ``addmm``);
2. ``kernels.distill_stats``: one pass over both buffers (soft caps and temperature applied on load, in fp32)
   writes per-(row, tile) statistics, then a per-row reduce over the tiles packs this shard's ``[R, C]``
   statistics exactly as the torch backend packs them; ``formulas.distill.exchange_chunk_stats`` exchanges and combines
   them (one all-gather under a group);
3. JSD only: ``kernels.distill_mixture``, a second pass over both buffers, gives this shard's ``[K_q, K_p]``, and
   the second all-gather (the same call of ``exchange_chunk_stats``);
4. ``kernels.distill_grad_`` overwrites the student's buffer with ``dL/dx`` at unit upstream scale;
5. cuBLAS: ``dX[chunk] = G @ W`` (fp32 out; under a group summed over the ranks asynchronously, under the dW GEMM
   and the next chunk: ``parallel.HiddenGradReduce``, as the cross-entropy's Triton fast route) and
   ``dW += G^T @ X[chunk]`` into an fp32 accumulator.

Under sequence parallelism the fast route gathers both heads' hidden slices itself: the student's first, then the
teacher's (the larger, at ``D_t``) beside the first chunk's student GEMM.

Backward scales the held fp32 gradients by the upstream gradient (``grads.finish_fast_grads``). Memory: the two
buffers (``routing.Sizing.distill_fast_gib`` together by default, at most ``distill_dw_share`` times the fp32 dW
accumulator's size: in bf16 chunks of at most 1.5 D tokens), their tile statistics, the fp32 dX and dW.

Lean route (``reduction="none"``, ``memory_budget="lean"``): forward is steps 1-3 over chunks of
``routing.Sizing.distill_lean_gib``, keeping each token's ``DistillRows``. Backward recomputes both heads' logits
block by block with cuBLAS and runs the gradient kernel, in the cross-entropy's block loop (``_block_loop``), in the
order that holds the smaller fp32 accumulator: vocab-major while ``N <= V_local`` (each ``[N, V_b]`` block's dW in
one GEMM, ``dX`` summed over the blocks in fp32), token-major beyond (each token block's ``dX`` finished before the
next, ``dW`` summed over the token blocks in fp32). The backward needs no exchange.

The logits are rounded to the inputs' dtype once, as ``F.linear`` rounds them in plain PyTorch; everything after
is fp32. No host syncs, no atomics: every kernel writes each output element from one program.
"""

from __future__ import annotations

import math

import torch

from . import kernels
from .formulas.distill import KL_HEAD, DistillRows, exchange_chunk_stats, heads, local_stats, row_weights, \
    rows_layout, token_loss
from .formulas.softmax import (Coefficients, RowStats, ce_coefficients, ce_token_outputs, evaluate_loss_fn,
                       logprob_coefficients, logprob_part_outputs, loss_fn_coefficients, loss_fn_metric_outputs,
                       store_metric_outputs)
from .gemm import add_product, hopper_dw_ready, logits_into, logits_with_stats, mm_into, stats_epilogue_ready
from .grads import FastGrads, add_block, pad_rows, scaled, weight_grad, weight_grad_to_main, written_rows
from .options import DistillOptions, LogProbLossOptions, LogProbOptions, LossOptions
from .parallel import HiddenGradReduce, PendingStats, gather_sequence, start_gather_sequence, start_stats_exchange
from .rank_stats import RankStats
from .routing import ROW_ALIGN, Call, one_weight_grad_gemm, round_to
from .speculation import block_flags, split_upstream
from .targets import TokenTargets

__all__ = ["cross_entropy", "log_probs", "log_probs_formed", "recompute_grads", "speculative_grads", "scale_cast",
           "distill_forward", "distill_recompute_grads"]


scale_cast = kernels.scale_cast


class _ChunkStats:
    """Per-tile statistics buffers for a chunk of tokens, and the pass that turns them into global per-token
    statistics (one packed collective under a group).

    ``parts`` runs a chunk as sub-chunks: under a group each sub-chunk's exchange is started asynchronously and
    overlaps the next sub-chunk's GEMM; the results come back in order.
    """

    def __init__(self, rows: int, v: int, x: torch.Tensor, sum_z: bool, sum_ez: bool, class_weight=None,
                 sum_sq: bool = False, before: torch.Tensor | None = None, epilogue: bool = False):
        n_tiles = max(1, math.ceil(v / kernels.tile_n(x)))
        f32 = dict(dtype=torch.float32, device=x.device)
        # ``epilogue``: the fast route's logits GEMM takes the statistics itself (``vpce.gemm.logits_with_stats``,
        # the hopper extra): one log-sum-exp per row and the share of it outside the target column
        # (``kernels.target_out_of_lse``), which the reduction takes as one tile
        self.epilogue = epilogue
        # there the entropy's sum and the argmax test's maxima come per tile from the gradient pass instead
        # (``grad_outputs``, then ``kernels.grad_metrics``): one process only (the sums are this rank's)
        self.late = epilogue and (sum_ez or before is not None)
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

    def _local(self, h, w, b, tl_local, sl: slice, r: slice, call: Call, softcap, inv_t, p, ready=False):
        """Kernel and local reduction for tokens ``sl`` into buffer rows ``r``: this rank's packed statistics
        ``[k, rows]`` (``start_stats_exchange``). ``ready``: the logits of ``p`` are already written
        (``first_logits``)."""
        n_sums = 1 if self.z is not None else 0
        cut = lambda t: None if t is None else t[r]  # noqa: E731
        if call.shard.valid_rows > 0 and self.epilogue:  # P, the statistics and the fp32 target logit: one GEMM
            zt = self.zt[r]
            lse, sum_z = logits_with_stats(p, h[sl], w, tl_local[sl], zt, softcap, inv_t, self.z is not None,
                                           self.class_weight)
            kernels.target_out_of_lse(lse, zt, self.s[r].view(-1), p.dtype, softcap=softcap, inv_t=inv_t,
                                      zs=None if self.zs is None else self.zs[r])
            return kernels.reduce_tiles(lse[:, None], self.s[r], None if sum_z is None else sum_z[:, None], None, zt)
        if call.shard.valid_rows > 0:
            zt, zs = self.zt[r], None
            stats = dict(softcap=softcap, inv_t=inv_t, tile_m=self.m[r], tile_s=self.s[r], tile_z=cut(self.z),
                         tile_ez=cut(self.ez), zt=zt, class_weight=self.class_weight, tile_sq=cut(self.sq),
                         tile_mb=cut(self.mb), before=None if self.before is None else self.before[sl])
            if p is not None:
                # the fast route: cuBLAS writes the logits into P (the bias added before the one rounding, as
                # F.linear does), one bandwidth pass takes their statistics, the target logit comes in fp32
                if not ready:
                    logits_into(p, h[sl], w, b)
                kernels.stored_logits(p, None, tl_local[sl], **stats)
                zs = None if self.zs is None else self.zs[r]
                kernels.target_logits(h[sl], w, b, tl_local[sl], zt, softcap=softcap, inv_t=inv_t,  # every row
                                      logits=p, zs=zs)
            else:
                zt.fill_(-math.inf)  # stored by the tile that holds the target, if any
                kernels.logits_tiles(h[sl], w, b, tl_local[sl], **stats)
            packed = kernels.reduce_tiles(self.m[r], self.s[r], cut(self.z), cut(self.ez), zt, cut(self.sq),
                                          cut(self.mb), zs)
        else:  # this rank's rows are all padding: no max, no target, every sum 0
            top1 = 2 * (self.mb is not None)  # max before the target, the target logit
            packed = torch.zeros(3 + n_sums + (self.ez is not None) + (self.sq is not None) + top1,
                                 sl.stop - sl.start, dtype=torch.float32, device=h.device)
            packed[0] = packed[2] = -math.inf
            if top1:
                packed[-2:] = -math.inf
        return packed

    def _exchange(self, packed: torch.Tensor, call: Call) -> PendingStats:
        """Start the exchange of ``_local``'s packed statistics. The epilogue's carry no metrics' rows (those come
        from the gradient pass, ``late``; under a group the metrics keep the statistics pass)."""
        metrics = not self.epilogue
        return start_stats_exchange(packed, 1 if self.z is not None else 0, call.shard, call.poison,
                                    combine=kernels.combine_rank_stats, sum_sq=metrics and self.sq is not None,
                                    max_before=metrics and self.mb is not None)

    def grad_outputs(self, part: slice, r: slice) -> dict:
        """What the gradient pass of tokens ``part`` (buffer rows ``r``) also fills where the metrics come from it
        (``late``): per tile the entropy's sum and the argmax test's maxima; else nothing."""
        if not self.late:
            return {}
        cut = lambda t: None if t is None else t[r]  # noqa: E731
        return dict(tile_ez=cut(self.ez), tile_m=cut(self.m), tile_mb=cut(self.mb),
                    before=None if self.before is None else self.before[part])

    def grad_metrics(self, r: slice, st: RankStats):
        """``(entropy, argmax indicator)`` of buffer rows ``r`` after their gradient pass (``late``), None for
        what is not asked."""
        cut = lambda t: None if t is None else t[r]  # noqa: E731
        return kernels.grad_metrics(st.lse, self.zt[r], tile_ez=cut(self.ez), tile_m=cut(self.m),
                                    tile_mb=cut(self.mb), zs=cut(self.zs))  # ``m`` is held only for the argmax

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

    def parts(self, h, w, b, tl_local, sl: slice, call: Call, softcap, inv_t=1.0, p=None, ready=False):
        """Yield ``(part, rows, RankStats)`` for the sub-chunks of tokens ``sl`` (global statistics); ``rows``:
        the part's rows in the chunk buffers (and in ``p``, the fast route's P). ``ready``: ``first_logits``
        wrote the first sub-chunk's logits."""
        cuts = self._cuts(sl.stop - sl.start, call)
        whole = None
        if self.epilogue:
            # the statistics GEMM runs the whole chunk in one launch, its statistics then exchanged in the same
            # parts: with a launch per half the first half's exchange did not run beside the second's GEMM anyway
            # (it got an SM only as that persistent GEMM ended), and one launch took 0.2-0.25 ms a step less (two
            # H100s, tp=2, Llama-3-8B head, interleaved in one process; docs/benchmarks.md)
            whole = self._local(h, w, b, tl_local, sl, slice(0, sl.stop - sl.start), call, softcap, inv_t, p)
        pending = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            part, r = slice(sl.start + lo, sl.start + hi), slice(lo, hi)
            if whole is None:
                packed = self._local(h, w, b, tl_local, part, r, call, softcap, inv_t, None if p is None else p[r],
                                     ready=ready and lo == 0)
            else:  # the part's columns of the whole chunk's statistics
                packed = whole if hi - lo == whole.shape[1] else whole[:, lo:hi].contiguous()
            pending.append((part, r, self._exchange(packed, call)))
        for part, r, pend in pending:
            yield part, r, pend.wait()


# -- the engine: one forward chunk loop (``_chunk_loop``), one block loop for the recompute (``_block_loop``) -------
#
# Each loss supplies a small per-chunk (per-block) step; the loops own the chunking, the GEMMs of dX, dW and db, and
# their accumulators. The softmax losses (cross-entropy, log-probs, and any loss of the log-probs and the entropy)
# share one step whose ``on_part(part, stats) -> Coefficients`` is the per-loss seam; the distillation has its own
# (the step in ``distill_forward``, ``_DistillBlocks``). The speculative route's flag-gated recompute
# (``_gated_recompute``) is a loop of its own: its kernels are gated by a device flag and its dW GEMM is Triton's.


def _block_loop(hidden, weight, bias, call: Call, step, main_weight=None):
    """The lean block loop: dX, dW and db from the gradient recomputed block by block by ``step``, in whichever
    order holds the smaller fp32 accumulator:

    * vocab-major (``N <= V_local``): each vocab block over all tokens; its dW in one GEMM (no dW accumulator),
      dX summed over the blocks in fp32 ``[N, D]``;
    * token-major (``N > V_local``, long sequences): each token block over the whole vocab; its dX finished
      before the next block (fp32 ``[N_b, D]`` only), dW summed over the token blocks in fp32 ``[V_local, D]``
      (or straight into ``main_grad``). The extra memory then stays fixed as N grows.

    ``step``: its ``buffers`` logits buffers of ``[N_b, V_b]`` fit the plan's ``block_gib``, ``V_b`` a multiple of
    ``step.align``, ``N_b`` the plan's ``block_tokens`` (token-major); ``step.alloc(nb, vb, n, v)`` allocates them,
    ``step.tokens(tok)`` gives what a token block needs, ``step.block(h, tok, per_tok, v0, v1)`` recomputes the
    gradient of tokens ``tok`` and vocab rows ``[v0, v1)`` into its buffer and returns it. ``hidden`` contiguous.
    ``main_weight``: add dW in fp32 into its ``main_grad`` instead of returning it.
    """
    n, d = hidden.shape
    v, n_rows, dtype = call.shard.valid_rows, weight.shape[0], hidden.dtype
    need_dx, need_dw, need_db = call.needs_grad
    into_main = main_weight is not None and need_dw
    db = torch.zeros(n_rows, dtype=torch.float32, device=hidden.device) if need_db and bias is not None else None
    token_major = 0 < v < n
    sizes = call.plan.sizes
    nb = max(1, min(n, sizes.block_tokens) if token_major else n)
    vb = round_to(int(sizes.block_gib * 2**30) // max(1, step.buffers * nb * hidden.element_size()), step.align)
    vb = min(vb, max(v, 1))
    step.alloc(nb, vb, n, v)
    dx = dw = dx_acc = None
    if token_major:
        if need_dx:
            dx = torch.empty(n, d, dtype=dtype, device=hidden.device)
            dx_acc = torch.empty(nb, d, dtype=torch.float32, device=hidden.device) if v > vb else None
        if need_dw and not into_main:
            dw = torch.zeros(n_rows, d, dtype=torch.float32, device=hidden.device)
    else:
        dx = written_rows(n, d, n if v else 0, torch.float32, hidden.device) if need_dx else None
        dw = written_rows(n_rows, d, v if n else 0, dtype, hidden.device) if need_dw and not into_main else None
    main_grad = main_weight.main_grad if into_main else None
    for n0 in range(0, n if v else 0, nb):
        n1 = min(n, n0 + nb)
        h, tok = hidden[n0:n1], slice(n0, n1)
        per_tok = step.tokens(tok)
        for v0 in range(0, v, vb):
            v1 = min(v, v0 + vb)
            gz = step.block(h, tok, per_tok, v0, v1)
            add_block(gz, h, weight[v0:v1], slice(v0, v1), tok, dx=dx, dx_acc=dx_acc, dw=dw, db=db,
                      token_major=token_major, main_grad=main_grad)
        if dx_acc is not None and dx is not None:
            dx[tok] = dx_acc[: n1 - n0]
    if dx is not None and dx.dtype != dtype:
        dx = dx.to(dtype)
    if into_main:
        dw = weight_grad(None, main_weight, dtype)
    elif dw is not None and dw.dtype != dtype:
        dw = dw.to(dtype)
    return dx, dw, None if db is None else db.to(dtype)


class _SoftmaxBlocks:
    """The softmax losses' block step: the fused GEMM in grad mode (``kernels.logits_tiles``) recomputes a block's
    logits and writes their gradient for the per-token ``coef`` into one ``[N_b, V_b]`` buffer."""

    buffers = 1

    def __init__(self, hidden, weight, bias, tg: TokenTargets, rows: RowStats, coef: Coefficients, softcap, inv_t):
        self.weight, self.bias, self.rows, self.coef = weight, bias, rows, coef
        self.softcap, self.inv_t = softcap, inv_t
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
                             self.tl_local[tok] - v0, softcap=self.softcap, inv_t=self.inv_t, p=gz, rows=rows,
                             coef=coef, class_weight=None if self.cw is None else self.cw[v0:v1])
        return gz


def recompute_grads(hidden, weight, bias, tg: TokenTargets, rows: RowStats, coef: Coefficients, call: Call,
                    softcap, inv_t: float, main_weight=None):
    """dX, dW and db of the softmax losses from the logits recomputed in blocks (grad mode) for any per-token
    ``coef`` (``_block_loop``); ``main_weight``: add dW in fp32 into its ``main_grad`` instead of returning it."""
    hidden = hidden.contiguous()
    step = _SoftmaxBlocks(hidden, weight, bias, tg, rows, coef, softcap, inv_t)
    return _block_loop(hidden, weight, bias, call, step, main_weight)


def _p_quack_ready(hidden, w, v: int) -> bool:
    """Whether quack's GEMMs can finish dX or dW from a ``P`` of ``v`` columns (``vpce.gemm.hopper_dw_ready``):
    its rows, ``v`` apart, must start on 16-byte boundaries (TMA)."""
    return v > 0 and (v * hidden.element_size()) % 16 == 0 and hopper_dw_ready(hidden, w)


def _chunk_loop(hidden, w, b, chunk: int, call: Call, step, form: bool = True,
                defer_last: bool = False, whole_p: torch.Tensor | None = None) -> FastGrads | None:
    """The forward chunk loop, every loss and route: per chunk ``sl`` of ``chunk`` tokens the per-loss
    ``step(sl, first)`` takes the chunk's statistics and outputs (from its logits buffer where the route holds one,
    ``first``: the first chunk's logits already written, launched before the forward's set-up) and, where ``form``,
    writes the chunk's gradient at unit upstream scale over them and returns that ``[c, V_local]`` buffer (None on
    an all-padding shard); the chunk's dX rows and dW (db) then go into fp32 (with ``dx_reduce == "forward"``, dX
    summed over the group, overlapped with the dW GEMM and the next chunk). ``defer_last``: leave the last chunk's
    dW GEMM to backward where one quack GEMM can finish dW (``FastGrads.last``, ``vpce.gemm.hopper_dw_ready``), and
    with one chunk and no group the dX GEMM too (``FastGrads.dx_last``). ``whole_p``: ``P`` of every token
    (``routing.one_weight_grad_gemm``), where each chunk's step leaves its gradient in that chunk's rows; dW is then
    one GEMM over all of it after the last chunk (left to backward with ``defer_last``), none per chunk.
    Returns the unscaled ``FastGrads``, or None without ``form``."""
    n, d = hidden.shape
    if not form:
        for c0 in range(0, n, chunk):
            step(slice(c0, min(n, c0 + chunk)), c0 == 0)
        return None
    shard, plan, needs = call.shard, call.plan, call.needs_grad
    dev = hidden.device
    v = shard.valid_rows
    dx = dx_last = None
    # one chunk, no group: dX's GEMM too can wait for backward, where one quack GEMM writes it scaled in bf16. It
    # reads the chunk's P [n, V_local] (``_first_chunk``: row-major, rows V_local apart), whose rows must start on
    # 16-byte boundaries: V_local a multiple of 8 (else cuBLAS's fp32 GEMM below, as without the extra)
    defer_dx = needs[0] and defer_last and not shard.sharded and 0 < n <= chunk and _p_quack_ready(hidden, w, v)
    if needs[0] and not defer_dx:  # fp32; an all-padding shard contributes zeros (and still joins the collectives)
        dx = (torch.empty if v > 0 else torch.zeros)(n, d, dtype=torch.float32, device=dev)
    reduce_dx = HiddenGradReduce(dx, shard, plan.sequence_parallel) \
        if dx is not None and plan.dx_reduce == "forward" else None
    dw = None  # fp32 accumulator, allocated by the first chunk's GEMM (no zero fill)
    last = None
    db = torch.zeros(v, dtype=torch.float32, device=dev) if needs[2] and b is not None else None
    for c0 in range(0, n, chunk):
        sl = slice(c0, min(n, c0 + chunk))
        g = step(sl, c0 == 0)
        if defer_dx:
            dx_last = (g, w)
        elif v > 0 and dx is not None:
            mm_into(dx[sl], g, w)
        if reduce_dx is not None:  # overlaps this chunk's dW GEMM and the next chunk
            reduce_dx.add(sl)
        if v == 0:
            continue
        if needs[1] and (whole_p is None or sl.stop == n):  # with whole_p: one dW GEMM, over every chunk's rows
            gw, x = (g, hidden[sl]) if whole_p is None else (whole_p, hidden)
            if defer_last and sl.stop == n and hopper_dw_ready(gw, x):
                last = (gw, x)
            else:
                dw = add_product(dw, gw.t(), x)
        if db is not None:
            db += g.sum(0, dtype=torch.float32)
    if needs[1] and dw is None and last is None:  # no chunk ran (no tokens, or an all-padding shard)
        dw = torch.zeros(v, d, dtype=torch.float32, device=dev)
    return FastGrads(dx, dw, db, reduce_dx, last, dx_last)  # dX's sum awaited in backward, after dW's cast


def _softmax_step(hidden, w, b, tl_local, stats: _ChunkStats, p, call: Call, softcap, inv_t, cw, on_part,
                  on_chunk=None, on_grad=None):
    """The softmax losses' chunk step for ``_chunk_loop``: the chunk's statistics (``stats.parts``, in sub-chunks
    whose exchanges overlap), then per part ``on_part(part, stats)``, which stores the part's outputs and returns
    its gradient ``Coefficients`` (the per-loss seam: the cross-entropy's, the log-probs', or a loss of the
    log-probs and the entropy computed while the logits are live), and ``kernels.stored_logits`` in grad mode
    overwrites the part's logits in ``p`` with the gradient. ``on_chunk(sl, [(part, rows, stats), ...])`` instead
    of ``on_part``: every part's coefficients at once, once the whole chunk's statistics are in (a loss over whole
    rows of tokens, such as a sequence-level importance ratio). Without ``p`` (the lean route's and the no-grad
    forward's stats-only launches: ``_chunk_loop`` without ``form``), the fused GEMM takes the statistics and
    ``on_part`` only stores the outputs. ``on_grad(part, rows, stats)``: after each part's gradient pass (the
    outputs that pass gives, ``_ChunkStats.grad_outputs``)."""

    def step(sl: slice, first: bool):
        # the chunk's rows of P: its own rows where P holds every token (``routing.one_weight_grad_gemm``), else the
        # first rows of a P of one chunk
        pc = None if p is None else p[sl] if p.shape[0] >= sl.stop else p[: sl.stop - sl.start]
        parts = stats.parts(hidden, w, b, tl_local, sl, call, softcap, inv_t, p=pc, ready=first)
        if on_chunk is None:  # each part's coefficients as its statistics come (lazily: in order)
            ready = ((part, r, st, on_part(part, st)) for part, r, st in parts)
        else:
            got = list(parts)
            ready = [(part, r, st, co) for (part, r, st), co in zip(got, on_chunk(sl, got))]
        for part, r, st, co in ready:
            if pc is not None:
                kernels.stored_logits(pc[r], None, tl_local[part], softcap=softcap, inv_t=inv_t,
                                      rows=(st.m, st.lse, st.q), coef=co, class_weight=cw,
                                      **stats.grad_outputs(part, r))  # in place
                if on_grad is not None:
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


def cross_entropy(hidden, weight, bias, tg: TokenTargets, opts: LossOptions, call: Call):
    """Per-token loss ``[N]`` (weighted, 0 on ignored tokens), and what backward needs: the fast route's
    unscaled ``FastGrads`` (with ``dx_reduce == "forward"``: already summed over the group, this rank's slice
    under sequence parallelism), the lean route's ``RowStats``, or both (the speculative route)."""
    shard, plan = call.shard, call.plan
    if plan.dx_reduce == "forward" and plan.sequence_parallel:
        hidden = gather_sequence(hidden, shard)
    n, d = hidden.shape
    dev = hidden.device
    v = shard.valid_rows
    hidden = hidden.contiguous()
    w = weight[:v]
    b = None if bias is None else bias[:v]
    formed = plan.route in ("fast", "speculative")
    smooth = opts.label_smoothing > 0
    # the statistics in the logits GEMM's epilogue (the hopper extra), where the options need of them only the
    # log-sum-exp, the target logit and (smoothing) the sum of the logits, a logit scale only beside a soft cap;
    # with one process the entropy and the argmax test then come from the gradient pass
    # (``_ChunkStats.late``), under a group they keep the statistics pass (their sums are over the ranks). Under a
    # group this GEMM starts after the set-up (it needs the targets), not before it as cuBLAS's first GEMM does.
    # The statistics exchanged are the same tensor either way, so the choice is no collective's.
    cap, inv_t = opts.folded_cap()
    epilogue = formed and v > 0 and (cap is not None or inv_t == 1.0) and \
        not (opts.metrics and shard.sharded) and stats_epilogue_ready(hidden, w, b, v)
    defer = plan.route == "fast" and not call.main_grad  # the speculative route's backward adds to the accumulator
    # under a group: every token's gradient in one P, this rank's dW in one quack GEMM (changes no collective)
    one_dw = v > 0 and one_weight_grad_gemm(
        plan, opts, n, d, hidden.dtype, _p_quack_ready(hidden, w, v), defer and call.needs_grad[1])
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

    late = ("entropy", "token_accuracy") if epilogue else ()  # from the gradient pass (``on_grad``)

    def on_part(part, st):
        ce_token_outputs(st, opts, shard.vocab_size, tg, part, loss_tok, metrics, skip=late)
        if keep:
            rows.store(part, st)
        if not formed:
            return None
        scale = unit[part] if tg.scaling is None else unit[part] * tg.scaling[part]
        return ce_coefficients(scale, st.lse, opts, shard.vocab_size, tg.class_rows(part))

    if not formed:  # stats-only launches
        p, chunk = None, min(max(n, 1), plan.sizes.chunk)
    stats = _ChunkStats(chunk, v, hidden, smooth, entropy, cw, before=before, epilogue=epilogue)

    def on_grad(part, r, st):
        for k, value in zip(("entropy", "token_accuracy"), stats.grad_metrics(r, st)):
            if value is not None:
                metrics[k][part] = tg.metric(value, part)

    step = _softmax_step(hidden, w, b, tl_local, stats, p, call, cap, inv_t, cw, on_part,
                         on_grad=on_grad if stats.late else None)
    return loss_tok, rows, _chunk_loop(hidden, w, b, chunk, call, step, form=formed, defer_last=defer,
                                       whole_p=p if one_dw else None)


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
    step = _softmax_step(hidden, w, b, tl_local, stats, None, call, lp.softcap, lp.inv_t, None,
                         lambda _, st: parts.append(st))
    _chunk_loop(hidden, w, b, chunk, call, step, form=False)
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
    unit = logprob_coefficients(tg, ones, None, None, lp.inv_t, like=ones)
    rows = RowStats.empty(n, torch.float32, dev)
    stats = _ChunkStats(chunk, v, hidden, lp.mean_logits, lp.entropy, sum_sq=lp.log_sum_sq,
                        before=tg.before.to(torch.int32) if lp.top1 else None)
    parts = []

    def on_part(part, st):
        parts.append(st)
        rows.store(part, st)
        return unit.rows(part)

    grads = _chunk_loop(hidden, w, b, chunk, call, _softmax_step(hidden, w, b, tl_local, stats, p, call, lp.softcap,
                                                                 lp.inv_t, None, on_part))
    st = RankStats.cat(parts, int(lp.mean_logits), int(lp.entropy), hidden.new_empty(0, dtype=torch.float32),
                       lp.log_sum_sq, lp.top1)
    return st, rows, grads


def log_prob_loss(hidden, weight, bias, tg: TokenTargets, o: LogProbLossOptions, call: Call, inputs: dict):
    """``linear_log_prob_loss`` on the fast route: the chunk loop with ``loss_fn`` evaluated per part while the
    part's logits are live (``on_part``; scope ``"sequence"``: on the chunk's whole rows once all of its parts'
    statistics are in, ``on_chunk``), its per-token gradients the gradient pass's coefficients. Returns ``(loss,
    log_probs, entropy or None, FastGrads, metrics)`` (with ``dx_reduce == "forward"``: dX already summed over the
    group; ``metrics``: ``is_top1`` and ``mean_logits`` by name where ``o`` asks, from the same statistics)."""
    shard, plan = call.shard, call.plan
    if plan.dx_reduce == "forward" and plan.sequence_parallel:
        hidden = gather_sequence(hidden, shard)
    n = hidden.shape[0]
    dev = hidden.device
    v = shard.valid_rows
    hidden = hidden.contiguous()
    w = weight[:v]
    b = None if bias is None else bias[:v]
    p, chunk = _first_chunk(hidden, w, b, call)
    logp = torch.zeros(n, dtype=torch.float32, device=dev)
    ent = torch.zeros(n, dtype=torch.float32, device=dev) if o.entropy_stats else None
    fn_ent = (lambda sl: ent[sl]) if o.entropy else (lambda sl: None)  # what loss_fn gets
    total = []

    metrics = loss_fn_metric_outputs(o, n, dev)

    def outputs(part, st):
        logp[part], en = logprob_part_outputs(tg, st, part, o.entropy_stats)
        if en is not None:
            ent[part] = en
        store_metric_outputs(metrics, tg, st, part, shard.vocab_size)

    def on_part(part, st):
        outputs(part, st)
        ev = evaluate_loss_fn(o, logp[part], fn_ent(part), tg.keep, inputs, part)
        total.append(ev.value)
        return loss_fn_coefficients(tg, part, ev, st, o.inv_t)

    def on_chunk(sl, got):
        for part, _, st in got:
            outputs(part, st)
        ev = evaluate_loss_fn(o, logp[sl], fn_ent(sl), tg.keep, inputs, sl)
        total.append(ev.value)
        return [loss_fn_coefficients(tg, part, ev.rows(slice(part.start - sl.start, part.stop - sl.start)), st,
                                     o.inv_t) for part, _, st in got]

    stats = _ChunkStats(chunk, v, hidden, o.mean_logits, o.entropy_stats,
                        before=tg.before.to(torch.int32) if o.top1 else None)
    step = _softmax_step(hidden, w, b, tg.local_columns(), stats, p, call, o.softcap, o.inv_t, None, on_part,
                         on_chunk=on_chunk if o.scope == "sequence" else None)
    grads = _chunk_loop(hidden, w, b, chunk, call, step)
    loss = torch.stack(total).sum() if total else torch.zeros((), dtype=torch.float32, device=dev)
    return loss, logp, ent, grads, metrics


def speculative_grads(held: FastGrads, hidden, weight, bias, tg: TokenTargets, rows: RowStats, g: torch.Tensor,
                      coefficients, call: Call, softcap, inv_t: float, main_weight=None, dtypes=None):
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
                             coefficients(r), flags, chunk, softcap, inv_t, dw, db)
    if main_weight is not None and dw is not None:
        dw = weight_grad_to_main(main_weight, dw, last)
    elif dw is not None:
        dw = pad_rows(scaled(dw, last, dw_dtype, kernels.scale_cast), n_rows, dw_dtype)
    dx = held.summed_dx()  # after dW's cast: dX's sum over the group runs beside it
    dx = None if dx is None else kernels.row_scale_cast(dx, gk, dtype)
    return dx, dw, None if db is None else pad_rows(db.mul_(last), n_rows, db_dtype), uniform


def _gated_recompute(hidden, w, b, tg: TokenTargets, rows: RowStats, coef: Coefficients, flags: torch.Tensor,
                     chunk: int, softcap, inv_t: float, dw, db):
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
        kernels.logits_tiles(h, w, b, tl_local[tok], softcap=softcap, inv_t=inv_t, p=gz,
                             rows=(per_row.m, per_row.lse, per_row.q), coef=coef.rows(tok), class_weight=cw,
                             flag=flag, round_logits=True)  # the logits the forward's statistics came from
        kernels.gated_weight_grad_(dw, db, gz, h, flag)


# ------------------------------------------------------------------------------------------------------------
# the distillation

_KIND = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}    # the gradient kernel's divergence


def _buffer(numel: int, dtype, device) -> torch.Tensor | None:
    return torch.empty(numel, dtype=dtype, device=device) if numel else None


def _view(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous ``[rows, cols]`` view of the front of a flat buffer."""
    return buf[: rows * cols].view(rows, cols)


def _distill_kernel_options(o: DistillOptions) -> dict:
    return dict(softcap=o.softcap, t_softcap=o.teacher_softcap, inv_t=o.inv_t)


def _distill_chunk_stats(z, y, t_local, tg: TokenTargets, sl: slice, o: DistillOptions, call: Call):
    """The chunk's global ``DistillStats`` (``z`` None: this shard's rows are all padding); the exchanges are
    ``distill.exchange_chunk_stats``'s."""
    c = sl.stop - sl.start
    dev = tg.idx.device
    if z is None:
        packed = local_stats(None, None, tg, sl, o, c, torch.float32, dev)
    else:
        packed = torch.empty(rows_layout(o)[1], c, dtype=torch.float32, device=dev)
        kernels.distill_stats(z, y, t_local, packed, kl=KL_HEAD[o.kind], ce=o.ce_weight > 0,
                              **_distill_kernel_options(o))

    def mixture_sums(st):
        if z is None:
            return torch.zeros(2, c, dtype=torch.float32, device=dev)
        return kernels.distill_mixture(z, y, st.m_z, st.log_s_z, st.m_y, st.log_s_y, beta=o.beta,
                                       **_distill_kernel_options(o))
    return exchange_chunk_stats(packed, mixture_sums, o, call, combine_heads=kernels.combine_distill_heads,
                                combine_ce=kernels.combine_rank_stats)


def _distill_grad_(z, y, t_local, rows: DistillRows, kd, ce, o: DistillOptions):
    """``dL/dx`` over the student's logits ``z``, in place."""
    kernels.distill_grad_(z, y, z, t_local, rows, kd, ce, kind=_KIND[o.kind], beta=o.beta, **_distill_kernel_options(o))


def distill_forward(hidden, weight, bias, t_hidden, t_weight, t_bias, tg: TokenTargets, o: DistillOptions,
                    call: Call):
    """Per-token loss ``[N]`` (weighted, 0 on ignored tokens), and what backward needs: the fast route's unscaled
    ``FastGrads`` (with ``dx_reduce == "forward"``: already summed over the group, this rank's slice under
    sequence parallelism), or the lean route's ``DistillRows``."""
    shard, plan = call.shard, call.plan
    t_gather = None
    if plan.dx_reduce == "forward" and plan.sequence_parallel:  # both heads' slices gathered here
        hidden = gather_sequence(hidden.contiguous(), shard)
        t_gather = start_gather_sequence(t_hidden, shard)  # under the first chunk's student GEMM
    hidden = hidden.contiguous()
    if t_gather is None:
        t_hidden = t_hidden.contiguous()
    n, d = hidden.shape
    dev, dtype = hidden.device, hidden.dtype
    v = shard.valid_rows
    w, b, tw, tb = heads(weight, bias, t_weight, t_bias, v)
    fast, keep = plan.route == "fast", plan.route == "lean"
    chunk = min(max(n, 1), plan.sizes.chunk)
    zbuf, ybuf = (_buffer(chunk * v if n else 0, dtype, dev) for _ in range(2))
    first = min(n, chunk) if v > 0 else 0  # the first chunk's GEMMs go first, the host's set-up runs beside them
    if first:
        logits_into(_view(zbuf, first, v), hidden[:first], w, b)
    if t_gather is not None:  # the teacher's slices, gathered beside the first student GEMM
        t_hidden = t_gather.wait()
    if first:
        logits_into(_view(ybuf, first, v), t_hidden[:first], tw, tb)
    t_local = tg.local_columns()
    loss_tok = torch.empty(n, dtype=torch.float32, device=dev)
    rows = DistillRows.empty(n, o, torch.float32, dev) if keep else None
    unit = None
    if fast:  # unit upstream scale; 1/count (mean) and the upstream gradient are applied in backward
        unit = tg.row_scale(torch.ones((), dtype=torch.float32, device=dev).expand(n))

    def step(sl: slice, first: bool):
        """The distillation's chunk step: both heads' logits (the first chunk's already written), the statistics
        and the loss, the lean route's rows; on the fast route the gradient over the student's logits."""
        c = sl.stop - sl.start
        z = y = None
        if v > 0:
            z, y = _view(zbuf, c, v), _view(ybuf, c, v)
            if not first:
                logits_into(z, hidden[sl], w, b)
                logits_into(y, t_hidden[sl], tw, tb)
        st = _distill_chunk_stats(z, y, t_local[sl], tg, sl, o, call)
        loss_tok[sl] = tg.token_loss(token_loss(st, o), sl)
        if keep:
            rows.store(sl, DistillRows.of(st, o))
        if fast and v > 0:
            kd, ce = row_weights(unit[sl], o)
            _distill_grad_(z, y, t_local[sl], DistillRows.of(st, o), kd, ce, o)
        return z
    return loss_tok, rows, _chunk_loop(hidden, w, b, chunk, call, step, form=fast)


class _DistillBlocks:
    """The distillation's block step: cuBLAS recomputes both heads' logits of a block into two flat buffers, and
    ``kernels.distill_grad_`` writes the gradient over the student's for the per-row weights ``kd``, ``ce``."""

    buffers = 2

    def __init__(self, hidden, t_hidden, w, b, tw, tb, tg: TokenTargets, rows: DistillRows, scale, o: DistillOptions):
        self.hidden, self.t_hidden, self.w, self.b, self.tw, self.tb = hidden, t_hidden, w, b, tw, tb
        self.rows, self.o = rows, o
        self.kd, self.ce = row_weights(scale, o)
        self.t_local = tg.local_columns()
        self.align = kernels.distill_block_align(hidden)

    def alloc(self, nb, vb, n, v):
        self.zbuf, self.ybuf = (_buffer(nb * vb if n and v else 0, self.hidden.dtype, self.hidden.device)
                                for _ in range(2))

    def tokens(self, tok):
        return self.rows.rows(tok)

    def block(self, h, tok, rows, v0, v1):
        z, y = _view(self.zbuf, tok.stop - tok.start, v1 - v0), _view(self.ybuf, tok.stop - tok.start, v1 - v0)
        logits_into(z, h, self.w[v0:v1], None if self.b is None else self.b[v0:v1])
        logits_into(y, self.t_hidden[tok], self.tw[v0:v1], None if self.tb is None else self.tb[v0:v1])
        _distill_grad_(z, y, self.t_local[tok] - v0, rows, self.kd[tok], None if self.ce is None else self.ce[tok],
                       self.o)
        return z


def distill_recompute_grads(hidden, weight, bias, t_hidden, t_weight, t_bias, tg: TokenTargets, rows: DistillRows,
                            scale: torch.Tensor, o: DistillOptions, call: Call):
    """dX, dW, db from both heads' logits recomputed block by block (cuBLAS) and the gradient kernel, for per-token
    row scales ``scale``; the lean block loop (``_block_loop``): vocab-major while ``N <= V_local``, token-major
    beyond."""
    hidden, t_hidden = hidden.contiguous(), t_hidden.contiguous()
    w, b, tw, tb = heads(weight, bias, t_weight, t_bias, call.shard.valid_rows)
    step = _DistillBlocks(hidden, t_hidden, w, b, tw, tb, tg, rows, scale, o)
    return _block_loop(hidden, weight, bias, call, step)
