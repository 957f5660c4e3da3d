"""Pure-PyTorch backend: exact, memory-bounded linear + cross-entropy over a (possibly sharded) vocab; the CPU
path. (The float64 reference the tests and the bench check against is ``vpce.reference``.)

It never allocates ``[N, V_local]``: it walks the tokens in chunks of ``C`` rows, ``C`` sized (by ``vpce.routing``,
in the call's plan) so that the live chunk data (the logits in the input dtype, their fp32 copy, the probabilities
and their cast) stay inside the memory budget (default 0.25 GiB). Softmax statistics are fp32 (float64 for float64
inputs).

Per chunk: logits -> local statistics (max, sum of exp but the target's, target logit, ...) -> the global
``RankStats`` (one packed collective under a group, ``vpce.parallel``) -> per-token outputs and, on the fast route,
the chunk's gradient while its logits are live: ``dX`` rows written once, ``dW`` accumulated across chunks in fp32
(``vpce.routing`` picks the route). One chunk loop (``_chunk_loop``) serves every loss and route: each loss
(cross-entropy, log-probs, the distillation of ``vpce.formulas.distill``) passes a per-chunk step that returns the
chunk's logit gradient; the recompute (``_recompute_loop``) walks the same chunks. The formulas are
``vpce.formulas.softmax``, shared with the Triton backend. Under a group every rank runs the same number of chunks (the
chunk size depends only on values that are equal on every rank), so the per-chunk collectives line up. ``dX`` is
this shard's contribution; the caller (``vpce.parallel.enter_vocab_parallel``) sums it over the group.
"""

from __future__ import annotations

import math

import torch

from ..formulas.distill import DistillRows, DistillStats, exchange_chunk_stats, heads, local_stats, log_mixture, \
    log_softmax, mixture_sums, row_weights, token_loss
from ..formulas.softmax import Coefficients, RowStats, ce_coefficients, ce_token_outputs
from ..options import DistillOptions, Folded, LogProbOptions, LossOptions
from ..parallel import exchange_softmax_stats
from ..rank_stats import RankStats
from ..routing import Call
from ..targets import TokenTargets
from .gemm import mm_out
from .grads import FastGrads, pad_rows, weight_grad

__all__ = ["cross_entropy", "log_probs", "recompute_grads", "scale_cast", "distill_forward",
           "distill_recompute_grads"]


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, folded: Folded,
                 acc: torch.dtype) -> torch.Tensor:
    """The logits ``folded`` defines, in ``acc``."""
    z = mm_out(h, w.t(), acc)
    if b is not None:
        z += b.to(acc)
    if folded.softcap is not None:
        z.div_(folded.softcap).tanh_().mul_(folded.softcap)
    if folded.inv_t != 1.0:
        z.mul_(folded.inv_t)
    return z


def _chunk_stats(hidden, w, b, tg: TokenTargets, sl: slice, call: Call, folded: Folded, acc, *, sum_z=False,
                 sum_ez=False, class_weight=None, sum_sq=False, top1=False
                 ) -> tuple[torch.Tensor | None, RankStats]:
    """Logits of the rows ``sl`` (None on an all-padding shard) and their global statistics (``sum_z`` with
    ``class_weight``: the weighted sum ``sum_j w_j z_j``); ``sum_sq``: also ``log sum p^2``, ``top1``: also
    whether the target is the argmax."""
    c = sl.stop - sl.start
    full = lambda value: torch.full((c,), value, dtype=acc, device=hidden.device)  # noqa: E731
    if call.shard.valid_rows > 0:
        z = chunk_logits(hidden[sl], w, b, folded, acc)
        idx, mine = tg.idx[sl, None], tg.in_shard[sl]
        zt = torch.where(mine, z.gather(1, idx).squeeze(1), -math.inf)
        # max and sum of exp over every column but the target's (its term is kept apart, in zt)
        e = z.scatter(1, idx, torch.where(mine[:, None], -math.inf, z.gather(1, idx)))
        m = e.amax(1)
        e = e.sub_(torch.where(m == -math.inf, 0.0, m)[:, None]).exp_()  # a row of -inf gives 0, not NaN
        weighted = [torch.where(e == 0, 0, e * z).sum(1)] if sum_ez else []
        if sum_sq:  # sum of exp(2 (z - m)) but the target's
            weighted.append((e * e).sum(1))
        packed = [m, e.sum(1), zt]
        del e
        if sum_z:
            packed.append(z.sum(1) if class_weight is None else torch.mv(z, class_weight))
        if top1:  # max of the logits whose global id is below the target's; the target's logit
            cols = torch.arange(z.shape[1], device=z.device)
            weighted += [torch.where(cols < tg.before[sl, None], z, -math.inf).amax(1), zt]
    else:  # this rank's rows are all padding: no max, nothing to add
        z = None
        packed = [full(-math.inf), full(0.0), full(-math.inf)] + [full(0.0)] * (sum_z + sum_ez + sum_sq)
        weighted = [full(-math.inf)] * 2 if top1 else []
    st = exchange_softmax_stats(torch.stack(packed + weighted), 1 if sum_z else 0, call.shard, call.poison,
                                sum_sq=sum_sq, max_before=top1)
    return z, st


