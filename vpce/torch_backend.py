"""Pure-PyTorch backend: exact, memory-bounded linear + cross-entropy over a (possibly sharded) vocab.

This is the CPU backend and the chunked reference the Triton kernels are compared against. It never allocates
``[N, V_local]``: it walks the tokens in chunks of ``C`` rows, ``C`` sized so that the live chunk data (the
logits in the input dtype, their fp32 copy, the probabilities and their cast) stay inside the memory budget
(default 0.25 GiB). Softmax statistics are fp32 (float64 for float64 inputs).

The per-token formulas (loss from the global statistics; gradient ``(p (a + b z) + c [j == t] + d) * dcap`` with
per-row coefficients) are in ``vpce.formulas``, shared with the Triton backend. Through the soft cap
``y = c tanh(x / c)`` the derivative is ``1 - (y / c)**2``.

Two routes (``LossOptions.memory_budget``):

* fast (6NDV), for ``mean``/``sum`` when gradients are needed: per chunk, logits -> global statistics (one
  packed collective under a group) -> loss and the chunk's gradient while its logits are live: ``dX`` rows
  written once, ``dW`` accumulated across chunks in fp32. Backward only scales them by the upstream gradient.
* lean / recompute (8NDV): forward keeps only the global ``lse`` (and ``E[z]`` for the entropy) per token;
  backward recomputes each chunk's logits and forms the gradient with any per-token upstream gradient.
  ``reduction="none"`` and ``linear_log_probs`` always take it.

Under a group every rank runs the same number of chunks (the chunk size depends only on values that are equal
on every rank), so the per-chunk collectives line up. ``dX`` is this shard's contribution; the caller
(``vpce.parallel.enter_vocab_parallel``) sums it over the group.
"""

from __future__ import annotations

import math

import torch

from .formulas import Coefficients, ce_coefficients, ce_loss, logprob_coefficients, logprob_outputs
from .gemm import mm_out
from .grads import pad_rows, weight_grad
from .options import LossOptions
from .parallel import VocabShard, combine_softmax_stats
from .targets import TokenTargets

__all__ = ["chunk_tokens", "fast_route", "TorchLinearCrossEntropy", "TorchLinearLogProbs"]


def chunk_tokens(budget_gib: float, shard: VocabShard, dtype: torch.dtype, softcap: bool) -> int:
    """Tokens per chunk so that the chunk's live data fits ``budget_gib``; equal on every rank of the group."""
    acc = 8 if dtype == torch.float64 else 4
    per_logit = 2 * torch.finfo(dtype).bits // 8 + (3 if softcap else 2) * acc
    cols = max(1, math.ceil(shard.vocab_size / shard.world))
    return max(1, int(budget_gib * 2**30) // (cols * per_logit))


def fast_route(opts: LossOptions, needs_grad, dtype: torch.dtype) -> bool:
    """Whether the cross-entropy forms its gradients in forward (the fast route)."""
    return any(needs_grad) and opts.reduction != "none" and not opts.lean


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, softcap: float | None, acc: torch.dtype,
            inv_t: float = 1.0) -> torch.Tensor:
    z = mm_out(h, w.t(), acc)
    if b is not None:
        z += b.to(acc)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    if inv_t != 1.0:
        z.mul_(inv_t)
    return z


def _logit_grad_(z: torch.Tensor, lse: torch.Tensor, co: Coefficients, t_idx: torch.Tensor,
                 in_shard: torch.Tensor, softcap: float | None, inv_t: float = 1.0) -> torch.Tensor:
    """Turn the chunk's logits ``z`` [c, v] into ``(p (a + b z) + c [j == t] + d) * dcap``, in place."""
    cap = None if softcap is None else 1 - (z / (softcap * inv_t)) ** 2
    bz = None if co.b is None else z * co.b[:, None] + co.a[:, None]
    p = z.sub_(lse[:, None]).exp_()
    p.mul_(co.a[:, None] if bz is None else bz)
    if co.d is not None:
        p.add_(co.d[:, None])
    p.scatter_add_(1, t_idx[:, None], torch.where(in_shard, co.c, 0)[:, None])
    if cap is not None:
        p.mul_(cap)
    return p


def _accumulate(g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, sl: slice, dx, dw, db):
    """Add one chunk's logit gradient ``g`` [c, v] into dX (rows ``sl``), the dW and db accumulators."""
    if dx is not None:
        dx[sl] = mm_out(g.to(w.dtype), w, g.dtype)
    if dw is not None:
        dw.addmm_(g.t(), h.to(g.dtype))
    if db is not None:
        db += g.sum(0)


