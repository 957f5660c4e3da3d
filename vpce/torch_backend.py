"""Pure-PyTorch backend: exact, memory-bounded linear + cross-entropy over a (possibly sharded) vocab.

This is the CPU backend and the chunked reference the Triton kernels are compared against. It never allocates
``[N, V_local]``: it walks the tokens in chunks of ``C`` rows, ``C`` sized so that the live chunk data (the
logits in the input dtype, their fp32 copy, the probabilities and their cast) stay inside the memory budget
(default 0.25 GiB). Softmax statistics are fp32 (float64 for float64 inputs).

Per token, with ``z`` the (soft-capped) logits over the real global vocab ``V`` and ``t`` the target::

    lse  = log sum_j exp(z_j)
    loss = lse - (1 - eps) z_t - (eps / V) sum_j z_j + zl * lse**2
    dloss/dz_j = p_j (1 + 2 zl lse) - (1 - eps) [j == t] - eps / V,     p_j = exp(z_j - lse)

and through the soft cap ``z = c tanh(x / c)``: ``dz/dx = 1 - (z / c)**2``.

Two routes (``LossOptions.memory_budget``):

* fast (6NDV), for ``mean``/``sum`` when gradients are needed: per chunk, logits -> global statistics (one
  packed collective under a group) -> loss and the chunk's gradient while its logits are live: ``dX`` rows
  written once, ``dW`` accumulated across chunks in fp32. Backward only scales them by the upstream gradient.
* lean / recompute (8NDV): forward keeps only the global ``lse`` per token; backward recomputes each chunk's
  logits and forms the gradient with any per-token upstream gradient. ``reduction="none"`` always takes it.

Under a group every rank runs the same number of chunks (the chunk size depends only on values that are equal
on every rank), so the per-chunk collectives line up. ``dX`` is this shard's contribution; the caller
(``vpce.parallel.enter_vocab_parallel``) sums it over the group.
"""

from __future__ import annotations

import math

import torch

from .gemm import mm_out
from .grads import pad_rows, weight_grad
from .options import LossOptions
from .parallel import VocabShard, combine_softmax_stats
from .targets import TokenTargets

__all__ = ["chunk_tokens", "TorchLinearCrossEntropy"]