def _logit_grad_(z: torch.Tensor, rows: RowStats, co: Coefficients, t_idx: torch.Tensor, in_shard: torch.Tensor,
                 folded: Folded, class_weight=None) -> torch.Tensor:
    """Turn the chunk's logits ``z`` [c, v] into the gradient of ``vpce.formulas.softmax``, in place
    (``class_weight``: the columns' weights ``[v]``, which the ``d`` term is multiplied by)."""
    cap = None if folded.softcap is None else 1 - (z / (folded.softcap * folded.inv_t)) ** 2
    zc = z.sub_(rows.m[:, None])  # z - M: exact where z is the max
    idx = t_idx[:, None]
    zc_t = zc.gather(1, idx).squeeze(1)
    # (z - M) b + a, with z = -inf (where p = 0) taken as 0: no 0 * inf
    bz = None if co.b is None else torch.where(torch.isneginf(zc), 0.0, zc) * co.b[:, None] + co.a[:, None]
    g = zc.sub_(rows.log_s[:, None]).exp_()  # p
    g.mul_(co.a[:, None] if bz is None else bz)
    if co.d is not None:
        if class_weight is None:
            g.add_(co.d[:, None])
        else:
            g.addr_(co.d, class_weight)
    # the target's entry through q = 1 - p_t: (a + c) - a q (+ b (z_t - M) p_t) + d
    hit = co.a + co.c - co.a * rows.q
    if co.b is not None:
        hit = hit + co.b * zc_t * (1 - rows.q)
    if co.d is not None:
        hit = hit + (co.d if class_weight is None else co.d * class_weight[t_idx])
    g.scatter_(1, idx, torch.where(in_shard, hit, g.gather(1, idx).squeeze(1))[:, None])
    if cap is not None:
        g.mul_(cap)
    return g


def accumulate_grads(g: torch.Tensor, h: torch.Tensor, w: torch.Tensor, sl: slice, dx, dw, db):
    """Add one chunk's logit gradient ``g`` [c, v] into dX (rows ``sl``), the dW and db accumulators."""
    if dx is not None:
        dx[sl] = mm_out(g.to(w.dtype), w, g.dtype)
    if dw is not None:
        dw.addmm_(g.t(), h.to(g.dtype))
    if db is not None:
        db += g.sum(0)


# -- the engine: one chunk loop for the gradients formed in forward, one for the recompute ---------------------
#
# Each loss supplies a per-chunk step that returns the chunk's logit gradient; the loops own the chunking and the
# accumulation into dX, dW and db (``accumulate_grads``).


