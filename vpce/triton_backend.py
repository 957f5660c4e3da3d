"""Triton backend: fused lm_head GEMM + online-softmax statistics, exact gradients, two memory routes.

Fast route (default; ``mean``/``sum`` with gradients), 6NDV. Per chunk of ``C`` tokens:

1. ``kernels.logits_tiles`` (stats mode, writing ``P``): one Triton GEMM whose epilogue keeps per-tile row
   max/sum-exp, the target logit and (label smoothing) the row sum of logits, and writes ``P = exp(z - m_t)``
   in 16 bits (fp32 for fp32 inputs): the logits themselves are never written;
2. per-row reduction of the tile statistics; under a group, one packed all-gather of (max, sum, target logit,
   sum of logits) per chunk (``vpce.parallel``) gives every rank the global ``lse``;
3. ``kernels.probs_to_grad_`` rescales ``P`` in place into ``dL/dz`` at unit upstream scale;
4. cuBLAS: ``dX[chunk] = dz @ W`` (fp32 out) and ``dW += dz.T @ X[chunk]`` into an fp32 accumulator.

Backward multiplies the held ``dX``, ``dW``, ``db`` by the upstream gradient (and ``1/count`` for ``mean``).
Memory: ``P`` (``C * V_local`` 16-bit values), the fp32 ``dW`` accumulator, fp32 ``dX``.

Lean route (``memory_budget="lean"``, ``reduction="none"``, or a second backward), 8NDV. Forward runs the GEMM in
stats mode only (no ``P``) and keeps the global ``lse`` per token. Backward walks the vocab in blocks of ``Vb``
rows over all tokens: the GEMM in grad mode writes ``dz [N, Vb]`` directly (``lse`` is known), then cuBLAS
``dW[block] = dz.T @ X`` (each block's dW in one GEMM over all tokens: no dW accumulator) and
``dX += dz @ W[block]`` into an fp32 ``[N, D]`` accumulator. Memory: one ``[N, Vb]`` block plus fp32 dX.

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
from .gemm import addmm_out_, mm_out
from .grads import pad_rows, weight_grad
from .options import LossOptions
from .parallel import VocabShard, combine_softmax_stats
from .targets import TokenTargets

__all__ = ["TritonLinearCrossEntropy", "FAST_P_GIB", "LEAN_BLOCK_GIB"]

FAST_P_GIB = 1.5     # default size of the fast route's 16-bit P chunk (freed before backward's peak)
LEAN_BLOCK_GIB = 0.2  # default size of the lean route's [N, Vb] block
STATS_TOKENS = 8192  # tokens per stats-only launch (bounds the per-tile statistics buffers)


def _round_to(x: int, m: int) -> int:
    return max(m, (x // m) * m)


def _fast_chunk(opts: LossOptions, shard: VocabShard, dtype: torch.dtype, tile_m: int) -> int:
    """Tokens per fast-route chunk; equal on every rank (depends on vocab_size / world, not V_local)."""
    gib = opts.memory_budget if isinstance(opts.memory_budget, float) else FAST_P_GIB
    cols = max(1, math.ceil(shard.vocab_size / shard.world))
    per_tok = cols * torch.empty((), dtype=dtype).element_size()
    return _round_to(int(gib * 2**30) // per_tok, tile_m)


class _Stats:
    """Per-tile statistics buffers for one chunk of tokens, and their reduction to per-row values."""

    def __init__(self, rows: int, n_tiles: int, smooth: bool, device):
        f32 = dict(dtype=torch.float32, device=device)
        self.m = torch.empty(rows, n_tiles, **f32)
        self.s = torch.empty(rows, n_tiles, **f32)
        self.z = torch.empty(rows, n_tiles, **f32) if smooth else None
        self.zt = torch.zeros(rows, **f32)

    def view(self, c: int):
        return dict(tile_m=self.m[:c], tile_s=self.s[:c], tile_z=None if self.z is None else self.z[:c],
                    zt=self.zt[:c].zero_())

    def reduce(self, c: int):
        """Local (max, sum of exp, [target logit, sum of logits]) per row of the first ``c`` rows."""
        m_t, s_t = self.m[:c], self.s[:c]
        m = m_t.amax(1)
        s = (s_t * torch.exp(m_t - m[:, None])).sum(1)
        sums = [self.zt[:c]] + ([self.z[:c].sum(1)] if self.z is not None else [])
        return m, s, sums


def _chunk_loss(h, w, b, tl_local, tg: TokenTargets, sl: slice, shard: VocabShard, opts: LossOptions,
                stats: _Stats | None, p: torch.Tensor | None):
    """Stats-mode GEMM over one chunk, the group exchange, and the chunk's per-token loss and lse."""
    c = sl.stop - sl.start
    eps = opts.label_smoothing
    if shard.valid_rows > 0:
        kernels.logits_tiles(h[sl], w, b, tl_local[sl], opts, shard.vocab_size, p=p, **stats.view(c))
        m, s, sums = stats.reduce(c)
    else:  # this rank's rows are all padding
        m = torch.full((c,), -math.inf, device=h.device)
        s = torch.zeros(c, device=h.device)
        sums = [torch.zeros(c, device=h.device) for _ in range(2 if eps else 1)]
    lse, sums = combine_softmax_stats(m, s, sums, shard)
    loss = lse - (1 - eps) * sums[0]
    if eps:
        loss = loss - (eps / shard.vocab_size) * sums[1]
    if opts.z_loss:
        loss = loss + opts.z_loss * lse * lse
    return tg.token_loss(loss, sl), lse, sums[0]