def chunk_tokens(budget_gib: float, shard: VocabShard, dtype: torch.dtype, softcap: bool) -> int:
    """Tokens per chunk so that the chunk's live data fits ``budget_gib``; equal on every rank of the group."""
    acc = 8 if dtype == torch.float64 else 4
    per_logit = 2 * torch.finfo(dtype).bits // 8 + (3 if softcap else 2) * acc
    cols = max(1, math.ceil(shard.vocab_size / shard.world))
    return max(1, int(budget_gib * 2**30) // (cols * per_logit))


def _logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, softcap: float | None,
            acc: torch.dtype) -> torch.Tensor:
    z = mm_out(h, w.t(), acc)
    if b is not None:
        z += b.to(acc)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _logit_grad_(z: torch.Tensor, lse: torch.Tensor, row_scale: torch.Tensor, t_idx: torch.Tensor,
                 in_shard: torch.Tensor, opts: LossOptions, vocab_size: int) -> torch.Tensor:
    """Turn the chunk's logits ``z`` [c, v] into d(loss)/d(pre-cap logits), rows scaled, in place."""
    cap = None if opts.softcap is None else 1 - (z / opts.softcap) ** 2
    p = z.sub_(lse[:, None]).exp_()
    coef = row_scale * (1 + 2 * opts.z_loss * lse) if opts.z_loss else row_scale
    p.mul_(coef[:, None])
    eps = opts.label_smoothing
    if eps:
        p.sub_((row_scale * (eps / vocab_size))[:, None])
    hit = torch.where(in_shard, row_scale * -(1 - eps), 0)
    p.scatter_add_(1, t_idx[:, None], hit[:, None])
    if cap is not None:
        p.mul_(cap)
    return p


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
        eps, zl = opts.label_smoothing, opts.z_loss
        chunk = chunk_tokens(opts.chunk_gib(), shard, hidden.dtype, opts.softcap is not None)

        eager = any(needs_grad) and opts.reduction != "none" and not opts.lean
        if eager:
            # Rows at unit scale; 1/count (mean) and the upstream gradient are applied in backward, so the cast
            # of the chunk gradient to fp16 keeps full precision (and loss scaling keeps working).
            row_scale_all = tg.row_scale(hidden.new_ones((), dtype=acc).expand(n))
            dx = torch.zeros(n, d, dtype=acc, device=hidden.device) if needs_grad[0] else None
            dw = torch.zeros(v, d, dtype=acc, device=hidden.device) if needs_grad[1] else None
            db = torch.zeros(v, dtype=acc, device=hidden.device) if needs_grad[2] else None

        loss_tok = torch.empty(n, dtype=acc, device=hidden.device)
        lse_all = torch.empty(n, dtype=acc, device=hidden.device)
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            sl = slice(c0, c1)
            if v > 0:
                z = _logits(hidden[sl], w, b, opts.softcap, acc)
                m = z.amax(1)
                s = torch.exp(z - m[:, None]).sum(1)
                zt = torch.where(tg.in_shard[sl], z.gather(1, tg.idx[sl, None]).squeeze(1), 0)
                sums = [zt, z.sum(1)] if eps else [zt]
            else:  # this rank's shard is all padding
                m = torch.full((c1 - c0,), -math.inf, dtype=acc, device=hidden.device)
                s = torch.zeros_like(m)
                sums = [torch.zeros_like(m) for _ in range(2 if eps else 1)]
            lse, sums = combine_softmax_stats(m, s, sums, shard)
            loss = lse - (1 - eps) * sums[0]
            if eps:
                loss = loss - (eps / shard.vocab_size) * sums[1]
            if zl:
                loss = loss + zl * lse * lse
            loss_tok[sl] = tg.token_loss(loss, sl)
            lse_all[sl] = lse
            if eager and v > 0:
                g = _logit_grad_(z, lse, row_scale_all[sl], tg.idx[sl], tg.in_shard[sl], opts, shard.vocab_size)
                if dx is not None:
                    dx[sl] = mm_out(g.to(w.dtype), w, acc)
                if dw is not None:
                    dw.addmm_(g.t(), hidden[sl].to(acc))
                if db is not None:
                    db += g.sum(0)

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
        rows = rows_or_weight if isinstance(rows_or_weight, int) else rows_or_weight.shape[0]
        if ctx.eager:
            if ctx.grads is None:
                raise RuntimeError("vpce: this loss formed its gradients in forward and they were already "
                                   "used; for a second backward pass use memory_budget='lean'")
            grads, ctx.grads = ctx.grads, None
            g = grad_out.detach() / ctx.denominator if ctx.opts.reduction == "mean" else grad_out.detach()
            dx, dw, db = (None if t is None else t.mul_(g) for t in grads)
            return (None if dx is None else dx.to(dtype), weight_grad(dw, rows_or_weight, dtype),
                    pad_rows(db, rows, dtype), None, None, None, None, None, None)

        hidden, weight, bias, target, token_weight, lse_all = ctx.saved_tensors
        shard, opts, chunk = ctx.shard, ctx.opts, ctx.chunk
        n, d = hidden.shape
        acc = lse_all.dtype
        v = shard.valid_rows
        w = weight[:v]
        b = None if bias is None else bias[:v]
        tg = TokenTargets(target, shard, opts.ignore_index, token_weight)
        g = grad_out.detach().to(acc)
        if opts.reduction == "mean":
            g = g / tg.denominator(acc)
        row_scale_all = tg.row_scale(g.expand(n) if g.dim() == 0 else g.reshape(n))

        need_dx, need_dw, need_db = ctx.needs_input_grad[:3]
        dx = torch.zeros(n, d, dtype=acc, device=hidden.device) if need_dx else None
        dw = torch.zeros(v, d, dtype=acc, device=hidden.device) if need_dw else None
        db = torch.zeros(v, dtype=acc, device=hidden.device) if need_db and bias is not None else None
        if v > 0:
            for c0 in range(0, n, chunk):
                sl = slice(c0, min(n, c0 + chunk))
                z = _logits(hidden[sl], w, b, opts.softcap, acc)
                gz = _logit_grad_(z, lse_all[sl], row_scale_all[sl], tg.idx[sl], tg.in_shard[sl], opts,
                                  shard.vocab_size)
                if dx is not None:
                    dx[sl] = mm_out(gz.to(w.dtype), w, acc)
                if dw is not None:
                    dw.addmm_(gz.t(), hidden[sl].to(acc))
                if db is not None:
                    db += gz.sum(0)
        return (None if dx is None else dx.to(dtype), weight_grad(dw, rows_or_weight, dtype),
                pad_rows(db, rows, dtype), None, None, None, None, None, None)