def _unit_grads(hidden: torch.Tensor, v: int, needs: tuple[bool, bool, bool], acc: torch.dtype) -> FastGrads:
    """The fast route's accumulators, zeroed: dX ``[N, D]``, dW ``[V_valid, D]``, db ``[V_valid]``."""
    n, d = hidden.shape
    return FastGrads(torch.zeros(n, d, dtype=acc, device=hidden.device) if needs[0] else None,
                     torch.zeros(v, d, dtype=acc, device=hidden.device) if needs[1] else None,
                     torch.zeros(v, dtype=acc, device=hidden.device) if needs[2] else None)


def _chunk_loop(hidden, w, chunk: int, step, grads: FastGrads | None):
    """Per chunk ``sl`` of ``chunk`` tokens the per-loss ``step(sl)`` takes the chunk's statistics and outputs and
    returns its logit gradient ``[c, V_valid]`` (None where nothing is formed), added into ``grads``: dX rows
    ``sl`` written once, dW and db accumulated. One chunk's logits are live at a time."""
    n = hidden.shape[0]
    for c0 in range(0, n, chunk):
        sl = slice(c0, min(n, c0 + chunk))
        g = step(sl)
        if g is not None:
            accumulate_grads(g, hidden[sl], w, sl, grads.dx, grads.dw, grads.db)
        del g  # before the next chunk's logits exist


def _recompute_loop(hidden, weight, bias, call: Call, chunk: int, acc: torch.dtype, step, main_weight=None):
    """dX, dW, db in the inputs' dtype from the logit gradient ``step(sl)`` recomputes per chunk of tokens
    (``main_weight``: dW added into its ``main_grad``)."""
    n, d = hidden.shape
    dtype, v = hidden.dtype, call.shard.valid_rows
    need_dx, need_dw, need_db = call.needs_grad
    dx = torch.zeros(n, d, dtype=acc, device=hidden.device) if need_dx else None
    dw = torch.zeros(v, d, dtype=acc, device=hidden.device) if need_dw else None
    db = torch.zeros(v, dtype=acc, device=hidden.device) if need_db and bias is not None else None
    if v > 0:
        _chunk_loop(hidden, weight[:v], chunk, step, FastGrads(dx, dw, db))
    return (None if dx is None else dx.to(dtype),
            weight_grad(dw, weight.shape[0] if main_weight is None else main_weight, dtype),
            pad_rows(db, weight.shape[0], dtype))


def recompute_grads(hidden, weight, bias, tg: TokenTargets, rows: RowStats, coef: Coefficients, call: Call,
                    main_weight=None):
    """dX, dW, db from logits recomputed chunk by chunk (any per-token coefficients; the logits: ``Plan.folded``)."""
    shard, folded = call.shard, call.plan.folded
    acc, v = rows.m.dtype, shard.valid_rows
    w = weight[:v]
    b = None if bias is None else bias[:v]
    chunk = call.plan.sizes.block_tokens
    cw = None if tg.class_weight is None else tg.class_weight.columns

    def step(sl):
        z = chunk_logits(hidden[sl], w, b, folded, acc)
        return _logit_grad_(z, rows.rows(sl), coef.rows(sl), tg.idx[sl], tg.in_shard[sl], folded, cw)
    return _recompute_loop(hidden, weight, bias, call, chunk, acc, step, main_weight)


