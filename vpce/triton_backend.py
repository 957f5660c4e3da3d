"""Triton backend: fused lm_head GEMM + online-softmax statistics, exact gradients, two memory routes.

Fast route (default; cross-entropy with ``mean``/``sum`` and gradients), 6NDV. Per chunk of ``C`` tokens:

1. ``kernels.logits_tiles`` (stats mode, writing ``P``): one Triton GEMM whose epilogue keeps per-tile row
   max/sum-exp, the target logit and (label smoothing) the row sum of logits, and writes ``P = exp(z - m_t)``
   in the inputs' dtype: the logits themselves are never written;
2. per-row reduction of the tile statistics; under a group, one packed all-gather of (max, sum, target logit,
   sum of logits) (``vpce.parallel``) gives every rank the global ``lse``; the chunk runs as two halves so that
   the first half's all-gather overlaps the second half's GEMM;
3. ``kernels.probs_to_grad_`` rescales ``P`` in place into the gradient at unit upstream scale;
4. cuBLAS: ``dX[chunk] = dz @ W`` (fp32 out) and ``dW += dz.T @ X[chunk]`` into an fp32 accumulator; under a
   group the chunk's ``dX`` rows are summed over the group (async, under the dW GEMM; ``HiddenGradReduce``).

Backward scales the held ``dX``, ``dW``, ``db`` by the upstream gradient (and ``1/count`` for ``mean``) and casts
them in one pass. Memory: ``P`` (``C * V_local`` values; by default 1.5 GiB but at most the fp32 ``dW``
accumulator's size), the fp32 ``dW`` accumulator, fp32 ``dX``.

Lean route (``memory_budget="lean"``, ``reduction="none"``, a second backward, and ``linear_log_probs``), 8NDV.
Forward runs the GEMM in stats mode only (no ``P``) and keeps the global ``lse`` (and ``E[z]`` for the entropy)
per token. Backward walks the vocab in blocks of ``Vb`` rows over all tokens: the GEMM in grad mode writes the
gradient ``[N, Vb]`` directly, then cuBLAS ``dW[block] = dz.T @ X`` (each block's dW in one GEMM over all tokens:
no dW accumulator) and ``dX += dz @ W[block]`` into an fp32 ``[N, D]`` accumulator. Memory: one ``[N, Vb]`` block
plus fp32 dX.

No-grad: the stats-mode GEMM over token chunks; O(N) memory beyond the small per-tile statistics.

``P`` has the inputs' dtype. With a soft cap the fast route recovers each capped logit from ``P`` for the cap's
derivative (exactly at the target column, from the target logit); where ``P`` underflowed the probability is 0
and only the label-smoothing term would still need that logit, so soft cap + label smoothing takes the lean route
when ``P`` can underflow inside the cap's range ``z - m_t >= -2 * cap``: fp16 (``P`` flushes to 0 below
``exp(-17)``) or a cap above 40 (bf16/fp32 flush below ``exp(-87)``).
"""

from __future__ import annotations

import math

import torch

from . import kernels
from .formulas import Coefficients, ce_coefficients, ce_loss, logprob_coefficients, logprob_outputs
from .gemm import addmm_out_, mm_into, mm_out
from .grads import pad_rows, weight_grad
from .options import LossOptions
from .parallel import HiddenGradReduce, VocabShard, combine_packed, exchange_packed, gather_sequence
from .targets import TokenTargets

__all__ = ["TritonLinearCrossEntropy", "TritonLinearLogProbs", "fast_route", "FAST_P_GIB", "LEAN_BLOCK_GIB"]

FAST_P_GIB = 1.5     # default size of the fast route's 16-bit P chunk (freed before backward's peak)
MIN_P_GIB = 0.25     # ... and its floor when the fp32 dW accumulator is smaller than FAST_P_GIB
LEAN_BLOCK_GIB = 0.2  # default size of the lean route's [N, Vb] block
STATS_TOKENS = 8192  # tokens per stats-only launch (bounds the per-tile statistics buffers)
ROW_ALIGN = 128      # chunk and sub-chunk boundaries are multiples of the kernel's largest BLOCK_M
# Tuning switches (measured side by side by launch/profile_tp.py): under a group, run each chunk as two halves so
# that the statistics exchange overlaps GEMM work, and sum the fast route's dX over the group in forward.
SPLIT_FOR_OVERLAP = True
REDUCE_DX_IN_FORWARD = True
FUSED_STATS = True  # per-chunk tile reduction and combine as two Triton launches instead of ~20 torch ops