class TritonLinearCrossEntropy(torch.autograd.Function):
    """Inputs are 2-D ``hidden [N, D]``, 1-D ``target [N]`` and optional ``token_weight [N]``; returns the fp32
    loss per ``reduction``. ``main_grad``: add the weight gradient into ``weight.main_grad`` instead."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, token_weight, shard: VocabShard, opts: LossOptions,
                needs_grad: tuple[bool, bool, bool], main_grad: bool):
        n, d = hidden.shape
        dev = hidden.device
        v = shard.valid_rows
        hidden = hidden.contiguous()
        w = weight[:v]
        b = None if bias is None else bias[:v]
        tg = TokenTargets(target, shard, opts.ignore_index, token_weight)
        tl_local = torch.where(tg.in_shard, tg.idx, -1).to(torch.int32)
        bn = kernels.tile_n(hidden)
        n_tiles = max(1, math.ceil(v / bn))
        smooth = opts.label_smoothing > 0
        cap_corner = smooth and opts.softcap is not None and (opts.softcap > 40 or hidden.dtype == torch.float16)
        fast = any(needs_grad) and opts.reduction != "none" and not opts.lean and not cap_corner

        loss_tok = torch.empty(n, dtype=torch.float32, device=dev)
        if fast:
            chunk = min(max(n, 1), _fast_chunk(opts, shard, hidden.dtype, 128))
            stats = _Stats(chunk, n_tiles, smooth, dev)
            p = torch.empty(chunk, v, dtype=hidden.dtype, device=dev) if v > 0 else None
            unit = tg.row_scale(torch.ones((), device=dev).expand(n)).contiguous()
            dx = torch.empty(n, d, dtype=torch.float32, device=dev) if needs_grad[0] else None
            dw = None  # fp32 accumulator, allocated by the first chunk's GEMM (no zero fill)
            db = torch.zeros(v, dtype=torch.float32, device=dev) if needs_grad[2] else None
            for c0 in range(0, n, chunk):
                sl = slice(c0, min(n, c0 + chunk))
                c = sl.stop - sl.start
                pc = None if p is None else p[:c]
                loss_tok[sl], lse, zt = _chunk_loss(hidden, w, b, tl_local, tg, sl, shard, opts, stats, pc)
                if v == 0:
                    continue
                gz = pc  # dL/dz overwrites P in place
                kernels.probs_to_grad_(pc, gz, stats.m[:c], lse, zt, unit[sl], tl_local[sl], opts,
                                       shard.vocab_size, bn)
                if dx is not None:
                    dx[sl] = mm_out(gz, w, torch.float32)
                if needs_grad[1]:
                    dw = mm_out(gz.t(), hidden[sl], torch.float32) if dw is None else addmm_out_(dw, gz.t(), hidden[sl])
                if db is not None:
                    db += gz.sum(0, dtype=torch.float32)
            if needs_grad[1] and dw is None:  # no chunk ran (no tokens, or all-padding shard)
                dw = torch.zeros(v, d, dtype=torch.float32, device=dev)
            if dx is not None and n and v == 0:
                dx.zero_()
            ctx.grads = [dx, dw, db]
        else:
            lse_all = torch.empty(n, dtype=torch.float32, device=dev)
            stats = _Stats(min(max(n, 1), STATS_TOKENS), n_tiles, smooth, dev)
            for c0 in range(0, n, STATS_TOKENS):
                sl = slice(c0, min(n, c0 + STATS_TOKENS))
                loss_tok[sl], lse_all[sl], _ = _chunk_loss(hidden, w, b, tl_local, tg, sl, shard, opts, stats, None)
            if any(needs_grad):
                ctx.save_for_backward(hidden, weight, bias, target, token_weight, lse_all)
        ctx.fast, ctx.shard, ctx.opts = fast, shard, opts
        ctx.denominator = tg.denominator(torch.float32)
        ctx.like = (hidden.dtype, weight if main_grad else weight.shape[0])
        return tg.reduce(loss_tok, opts.reduction)

    @staticmethod
    def backward(ctx, grad_out):
        dtype, rows_or_weight = ctx.like
        if not ctx.fast:
            return _lean_backward(ctx, grad_out)
        if ctx.grads is None:
            raise RuntimeError("vpce: this loss formed its gradients in forward and they were already "
                               "used; for a second backward pass use memory_budget='lean'")
        (dx, dw, db), ctx.grads = ctx.grads, None
        g = grad_out.detach().float()
        if ctx.opts.reduction == "mean":
            g = g / ctx.denominator
        rows = rows_or_weight if isinstance(rows_or_weight, int) else rows_or_weight.shape[0]
        dx = None if dx is None else kernels.scale_cast(dx, g, dtype)
        db = None if db is None else pad_rows(db.mul_(g), rows, dtype)
        if isinstance(rows_or_weight, torch.Tensor):  # fp32 straight into main_grad, never rounded
            dw = weight_grad(None if dw is None else dw.mul_(g), rows_or_weight, dtype)
        else:
            dw = None if dw is None else pad_rows(kernels.scale_cast(dw, g, dtype), rows, dtype)
        return dx, dw, db, None, None, None, None, None, None


def _lean_backward(ctx, grad_out):
    hidden, weight, bias, target, token_weight, lse_all = ctx.saved_tensors
    shard, opts = ctx.shard, ctx.opts
    dtype, rows_or_weight = ctx.like
    main = isinstance(rows_or_weight, torch.Tensor)
    rows = weight.shape[0]
    n, d = hidden.shape
    v = shard.valid_rows
    tg = TokenTargets(target, shard, opts.ignore_index, token_weight)
    tl_local = torch.where(tg.in_shard, tg.idx, -1).to(torch.int32)
    g = grad_out.detach().float()
    if opts.reduction == "mean":
        g = g / tg.denominator(torch.float32)
    scale = tg.row_scale(g.expand(n) if g.dim() == 0 else g.reshape(n)).contiguous()

    need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
    dx = torch.zeros(n, d, dtype=torch.float32, device=hidden.device) if need_dx else None
    dw = torch.zeros(rows, d, dtype=dtype, device=hidden.device) if need_dw and not main else None
    db = torch.zeros(rows, dtype=torch.float32, device=hidden.device) if need_db and bias is not None else None
    bn = kernels.tile_n(hidden)
    gib = LEAN_BLOCK_GIB
    vb = _round_to(int(gib * 2**30) // max(1, n * hidden.element_size()), bn)
    block = torch.empty(n, min(vb, max(v, 1)), dtype=dtype, device=hidden.device) if n and v else None
    for v0 in range(0, v if n else 0, vb):
        v1 = min(v, v0 + vb)
        gz = block[:, : v1 - v0]
        kernels.logits_tiles(hidden, weight[v0:v1], None if bias is None else bias[v0:v1], tl_local - v0, opts,
                             shard.vocab_size, p=gz, lse=lse_all, scale=scale)
        if dw is not None:
            torch.mm(gz.t(), hidden, out=dw[v0:v1])  # the block's dW over all tokens: one GEMM, one rounding
        elif main and need_dw:
            addmm_out_(rows_or_weight.main_grad[v0:v1], gz.t(), hidden)  # fp32 accumulation into main_grad
        if dx is not None:
            addmm_out_(dx, gz, weight[v0:v1])
        if db is not None:
            db[v0:v1] = gz.sum(0, dtype=torch.float32)
    if main and need_dw:
        dw = weight_grad(None, rows_or_weight, dtype)
    return (None if dx is None else dx.to(dtype), dw, None if db is None else db.to(dtype),
            None, None, None, None, None, None)