def cross_entropy(hidden, weight, bias, tg: TokenTargets, opts: LossOptions, call: Call):
    """Per-token loss ``[N]`` (weighted, 0 on ignored tokens), and what backward needs: the fast route's
    unscaled ``FastGrads``, or the lean route's ``RowStats``."""
    n = hidden.shape[0]
    shard = call.shard
    acc = _acc(hidden.dtype)
    v = shard.valid_rows
    w = weight[:v]
    b = None if bias is None else bias[:v]
    smooth = opts.label_smoothing > 0
    folded = call.plan.folded
    chunk = call.plan.sizes.chunk
    fast = call.plan.route == "fast"
    grads = None
    if fast:
        # Rows at unit scale; 1/count (mean) and the upstream gradient are applied in backward, so the cast of the
        # chunk gradient to fp16 keeps full precision (and loss scaling keeps working).
        unit = tg.row_scale(hidden.new_ones((), dtype=acc).expand(n))
        grads = _unit_grads(hidden, v, call.needs_grad, acc)
    loss_tok = torch.empty(n, dtype=acc, device=hidden.device)
    keep = call.plan.route == "lean"
    rows = RowStats.empty(n, acc, hidden.device) if keep else None
    cw = None if tg.class_weight is None else tg.class_weight.columns
    metrics = {k: torch.empty(n, dtype=acc, device=hidden.device) for k in opts.metrics}
    if opts.token_scaling:
        tg.scaling = torch.empty(n, dtype=acc, device=hidden.device)

    def step(sl):
        z, st = _chunk_stats(hidden, w, b, tg, sl, call, folded, acc, sum_z=smooth, class_weight=cw,
                             sum_ez="entropy" in opts.metrics, top1="token_accuracy" in opts.metrics)
        ce_token_outputs(st, opts, shard.vocab_size, tg, sl, loss_tok, metrics)
        if keep:
            rows.store(sl, st)
        if not (fast and v > 0):
            return None
        scale = unit[sl] if tg.scaling is None else unit[sl] * tg.scaling[sl]
        co = ce_coefficients(scale, st.lse, opts, shard.vocab_size, tg.class_rows(sl))
        return _logit_grad_(z, RowStats.of(st), co, tg.idx[sl], tg.in_shard[sl], folded, cw)

    _chunk_loop(hidden, w, chunk, step, grads)
    tg.metrics = metrics
    return loss_tok, rows, grads


def log_probs(hidden, weight, bias, tg: TokenTargets, lp: LogProbOptions, call: Call):
    """Per-token global statistics for ``linear_log_probs``: ``(RankStats of all tokens, RowStats)``."""
    acc = _acc(hidden.dtype)
    v = call.shard.valid_rows
    w = weight[:v]
    b = None if bias is None else bias[:v]
    chunk = call.plan.sizes.chunk
    parts = []

    def step(sl):
        _, st = _chunk_stats(hidden, w, b, tg, sl, call, call.plan.folded, acc, sum_z=lp.mean_logits,
                             sum_ez=lp.entropy, sum_sq=lp.log_sum_sq, top1=lp.top1)
        parts.append(st)
    _chunk_loop(hidden, w, chunk, step, None)
    return RankStats.cat(parts, int(lp.mean_logits), int(lp.entropy), hidden.new_empty(0, dtype=acc),
                         lp.log_sum_sq, lp.top1)