def _chunk_stats(hidden, w, b, tg: TokenTargets, sl: slice, shard: VocabShard, softcap, acc, *, sum_z=False,
                 sum_ez=False, inv_t=1.0):
    """Logits of the rows ``sl`` (None on an all-padding shard) and their global ``(lse, z_t, sum z, E z)``."""
    c = sl.stop - sl.start
    weighted = []
    if shard.valid_rows > 0:
        z = _logits(hidden[sl], w, b, softcap, acc, inv_t)
        m = z.amax(1)
        e = torch.exp(z - m[:, None])
        s = e.sum(1)
        if sum_ez:
            weighted = [(e * z).sum(1)]
        del e
        sums = [torch.where(tg.in_shard[sl], z.gather(1, tg.idx[sl, None]).squeeze(1), 0)]
        if sum_z:
            sums.append(z.sum(1))
    else:  # this rank's rows are all padding
        z = None
        m = torch.full((c,), -math.inf, dtype=acc, device=hidden.device)
        s = torch.zeros_like(m)
        sums = [torch.zeros_like(m) for _ in range(2 if sum_z else 1)]
        weighted = [torch.zeros_like(m)] if sum_ez else []
    lse, sums, expect = combine_softmax_stats(m, s, sums, shard, weighted)
    return z, lse, sums[0], sums[1] if sum_z else None, expect[0] if sum_ez else None


def _recompute_grads(hidden, weight, bias, tg: TokenTargets, lse_all, coef: Coefficients, shard: VocabShard,
                     chunk: int, softcap, inv_t: float, needs, main_weight=None):
    """dX, dW, db from logits recomputed chunk by chunk (any per-token coefficients)."""
    n, d = hidden.shape
    acc, dtype, rows, v = lse_all.dtype, hidden.dtype, weight.shape[0], shard.valid_rows
    w = weight[:v]
    b = None if bias is None else bias[:v]
    need_dx, need_dw, need_db = needs
    dx = torch.zeros(n, d, dtype=acc, device=hidden.device) if need_dx else None
    dw = torch.zeros(v, d, dtype=acc, device=hidden.device) if need_dw else None
    db = torch.zeros(v, dtype=acc, device=hidden.device) if need_db and bias is not None else None
    if v > 0:
        for c0 in range(0, n, chunk):
            sl = slice(c0, min(n, c0 + chunk))
            z = _logits(hidden[sl], w, b, softcap, acc, inv_t)
            _accumulate(_logit_grad_(z, lse_all[sl], coef.rows(sl), tg.idx[sl], tg.in_shard[sl], softcap, inv_t),
                        hidden[sl], w, sl, dx, dw, db)
            del z  # before the next chunk's logits exist
    return (None if dx is None else dx.to(dtype), weight_grad(dw, rows if main_weight is None else main_weight, dtype),
            pad_rows(db, rows, dtype))