def _round_to(x: int, m: int) -> int:
    return max(m, (x // m) * m)


def _fast_chunk(opts: LossOptions, shard: VocabShard, dtype: torch.dtype, d: int) -> int:
    """Tokens per fast-route chunk; equal on every rank (depends on vocab_size / world, not V_local).

    By default ``P`` gets ``FAST_P_GIB``, but never more than the fp32 dW accumulator (at least
    ``MIN_P_GIB``): under tensor parallelism the shard's accumulator shrinks with the group and so does ``P``.
    """
    cols = max(1, math.ceil(shard.vocab_size / shard.world))
    if isinstance(opts.memory_budget, float):
        gib = opts.memory_budget
    else:
        gib = min(FAST_P_GIB, max(MIN_P_GIB, cols * d * 4 / 2**30))
    per_tok = cols * torch.empty((), dtype=dtype).element_size()
    return _round_to(int(gib * 2**30) // per_tok, ROW_ALIGN)


def fast_route(opts: LossOptions, needs_grad, dtype: torch.dtype) -> bool:
    """Whether the cross-entropy forms its gradients in forward (see the module docstring for the corner)."""
    cap_corner = (opts.label_smoothing > 0 and opts.softcap is not None
                  and (opts.softcap > 40 or dtype == torch.float16))
    return any(needs_grad) and opts.reduction != "none" and not opts.lean and not cap_corner


def _local_targets(tg: TokenTargets) -> torch.Tensor:
    return torch.where(tg.in_shard, tg.idx, -1).to(torch.int32)


class _ChunkStats:
    """Per-tile statistics buffers for a chunk of tokens, and the pass that turns them into global per-token
    statistics (one packed collective under a group).

    ``parts`` runs a chunk as sub-chunks: under a group each sub-chunk's exchange is started asynchronously and
    overlaps the next sub-chunk's GEMM; the results come back in order.
    """

    def __init__(self, rows: int, v: int, x: torch.Tensor, sum_z: bool, sum_ez: bool):
        n_tiles = max(1, math.ceil(v / kernels.tile_n(x)))
        f32 = dict(dtype=torch.float32, device=x.device)
        self.m = torch.empty(rows, n_tiles, **f32)
        self.s = torch.empty(rows, n_tiles, **f32)
        self.z = torch.empty(rows, n_tiles, **f32) if sum_z else None
        self.ez = torch.empty(rows, n_tiles, **f32) if sum_ez else None
        self.zt = torch.zeros(rows, **f32)

    def _launch(self, h, w, b, tl_local, sl: slice, r: slice, shard: VocabShard, softcap, inv_t, p):
        """Kernel and local reduction for tokens ``sl`` into buffer rows ``r``; starts the exchange."""
        c = sl.stop - sl.start
        n_sums = 2 if self.z is not None else 1
        cut = lambda t: None if t is None else t[r]  # noqa: E731
        if shard.valid_rows > 0:
            zt = self.zt[r].zero_()
            kernels.logits_tiles(h[sl], w, b, tl_local[sl], softcap=softcap, inv_t=inv_t, tile_m=self.m[r],
                                 tile_s=self.s[r], tile_z=cut(self.z), tile_ez=cut(self.ez), zt=zt, p=p)
            if FUSED_STATS:
                packed = kernels.reduce_tiles(self.m[r], self.s[r], cut(self.z), cut(self.ez), zt)
            else:
                m_t = self.m[r]
                m = m_t.amax(1)
                rescale = torch.exp(m_t - m[:, None])
                packed = torch.stack([m, (self.s[r] * rescale).sum(1), zt]
                                     + ([self.z[r].sum(1)] if self.z is not None else [])
                                     + ([(self.ez[r] * rescale).sum(1)] if self.ez is not None else []))
        else:  # this rank's rows are all padding: max -inf, every sum 0
            packed = torch.zeros(2 + n_sums + (self.ez is not None), c, dtype=torch.float32, device=h.device)
            packed[0] = -math.inf
        combine = kernels.combine_stats if FUSED_STATS else combine_packed
        return exchange_packed(packed, n_sums, shard, combine=combine)

    def parts(self, h, w, b, tl_local, sl: slice, shard: VocabShard, softcap, inv_t=1.0, p=None):
        """Yield ``(part, rows, lse, z_t, [sum z], [E z])`` for the sub-chunks of tokens ``sl`` (global
        statistics); ``rows``: the part's rows in the chunk buffers (and in ``p``, the fast route's P)."""
        c = sl.stop - sl.start
        cuts = [0, c]
        if shard.sharded and SPLIT_FOR_OVERLAP and c >= 4 * ROW_ALIGN:
            cuts = [0, _round_to(c // 2, ROW_ALIGN), c]  # the first half's exchange hides behind the second's GEMM
        pending = []
        for lo, hi in zip(cuts[:-1], cuts[1:]):
            part, r = slice(sl.start + lo, sl.start + hi), slice(lo, hi)
            pending.append((part, r, self._launch(h, w, b, tl_local, part, r, shard, softcap, inv_t,
                                                  None if p is None else p[r])))
        for part, r, pend in pending:
            lse, sums, expect = pend.wait()
            yield part, r, lse, sums[0], sums[1] if len(sums) > 1 else None, expect[0] if expect else None


def _recompute_grads(hidden, weight, bias, tl_local, lse, coef: Coefficients, shard: VocabShard, softcap,
                     inv_t: float, needs, main_weight=None):
    """dX (fp32 [N, D]), dW and db from the logits recomputed over vocab blocks of all tokens (grad mode).

    ``main_weight``: add dW in fp32 into its ``main_grad`` instead of returning it.
    """
    n, d = hidden.shape
    v, rows, dtype = shard.valid_rows, weight.shape[0], hidden.dtype
    need_dx, need_dw, need_db = needs
    dx = torch.zeros(n, d, dtype=torch.float32, device=hidden.device) if need_dx else None
    dw = torch.zeros(rows, d, dtype=dtype, device=hidden.device) if need_dw and main_weight is None else None
    db = torch.zeros(rows, dtype=torch.float32, device=hidden.device) if need_db and bias is not None else None
    bn = kernels.tile_n(hidden)
    vb = _round_to(int(LEAN_BLOCK_GIB * 2**30) // max(1, n * hidden.element_size()), bn)
    block = torch.empty(n, min(vb, max(v, 1)), dtype=dtype, device=hidden.device) if n and v else None
    for v0 in range(0, v if n else 0, vb):
        v1 = min(v, v0 + vb)
        gz = block[:, : v1 - v0]
        kernels.logits_tiles(hidden, weight[v0:v1], None if bias is None else bias[v0:v1], tl_local - v0,
                             softcap=softcap, inv_t=inv_t, p=gz, lse=lse, coef=coef)
        if dw is not None:
            torch.mm(gz.t(), hidden, out=dw[v0:v1])  # the block's dW over all tokens: one GEMM, one rounding
        elif main_weight is not None and need_dw:
            addmm_out_(main_weight.main_grad[v0:v1], gz.t(), hidden)  # fp32 accumulation into main_grad
        if dx is not None:
            addmm_out_(dx, gz, weight[v0:v1])
        if db is not None:
            db[v0:v1] = gz.sum(0, dtype=torch.float32)
    if main_weight is not None and need_dw:
        dw = weight_grad(None, main_weight, dtype)
    return (None if dx is None else dx.to(dtype), dw, None if db is None else db.to(dtype))


class TritonLinearCrossEntropy(torch.autograd.Function):
    """Inputs are 2-D ``hidden [N, D]``, 1-D ``target [N]`` and optional ``token_weight [N]``; returns the fp32
    loss per ``reduction``. ``main_grad``: add the weight gradient into ``weight.main_grad`` instead.

    ``dx_comm`` (fast route under a group only): ``"all_reduce"`` (hidden replicated) or ``"sequence_parallel"``
    (``hidden`` is this rank's ``[N / world, D]`` slice, gathered here): ``dX`` is then summed over the group in
    forward, chunk by chunk, overlapped with the chunks' ``dW`` GEMMs (``vpce.parallel.HiddenGradReduce``), and
    the caller puts no collective region in front. ``None``: ``dX`` is this rank's contribution only.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, token_weight, shard: VocabShard, opts: LossOptions,
                needs_grad: tuple[bool, bool, bool], main_grad: bool, dx_comm: str | None = None):
        if dx_comm == "sequence_parallel":
            hidden = gather_sequence(hidden, shard)
        n, d = hidden.shape
        dev = hidden.device
        v = shard.valid_rows
        hidden = hidden.contiguous()
        w = weight[:v]
        b = None if bias is None else bias[:v]
        tg = TokenTargets(target, shard, opts.ignore_index, token_weight)
        tl_local = _local_targets(tg)
        smooth = opts.label_smoothing > 0
        fast = fast_route(opts, needs_grad, hidden.dtype)
        if dx_comm is not None and not (fast and shard.sharded):
            raise RuntimeError(f"vpce: dx_comm={dx_comm!r} needs the fast route under a group")

        loss_tok = torch.empty(n, dtype=torch.float32, device=dev)
        if fast:
            chunk = min(max(n, 1), _fast_chunk(opts, shard, hidden.dtype, d))
            stats = _ChunkStats(chunk, v, hidden, smooth, False)
            p = torch.empty(chunk, v, dtype=hidden.dtype, device=dev) if v > 0 else None
            unit = tg.row_scale(torch.ones((), device=dev).expand(n))
            dx = None
            if needs_grad[0]:  # fp32; an all-padding shard contributes zeros (and still joins the collectives)
                dx = (torch.empty if v > 0 else torch.zeros)(n, d, dtype=torch.float32, device=dev)
            reduce_dx = HiddenGradReduce(dx, shard, dx_comm == "sequence_parallel") \
                if dx is not None and dx_comm is not None else None
            dw = None  # fp32 accumulator, allocated by the first chunk's GEMM (no zero fill)
            db = torch.zeros(v, dtype=torch.float32, device=dev) if needs_grad[2] else None
            for c0 in range(0, n, chunk):
                sl = slice(c0, min(n, c0 + chunk))
                pc = None if p is None else p[: sl.stop - sl.start]
                for part, r, lse, zt, sum_z, _ in stats.parts(hidden, w, b, tl_local, sl, shard, opts.softcap, p=pc):
                    loss_tok[part] = tg.token_loss(ce_loss(lse, zt, sum_z, opts, shard.vocab_size), part)
                    if v > 0:
                        co = ce_coefficients(unit[part], lse, opts, shard.vocab_size)
                        kernels.probs_to_grad_(pc[r], pc[r], stats.m[r], lse, zt, tl_local[part],
                                               (co.a, co.c, co.d), opts.softcap, kernels.tile_n(hidden))
                if v > 0 and dx is not None:
                    mm_into(dx[sl], pc, w)
                if reduce_dx is not None:  # overlaps this chunk's dW GEMM and the next chunk
                    reduce_dx.add(sl)
                if v == 0:
                    continue
                if needs_grad[1]:
                    dw = mm_out(pc.t(), hidden[sl], torch.float32) if dw is None else addmm_out_(dw, pc.t(), hidden[sl])
                if db is not None:
                    db += pc.sum(0, dtype=torch.float32)
            if needs_grad[1] and dw is None:  # no chunk ran (no tokens, or all-padding shard)
                dw = torch.zeros(v, d, dtype=torch.float32, device=dev)
            if reduce_dx is not None:
                dx = reduce_dx.finish()
            ctx.grads = [dx, dw, db]
        else:
            lse_all = torch.empty(n, dtype=torch.float32, device=dev)
            stats = _ChunkStats(min(max(n, 1), STATS_TOKENS), v, hidden, smooth, False)
            for c0 in range(0, n, STATS_TOKENS):
                sl = slice(c0, min(n, c0 + STATS_TOKENS))
                for part, _, lse, zt, sum_z, _ in stats.parts(hidden, w, b, tl_local, sl, shard, opts.softcap):
                    loss_tok[part] = tg.token_loss(ce_loss(lse, zt, sum_z, opts, shard.vocab_size), part)
                    lse_all[part] = lse
            if any(needs_grad):
                ctx.save_for_backward(hidden, weight, bias, target, token_weight, lse_all)
        ctx.fast, ctx.shard, ctx.opts = fast, shard, opts
        ctx.denominator = tg.denominator(torch.float32)
        ctx.like = (hidden.dtype, weight if main_grad else weight.shape[0])
        return tg.reduce(loss_tok, opts.reduction)

    @staticmethod
    def backward(ctx, grad_out):
        dtype, rows_or_weight = ctx.like
        main = rows_or_weight if isinstance(rows_or_weight, torch.Tensor) else None
        g = grad_out.detach().float()
        if ctx.opts.reduction == "mean":
            g = g / ctx.denominator
        if not ctx.fast:
            hidden, weight, bias, target, token_weight, lse_all = ctx.saved_tensors
            shard, opts = ctx.shard, ctx.opts
            tg = TokenTargets(target, shard, opts.ignore_index, token_weight)
            scale = tg.row_scale(g.expand(hidden.shape[0]) if g.dim() == 0 else g.reshape(-1))
            coef = ce_coefficients(scale, lse_all, opts, shard.vocab_size)
            grads = _recompute_grads(hidden, weight, bias, _local_targets(tg), lse_all, coef, shard, opts.softcap,
                                     1.0, ctx.needs_input_grad[:3], main)
            return (*grads, None, None, None, None, None, None, None)
        if ctx.grads is None:
            raise RuntimeError("vpce: this loss formed its gradients in forward and they were already "
                               "used; for a second backward pass use memory_budget='lean'")
        (dx, dw, db), ctx.grads = ctx.grads, None
        rows = rows_or_weight if main is None else main.shape[0]
        dx = None if dx is None else kernels.scale_cast(dx, g, dtype)
        db = None if db is None else pad_rows(db.mul_(g), rows, dtype)
        if main is not None:  # fp32 straight into main_grad, never rounded
            dw = weight_grad(None if dw is None else dw.mul_(g), main, dtype)
        else:
            dw = None if dw is None else pad_rows(kernels.scale_cast(dw, g, dtype), rows, dtype)
        return dx, dw, db, None, None, None, None, None, None, None


class TritonLinearLogProbs(torch.autograd.Function):
    """Per-token ``log p(target)`` (and entropy) of ``softmax(cap(x) / T)``; ignored tokens give 0 for both.
    Always the lean route: forward keeps ``lse`` and ``E[z]``; backward recomputes over vocab blocks."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, shard: VocabShard, softcap, inv_t: float, ignore_index: int,
                entropy: bool, needs_grad: tuple[bool, bool, bool]):
        n = hidden.shape[0]
        dev = hidden.device
        hidden = hidden.contiguous()
        v = shard.valid_rows
        w = weight[:v]
        b = None if bias is None else bias[:v]
        tg = TokenTargets(target, shard, ignore_index)
        tl_local = _local_targets(tg)
        lse_all = torch.empty(n, dtype=torch.float32, device=dev)
        zt_all = torch.empty(n, dtype=torch.float32, device=dev)
        mean_z = torch.empty(n, dtype=torch.float32, device=dev) if entropy else None
        stats = _ChunkStats(min(max(n, 1), STATS_TOKENS), v, hidden, False, entropy)
        for c0 in range(0, n, STATS_TOKENS):
            sl = slice(c0, min(n, c0 + STATS_TOKENS))
            for part, _, lse, zt, _, ez in stats.parts(hidden, w, b, tl_local, sl, shard, softcap, inv_t):
                lse_all[part], zt_all[part] = lse, zt
                if entropy:
                    mean_z[part] = ez
        logp, ent = logprob_outputs(tg, lse_all, zt_all, mean_z)
        if any(needs_grad):
            ctx.save_for_backward(hidden, weight, bias, target, lse_all, mean_z)
        ctx.shard, ctx.softcap, ctx.inv_t, ctx.ignore_index = shard, softcap, inv_t, ignore_index
        return (logp, ent) if entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        hidden, weight, bias, target, lse_all, mean_z = ctx.saved_tensors
        tg = TokenTargets(target, ctx.shard, ctx.ignore_index)
        coef = logprob_coefficients(tg, g_logp, g_ent, mean_z, ctx.inv_t, like=lse_all)
        grads = _recompute_grads(hidden, weight, bias, _local_targets(tg), lse_all, coef, ctx.shard, ctx.softcap,
                                 ctx.inv_t, ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None, None, None, None)