def scale_cast(src: torch.Tensor, g: torch.Tensor, dtype: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """``(src * g).to(dtype)``, in place on ``src``; into ``out`` (a 16-bit ``src`` itself) with the product in
    fp32."""
    if out is None:
        return src.mul_(g).to(dtype)
    return out.copy_(src.float().mul_(g))


# ------------------------------------------------------------------------------------------------------------
# the distillation (``vpce.formulas.distill``): statistics, the gradient of a chunk, forward and the recompute


def _distill_chunk_stats(z1, y, tg: TokenTargets, sl: slice, o: DistillOptions, call: Call, acc,
                         device) -> DistillStats:
    """The torch backend's chunk statistics (``z1 = None``: this shard's rows are all padding)."""
    c = sl.stop - sl.start
    packed = local_stats(z1, y, tg, sl, o, c, acc, device)

    def jsd_sums(st):
        return torch.zeros(2, c, dtype=acc, device=device) if z1 is None else mixture_sums(z1, y, st, o)
    return exchange_chunk_stats(packed, jsd_sums, o, call)


def _distill_logit_grad(z1, y, rows: DistillRows, kd: torch.Tensor, ce: torch.Tensor | None, t_idx, in_shard,
                o: DistillOptions) -> torch.Tensor:
    """The gradient ``[c, v]`` with respect to the student's pre-cap logits; per-row weights ``kd`` (the
    divergence's, with ``1 / T`` folded in) and ``ce`` (the cross-entropy's)."""
    z = z1 * o.student.inv_t if o.student.inv_t != 1.0 else z1
    s = log_softmax(z, rows.m_z, rows.log_s_z)
    p = s.exp()
    if o.kind == "forward_kl":
        g = p - log_softmax(y, rows.m_y, rows.log_s_y).exp_()
    elif o.kind == "reverse_kl":
        g = torch.where(p == 0, 0.0, p * ((z - y) - rows.e[:, None]))
    else:
        log_m = log_mixture(s, log_softmax(y, rows.m_y, rows.log_s_y), o.beta)
        g = torch.where(p == 0, 0.0, (1 - o.beta) * p * ((s - log_m) - rows.e[:, None]))
    del s, p
    g.mul_(kd[:, None])
    if ce is not None:
        p1 = log_softmax(z1, rows.m1, rows.log_s1).exp_()
        idx = t_idx[:, None]
        p1.scatter_(1, idx, torch.where(in_shard, -rows.q1, p1.gather(1, idx).squeeze(1))[:, None])  # p1_t - 1
        g.add_(p1.mul_(ce[:, None]))
    if o.student.softcap is not None:
        g.mul_(1 - (z1 / o.student.softcap) ** 2)
    return g


def distill_forward(hidden, weight, bias, t_hidden, t_weight, t_bias, tg: TokenTargets, o: DistillOptions,
                    call: Call):
    """Per-token loss ``[N]`` (weighted, 0 on ignored tokens), and what backward needs: the fast route's unscaled
    ``FastGrads``, or the lean route's ``DistillRows``."""
    n = hidden.shape[0]
    acc = _acc(hidden.dtype)
    v = call.shard.valid_rows
    w, b, tw, tb = heads(weight, bias, t_weight, t_bias, v)
    chunk = call.plan.sizes.chunk
    fast = call.plan.route == "fast"
    keep = call.plan.route == "lean"
    grads = None
    if fast:  # unit upstream scale; 1/count (mean) and the upstream gradient are applied in backward
        unit = tg.row_scale(hidden.new_ones((), dtype=acc).expand(n))
        grads = _unit_grads(hidden, v, call.needs_grad, acc)
    loss_tok = torch.empty(n, dtype=acc, device=hidden.device)
    rows = DistillRows.empty(n, o, acc, hidden.device) if keep else None

    def step(sl):
        z1 = y = None
        if v > 0:
            z1 = chunk_logits(hidden[sl], w, b, o.student.untempered(), acc)
            y = chunk_logits(t_hidden[sl], tw, tb, o.teacher, acc)
        st = _distill_chunk_stats(z1, y, tg, sl, o, call, acc, hidden.device)
        loss_tok[sl] = tg.token_loss(token_loss(st, o), sl)
        if keep:
            rows.store(sl, DistillRows.of(st, o))
        if not (fast and v > 0):
            return None
        kd, ce = row_weights(unit[sl], o)
        return _distill_logit_grad(z1, y, DistillRows.of(st, o), kd, ce, tg.idx[sl], tg.in_shard[sl], o)

    _chunk_loop(hidden, w, chunk, step, grads)
    return loss_tok, rows, grads


def distill_recompute_grads(hidden, weight, bias, t_hidden, t_weight, t_bias, tg: TokenTargets, rows: DistillRows,
                            scale: torch.Tensor, o: DistillOptions, call: Call):
    """dX, dW, db from both heads' logits recomputed chunk by chunk, for per-token row scales ``scale``."""
    acc, v = rows.m_z.dtype, call.shard.valid_rows
    w, b, tw, tb = heads(weight, bias, t_weight, t_bias, v)
    chunk = call.plan.sizes.block_tokens
    kd, ce = row_weights(scale, o)

    def step(sl):
        z1 = chunk_logits(hidden[sl], w, b, o.student.untempered(), acc)
        y = chunk_logits(t_hidden[sl], tw, tb, o.teacher, acc)
        return _distill_logit_grad(z1, y, rows.rows(sl), kd[sl], None if ce is None else ce[sl], tg.idx[sl],
                                   tg.in_shard[sl], o)
    return _recompute_loop(hidden, weight, bias, call, chunk, acc, step)