class TorchLinearCrossEntropy(torch.autograd.Function):
    """Inputs are 2-D ``hidden [N, D]``, 1-D ``target [N]`` and optional ``token_weight [N]``; returns the fp32
    (fp64) loss per ``reduction``. ``main_grad``: add the weight gradient into ``weight.main_grad`` instead."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, token_weight, shard: VocabShard, opts: LossOptions,
                needs_grad: tuple[bool, bool, bool], main_grad: bool):
        n, d = hidden.shape
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        v = shard.valid_rows
        w = weight[:v]
        b = None if bias is None else bias[:v]
        tg = TokenTargets(target, shard, opts.ignore_index, token_weight)
        smooth = opts.label_smoothing > 0
        chunk = chunk_tokens(opts.chunk_gib(), shard, hidden.dtype, opts.softcap is not None)

        eager = fast_route(opts, needs_grad, hidden.dtype)
        if eager:
            # Rows at unit scale; 1/count (mean) and the upstream gradient are applied in backward, so the cast
            # of the chunk gradient to fp16 keeps full precision (and loss scaling keeps working).
            unit = tg.row_scale(hidden.new_ones((), dtype=acc).expand(n))
            dx = torch.zeros(n, d, dtype=acc, device=hidden.device) if needs_grad[0] else None
            dw = torch.zeros(v, d, dtype=acc, device=hidden.device) if needs_grad[1] else None
            db = torch.zeros(v, dtype=acc, device=hidden.device) if needs_grad[2] else None

        loss_tok = torch.empty(n, dtype=acc, device=hidden.device)
        lse_all = torch.empty(n, dtype=acc, device=hidden.device)
        for c0 in range(0, n, chunk):
            sl = slice(c0, min(n, c0 + chunk))
            z, lse, zt, sum_z, _ = _chunk_stats(hidden, w, b, tg, sl, shard, opts.softcap, acc, sum_z=smooth)
            loss_tok[sl] = tg.token_loss(ce_loss(lse, zt, sum_z, opts, shard.vocab_size), sl)
            lse_all[sl] = lse
            if eager and v > 0:
                co = ce_coefficients(unit[sl], lse, opts, shard.vocab_size)
                _accumulate(_logit_grad_(z, lse, co, tg.idx[sl], tg.in_shard[sl], opts.softcap), hidden[sl], w,
                            sl, dx, dw, db)
            del z  # before the next chunk's logits exist: one chunk live at a time

        ctx.eager, ctx.shard, ctx.opts, ctx.chunk = eager, shard, opts, chunk
        ctx.denominator = tg.denominator(acc)
        ctx.like = (hidden.dtype, weight if main_grad else weight.shape[0])
        if eager:
            ctx.grads = [dx, dw, db]
        elif any(needs_grad):
            ctx.save_for_backward(hidden, weight, bias, target, token_weight, lse_all)
        return tg.reduce(loss_tok, opts.reduction)

    @staticmethod
    def backward(ctx, grad_out):
        dtype, rows_or_weight = ctx.like
        main = rows_or_weight if isinstance(rows_or_weight, torch.Tensor) else None
        g = grad_out.detach() / ctx.denominator if ctx.opts.reduction == "mean" else grad_out.detach()
        if ctx.eager:
            if ctx.grads is None:
                raise RuntimeError("vpce: this loss formed its gradients in forward and they were already "
                                   "used; for a second backward pass use memory_budget='lean'")
            grads, ctx.grads = ctx.grads, None
            dx, dw, db = (None if t is None else t.mul_(g) for t in grads)
            rows = rows_or_weight if main is None else main.shape[0]
            return (None if dx is None else dx.to(dtype), weight_grad(dw, rows_or_weight, dtype),
                    pad_rows(db, rows, dtype), None, None, None, None, None, None)
        hidden, weight, bias, target, token_weight, lse_all = ctx.saved_tensors
        shard, opts = ctx.shard, ctx.opts
        tg = TokenTargets(target, shard, opts.ignore_index, token_weight)
        g = g.to(lse_all.dtype)
        scale = tg.row_scale(g.expand(hidden.shape[0]) if g.dim() == 0 else g.reshape(-1))
        coef = ce_coefficients(scale, lse_all, opts, shard.vocab_size)
        grads = _recompute_grads(hidden, weight, bias, tg, lse_all, coef, shard, ctx.chunk, opts.softcap, 1.0,
                                 ctx.needs_input_grad[:3], main)
        return (*grads, None, None, None, None, None, None)


class TorchLinearLogProbs(torch.autograd.Function):
    """Per-token ``log p(target)`` (and entropy) of ``softmax(cap(x) / T)``; ignored tokens give 0 for both."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, shard: VocabShard, softcap, inv_t: float, ignore_index: int,
                entropy: bool, needs_grad: tuple[bool, bool, bool]):
        n = hidden.shape[0]
        acc = torch.float64 if hidden.dtype == torch.float64 else torch.float32
        v = shard.valid_rows
        w = weight[:v]
        b = None if bias is None else bias[:v]
        tg = TokenTargets(target, shard, ignore_index)
        chunk = chunk_tokens(0.25, shard, hidden.dtype, softcap is not None)
        lse_all = torch.empty(n, dtype=acc, device=hidden.device)
        zt_all = torch.empty(n, dtype=acc, device=hidden.device)
        mean_z = torch.empty(n, dtype=acc, device=hidden.device) if entropy else None
        for c0 in range(0, n, chunk):
            sl = slice(c0, min(n, c0 + chunk))
            z, lse, zt, _, ez = _chunk_stats(hidden, w, b, tg, sl, shard, softcap, acc, sum_ez=entropy, inv_t=inv_t)
            del z
            lse_all[sl], zt_all[sl] = lse, zt
            if entropy:
                mean_z[sl] = ez
        logp, ent = logprob_outputs(tg, lse_all, zt_all, mean_z)
        if any(needs_grad):
            ctx.save_for_backward(hidden, weight, bias, target, lse_all, mean_z)
        ctx.shard, ctx.softcap, ctx.inv_t, ctx.ignore_index, ctx.chunk = shard, softcap, inv_t, ignore_index, chunk
        return (logp, ent) if entropy else logp

    @staticmethod
    def backward(ctx, g_logp, g_ent=None):
        hidden, weight, bias, target, lse_all, mean_z = ctx.saved_tensors
        tg = TokenTargets(target, ctx.shard, ctx.ignore_index)
        coef = logprob_coefficients(tg, g_logp, g_ent, mean_z, ctx.inv_t, like=lse_all)
        grads = _recompute_grads(hidden, weight, bias, tg, lse_all, coef, ctx.shard, ctx.chunk, ctx.softcap,
                                 ctx.inv_t, ctx.needs_input_grad[:3])
        return (*grads, None, None, None, None, None, None, None)
