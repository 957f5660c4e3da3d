"""Knowledge distillation without logits: ``linear_distillation_loss``, the divergence between a student head
``hidden @ weight.T (+ bias)`` and a teacher head ``teacher_hidden @ teacher_weight.T (+ teacher_bias)`` over a
vocab that may be sharded over a tensor-parallel group, with exact loss and exact student gradients.

What is computed, per token (global vocab ids ``j`` in ``[0, V)``, padding rows excluded; ``T`` the temperature,
``cap`` each head's optional soft cap, ``t`` the hard label)::

    z1_j = cap_s(h . W_j + b_j)      z_j = z1_j / T      p = softmax(z)     (student; p1 = softmax(z1))
    y_j  = cap_t(h' . W'_j + b'_j) / T                   q = softmax(y)     (teacher)
    forward_kl:  D = KL(q || p) = sum_j q_j (log q_j - log p_j)
    reverse_kl:  D = KL(p || q) = sum_j p_j (log p_j - log q_j)
    jsd (beta):  D = beta KL(q || m) + (1 - beta) KL(p || m),   m = beta q + (1 - beta) p
                 (beta = 0 is forward_kl and beta = 1 reverse_kl, as TRL's ``generalized_jsd_loss`` defines them)
    loss = (1 - a) tau D + a (lse(z1) - z1_t)       a = ce_weight, tau = T**2 if temperature_squared else 1

The hard-label cross-entropy uses the untempered student logits ``z1`` (Hinton et al.; Liger's and torchtune's
distillation losses do the same). The teacher gets no gradient: its tensors are used detached.

Statistics. Every term is a function of per-token statistics that combine across vocab shards exactly like the
softmax statistics of the cross-entropy (``vpce.parallel.combine_rank_stats``): each rank sends local maxima and
sums of ``exp`` relative to them, and every rank rescales them to the global max. With ``lse`` the log-sum-exp::

    forward_kl = E_q[y - z] - (lse(y) - lse(z))          E_q[y - z] = sum_j e^{y_j - M_y} (y_j - z_j) / S_y
    reverse_kl = E_p[z - y] - (lse(z) - lse(y))          E_p[z - y] = sum_j e^{z_j - M_z} (z_j - y_j) / S_z

so the two KLs need one packed all-gather per token chunk (max and sum of exp of each head, one weighted sum, and
the cross-entropy's max / sum / target logit when ``ce_weight > 0``). The mixture's ``log m_j`` of the JSD needs
both global ``lse``'s before any of its sums can be formed, and it is not a function of any per-rank scalar: the
JSD takes two passes over each chunk's live logits, both exact:

1. the all-gather of the max and sum of exp of both heads (and the cross-entropy's statistics): ``lse(z)``,
   ``lse(y)``;
2. per column ``s_j = z_j - lse(z)``, ``u_j = y_j - lse(y)``, ``log m_j = logaddexp(log(1 - beta) + s_j, log beta
   + u_j)``; the local sums ``K_q = sum_j q_j (u_j - log m_j)`` and ``K_p = sum_j p_j (s_j - log m_j)``, one more
   all-gather of those two rows, summed in rank order: ``D = beta K_q + (1 - beta) K_p``.

Every rank runs the same number of chunks (the chunk depends only on values that are equal on every rank) and
the same collectives per chunk (one for the KLs, two for the JSD), so they line up; every rank combines the same
bytes in the same order, so every rank returns the same loss.

Gradients with respect to the student's tempered logits ``z`` (``dz_j / dx_j = kappa_j / T`` through the cap and
the temperature, ``x_j`` the pre-cap logit)::

    forward_kl:  p_j - q_j
    reverse_kl:  p_j ((z_j - y_j) - E_p[z - y])
    jsd:         (1 - beta) p_j ((s_j - log m_j) - K_p)         (d/dp_j of D is (1 - beta)(log p_j - log m_j))
    cross-entropy (on z1): p1_j - [j = t], the target's entry as -(1 - p1_t) without cancellation

so ``dL/dx_j = r ((1 - a) tau / T g_j + a (p1_j - [j = t])) kappa_j`` with ``r`` the token's upstream gradient
times its weight. Like the cross-entropy's torch backend, the gradient is formed while a chunk's logits are live
(``mean``/``sum``: dX rows written once, dW accumulated in fp32, scaled by the upstream gradient in backward), or
for ``reduction="none"`` and ``memory_budget="lean"`` recomputed in backward from the per-token statistics kept
in forward (each head's max and ``log S``, ``E_p[z - y]`` or ``K_p``, the cross-entropy's and ``1 - p1_t``); the
backward needs no statistics exchange. ``dX`` is this shard's part, summed over the group by
``vpce.parallel.enter_vocab_parallel``.

This module is the torch backend (CPU, or ``backend="torch"``): the live data is a few fp32 ``[C, V_local]``
chunk tensors, never ``[N, V]``. The Triton backend (``vpce.distill_triton``; ``backend="triton"``) computes
the same statistics with bandwidth-bound kernels over cuBLAS-written logits and exchanges them through the same
``exchange_chunk_stats``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import NamedTuple

import torch

from . import parallel
from .api import autocast_operands, check_bool, check_int, check_memory_budget, check_number, check_token_weight, \
    dtype_name, prepare_call
from .autograd import accumulation_dtype
from .grads import FastGrads, finish_fast_grads, pad_rows, weight_grad
from .options import DEFAULT_CHUNK_GIB, REDUCTIONS
from .routing import Call, plan_distillation
from .targets import TokenTargets
from .torch_backend import accumulate_grads, chunk_logits, scale_cast

__all__ = ["linear_distillation_loss", "DistillOptions", "DIVERGENCES"]

DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True, kw_only=True)
class DistillOptions:
    """What ``linear_distillation_loss`` computes per token, validated at the public boundary."""

    kind: str = "forward_kl"
    """The divergence computed: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"`` (a JSD with beta 0 or 1 is the
    matching KL)."""
    beta: float = 0.5
    """The teacher's weight in the JSD's mixture ``m = beta q + (1 - beta) p`` (``kind="jsd"`` only)."""
    inv_t: float = 1.0
    """One over the temperature of both heads."""
    kd_scale: float = 1.0
    """The divergence's weight in the loss: ``(1 - ce_weight) * (T**2 if temperature_squared else 1)``."""
    ce_weight: float = 0.0
    """The hard-label cross-entropy's weight (on the untempered student logits)."""
    ignore_index: int = -100
    """Tokens whose target equals it count for nothing (-1 when no target was given: none is ignored)."""
    reduction: str = "mean"
    softcap: float | None = None
    """The student's soft cap, before the temperature."""
    teacher_softcap: float | None = None
    """The teacher's soft cap, before the temperature."""
    memory_budget: str | float = "auto"
    """``"auto"``/``"fast"``, ``"lean"``, or GiB of live chunk data."""

    @property
    def extra(self) -> bool:
        """Whether the divergence's gradient needs a per-token statistic besides the two ``lse``'s."""
        return self.kind != "forward_kl"

    def chunk_gib(self) -> float:
        return self.memory_budget if isinstance(self.memory_budget, float) else DEFAULT_CHUNK_GIB


def chunk_tokens(budget_gib: float, shard: parallel.VocabShard, dtype: torch.dtype) -> int:
    """Tokens per chunk: about eight fp32 (fp64) ``[C, V_local]`` tensors live (both heads' logits, their exps and
    the gradient's temporaries); equal on every rank of the group."""
    acc = 8 if dtype == torch.float64 else 4
    per_logit = 2 * torch.finfo(dtype).bits // 8 + 8 * acc
    return max(1, int(budget_gib * 2**30) // (shard.columns_per_rank * per_logit))


# ------------------------------------------------------------------------------------------------------------
# per-chunk statistics


class DistillStats(NamedTuple):
    """Global per-token statistics of one chunk (fp32, fp64 for fp64 inputs); None where not needed."""

    m_z: torch.Tensor
    """The student's (tempered) max logit, plus the agreement's poison."""
    log_s_z: torch.Tensor
    """``log sum_j exp(z_j - m_z)``."""
    m_y: torch.Tensor
    log_s_y: torch.Tensor
    e: torch.Tensor | None
    """forward_kl: ``E_q[y - z]``; reverse_kl: ``E_p[z - y]``; jsd: ``K_p = KL(p || m)``."""
    k_q: torch.Tensor | None
    """jsd: ``KL(q || m)``."""
    ce: parallel.RankStats | None
    """The untempered student's softmax statistics (target kept apart), when ``ce_weight > 0``."""


class DistillRows(NamedTuple):
    """What a gradient pass needs per token (kept from forward on the lean route): each head's max and
    ``log S`` apart, so that ``log p_j = (z_j - M) - log S`` is exact where ``z_j`` is near the max."""

    m_z: torch.Tensor
    log_s_z: torch.Tensor
    m_y: torch.Tensor
    log_s_y: torch.Tensor
    e: torch.Tensor | None
    """reverse_kl: ``E_p[z - y]``; jsd: ``K_p``; None for forward_kl."""
    m1: torch.Tensor | None
    """The untempered student's max and ``log S`` (cross-entropy only)."""
    log_s1: torch.Tensor | None
    q1: torch.Tensor | None
    """``1 - p1_t`` (cross-entropy only)."""

    @staticmethod
    def of(st: DistillStats, o: DistillOptions) -> "DistillRows":
        ce = st.ce
        return DistillRows(st.m_z, st.log_s_z, st.m_y, st.log_s_y, st.e if o.extra else None,
                           *((None, None, None) if ce is None else (ce.m, ce.log_s, ce.q)))

    @staticmethod
    def empty(n: int, o: DistillOptions, dtype: torch.dtype, device) -> "DistillRows":
        new = lambda on: torch.empty(n, dtype=dtype, device=device) if on else None  # noqa: E731
        ce = o.ce_weight > 0
        return DistillRows(new(True), new(True), new(True), new(True), new(o.extra), new(ce), new(ce), new(ce))

    def store(self, sl: slice, rows: "DistillRows"):
        for dst, src in zip(self, rows):
            if dst is not None:
                dst[sl] = src

    def rows(self, sl: slice) -> "DistillRows":
        return DistillRows(*(None if x is None else x[sl] for x in self))


def _log_probs(z: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor) -> torch.Tensor:
    """``log softmax`` from the global statistics: ``(z - M) - log S``."""
    return (z - m[:, None]).sub_(log_s[:, None])


def _max_exp(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row max and ``exp(z - max)`` (a row of ``-inf`` gives 0, not NaN)."""
    m = z.amax(1)
    return m, (z - torch.where(m == -math.inf, 0.0, m)[:, None]).exp_()


def _weighted(e: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """``sum_j e_j d_j`` with ``e_j = 0`` contributing 0 even where ``d_j`` is infinite."""
    return torch.where(e == 0, 0.0, e * d).sum(1)


def rows_layout(o: DistillOptions) -> tuple[int, int]:
    """Packed rows: student max, sum; teacher max, sum; [the KL's weighted sum]; [CE max, sum, target logit]."""
    kl = 1 if o.kind in ("forward_kl", "reverse_kl") else 0
    return 4 + kl, 4 + kl + (3 if o.ce_weight > 0 else 0)


def local_stats(z1, y, tg: TokenTargets, sl: slice, o: DistillOptions, c: int, acc, device) -> torch.Tensor:
    """This rank's packed ``[R, c]`` statistics of the chunk (``z1 = None``: its rows are all padding)."""
    ce_at, _ = rows_layout(o)
    if z1 is None:
        full = lambda value: torch.full((c,), value, dtype=acc, device=device)  # noqa: E731
        rows = [full(-math.inf), full(0.0), full(-math.inf), full(0.0)] + [full(0.0)] * (ce_at - 4)
        if o.ce_weight > 0:
            rows += [full(-math.inf), full(0.0), full(-math.inf)]
        return torch.stack(rows)
    z = z1 * o.inv_t if o.inv_t != 1.0 else z1
    m_z, e_z = _max_exp(z)
    m_y, e_y = _max_exp(y)
    rows = [m_z, e_z.sum(1), m_y, e_y.sum(1)]
    if o.kind == "forward_kl":
        rows.append(_weighted(e_y, y - z))
    elif o.kind == "reverse_kl":
        rows.append(_weighted(e_z, z - y))
    del e_z, e_y
    if o.ce_weight > 0:  # the untempered student, the target's column kept apart (exact for confident tokens)
        idx, mine = tg.idx[sl, None], tg.in_shard[sl]
        zt = torch.where(mine, z1.gather(1, idx).squeeze(1), -math.inf)
        rest = z1.scatter(1, idx, torch.where(mine[:, None], -math.inf, z1.gather(1, idx)))
        m1, e1 = _max_exp(rest)
        rows += [m1, e1.sum(1), zt]
    return torch.stack(rows)


def _combine_head(m_all: torch.Tensor, x_all: torch.Tensor, w_all: torch.Tensor | None, poison):
    """One head's ``(M, log S, E)`` from every rank's ``(m_r, x_r[, w_r])`` ``[W, C]``, in rank order, as
    ``vpce.parallel.combine_rank_stats`` does: ``M = max_r m_r``, ``S = sum_r x_r exp(m_r - M)``,
    ``E = sum_r w_r exp(m_r - M) / S``."""
    m = m_all.amax(0)
    if poison is not None:
        m = m + poison
    rescale = torch.exp(m_all - torch.where(m == -math.inf, 0.0, m))  # a rank with m_r = -inf contributes 0
    s = (x_all * rescale).sum(0)
    return m, torch.log(s), None if w_all is None else (w_all * rescale).sum(0) / s


KL_HEAD = {"jsd": 0, "forward_kl": 1, "reverse_kl": 2}  # whose softmax weights the KL's sum: none, teacher, student


def _combine_heads(every: torch.Tensor, *, kl: int, poison=None):
    """Both heads' ``(m_z, log_s_z, m_y, log_s_y, e)`` from every rank's packed rows (``e``: the KL's expectation,
    under the teacher's softmax for ``kl`` 1, the student's for 2; None for 0)."""
    m_z, log_s_z, e_z = _combine_head(every[:, 0], every[:, 1], every[:, 4] if kl == 2 else None, poison)
    m_y, log_s_y, e_y = _combine_head(every[:, 2], every[:, 3], every[:, 4] if kl == 1 else None, poison)
    return m_z, log_s_z, m_y, log_s_y, e_y if kl == 1 else e_z


def _combiner(o: DistillOptions, combine_heads, combine_ce):
    ce_at, _ = rows_layout(o)

    def combine(every: torch.Tensor, _n_sums: int, poison) -> DistillStats:
        """Every rank's packed statistics ``[W, R, C]`` -> ``DistillStats`` (the JSD's sums still to come)."""
        heads = combine_heads(every, kl=KL_HEAD[o.kind], poison=poison)
        ce = combine_ce(every[:, ce_at:ce_at + 3], 0, poison) if o.ce_weight > 0 else None
        return DistillStats(*heads, None, ce)
    return combine


def _sum_over_ranks(every: torch.Tensor, _n_sums: int, _poison) -> torch.Tensor:
    return every.sum(0)  # in rank order: the same bytes on every rank


def _log_mixture(s: torch.Tensor, u: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta q + (1 - beta) p)`` from the log-probabilities ``s = log p``, ``u = log q``."""
    return torch.logaddexp(s + math.log1p(-beta), u + math.log(beta))


def _mixture_sums(z1, y, st: DistillStats, o: DistillOptions) -> torch.Tensor:
    """The JSD's second pass on this shard: ``[K_q, K_p]`` partial sums ``[2, c]``."""
    z = z1 * o.inv_t if o.inv_t != 1.0 else z1
    s = _log_probs(z, st.m_z, st.log_s_z)
    u = _log_probs(y, st.m_y, st.log_s_y)
    log_m = _log_mixture(s, u, o.beta)
    p, q = s.exp(), u.exp()
    return torch.stack([_weighted(q, u - log_m), _weighted(p, s - log_m)])


def exchange_chunk_stats(packed: torch.Tensor, mixture_sums, o: DistillOptions, call: Call,
                         combine_heads=_combine_heads, combine_ce=parallel.combine_rank_stats) -> DistillStats:
    """The chunk's global statistics from this shard's ``packed [R, c]`` (``rows_layout``): one all-gather
    (KLs) or two (JSD: ``mixture_sums(stats)`` gives this shard's ``[K_q, K_p]`` partial sums ``[2, c]`` from the
    first exchange's statistics) under a group, on every rank. Both backends go through here, so their
    collectives are the same ones in the same order. The Triton backend combines with one-launch kernels
    (``vpce.kernels.combine_distill_heads``, ``combine_rank_stats``) instead of these torch ops."""
    st = parallel.start_stats_exchange(packed, 0, call.shard, call.poison,
                                       combine=_combiner(o, combine_heads, combine_ce)).wait()
    if o.kind != "jsd":
        return st
    k_q, k_p = parallel.start_stats_exchange(mixture_sums(st), 0, call.shard, combine=_sum_over_ranks).wait()
    return st._replace(e=k_p, k_q=k_q)


def _chunk_stats(z1, y, tg: TokenTargets, sl: slice, o: DistillOptions, call: Call, acc, device) -> DistillStats:
    """The torch backend's chunk statistics (``z1 = None``: this shard's rows are all padding)."""
    c = sl.stop - sl.start
    packed = local_stats(z1, y, tg, sl, o, c, acc, device)

    def mixture_sums(st):
        return torch.zeros(2, c, dtype=acc, device=device) if z1 is None else _mixture_sums(z1, y, st, o)
    return exchange_chunk_stats(packed, mixture_sums, o, call)


def token_loss(st: DistillStats, o: DistillOptions) -> torch.Tensor:
    """Per-token loss from the chunk's statistics (the ``lse`` difference formed from the maxima first)."""
    if o.kind == "forward_kl":
        d = st.e - ((st.m_y - st.m_z) + (st.log_s_y - st.log_s_z))
    elif o.kind == "reverse_kl":
        d = st.e - ((st.m_z - st.m_y) + (st.log_s_z - st.log_s_y))
    else:
        d = o.beta * st.k_q + (1 - o.beta) * st.e
    loss = o.kd_scale * d
    if o.ce_weight > 0:
        loss = loss + o.ce_weight * st.ce.nll
    return loss


# ------------------------------------------------------------------------------------------------------------
# the torch backend: logits, the gradient of a chunk, forward and the recompute


def _logit_grad(z1, y, rows: DistillRows, kd: torch.Tensor, ce: torch.Tensor | None, t_idx, in_shard,
                o: DistillOptions) -> torch.Tensor:
    """The gradient ``[c, v]`` with respect to the student's pre-cap logits; per-row weights ``kd`` (the
    divergence's, with ``1 / T`` folded in) and ``ce`` (the cross-entropy's)."""
    z = z1 * o.inv_t if o.inv_t != 1.0 else z1
    s = _log_probs(z, rows.m_z, rows.log_s_z)
    p = s.exp()
    if o.kind == "forward_kl":
        g = p - _log_probs(y, rows.m_y, rows.log_s_y).exp_()
    elif o.kind == "reverse_kl":
        g = torch.where(p == 0, 0.0, p * ((z - y) - rows.e[:, None]))
    else:
        log_m = _log_mixture(s, _log_probs(y, rows.m_y, rows.log_s_y), o.beta)
        g = torch.where(p == 0, 0.0, (1 - o.beta) * p * ((s - log_m) - rows.e[:, None]))
    del s, p
    g.mul_(kd[:, None])
    if ce is not None:
        p1 = _log_probs(z1, rows.m1, rows.log_s1).exp_()
        idx = t_idx[:, None]
        p1.scatter_(1, idx, torch.where(in_shard, -rows.q1, p1.gather(1, idx).squeeze(1))[:, None])  # p1_t - 1
        g.add_(p1.mul_(ce[:, None]))
    if o.softcap is not None:
        g.mul_(1 - (z1 / o.softcap) ** 2)
    return g


def row_weights(scale: torch.Tensor, o: DistillOptions) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row gradient weights from the row scale (upstream gradient x token weight; 0 ignored, NaN bad)."""
    return scale * (o.kd_scale * o.inv_t), (scale * o.ce_weight) if o.ce_weight > 0 else None


def heads(weight, bias, t_weight, t_bias, v):
    cut = lambda x: None if x is None else x[:v]  # noqa: E731  (padding rows are never part of the softmax)
    return cut(weight), cut(bias), cut(t_weight), cut(t_bias)


def distill_forward(hidden, weight, bias, t_hidden, t_weight, t_bias, tg: TokenTargets, o: DistillOptions,
                    call: Call):
    """Per-token loss ``[N]`` (weighted, 0 on ignored tokens), and what backward needs: the fast route's unscaled
    ``FastGrads``, or the lean route's ``DistillRows``."""
    n, d = hidden.shape
    acc = accumulation_dtype(hidden.dtype)
    v = call.shard.valid_rows
    w, b, tw, tb = heads(weight, bias, t_weight, t_bias, v)
    chunk = chunk_tokens(o.chunk_gib(), call.shard, hidden.dtype)
    fast = call.plan.route == "fast"
    keep = call.plan.route == "lean"
    needs = call.needs_grad
    if fast:  # unit upstream scale; 1/count (mean) and the upstream gradient are applied in backward
        unit = tg.row_scale(hidden.new_ones((), dtype=acc).expand(n))
        dx = torch.zeros(n, d, dtype=acc, device=hidden.device) if needs[0] else None
        dw = torch.zeros(v, d, dtype=acc, device=hidden.device) if needs[1] else None
        db = torch.zeros(v, dtype=acc, device=hidden.device) if needs[2] else None
    loss_tok = torch.empty(n, dtype=acc, device=hidden.device)
    rows = DistillRows.empty(n, o, acc, hidden.device) if keep else None
    for c0 in range(0, n, chunk):
        sl = slice(c0, min(n, c0 + chunk))
        z1 = y = None
        if v > 0:
            z1 = chunk_logits(hidden[sl], w, b, o.softcap, acc)
            y = chunk_logits(t_hidden[sl], tw, tb, o.teacher_softcap, acc, o.inv_t)
        st = _chunk_stats(z1, y, tg, sl, o, call, acc, hidden.device)
        loss_tok[sl] = tg.token_loss(token_loss(st, o), sl)
        if keep:
            rows.store(sl, DistillRows.of(st, o))
        if fast and v > 0:
            kd, ce = row_weights(unit[sl], o)
            g = _logit_grad(z1, y, DistillRows.of(st, o), kd, ce, tg.idx[sl], tg.in_shard[sl], o)
            accumulate_grads(g, hidden[sl], w, sl, dx, dw, db)
            del g
        del z1, y  # before the next chunk's logits exist
    return loss_tok, rows, FastGrads(dx, dw, db) if fast else None


def distill_recompute_grads(hidden, weight, bias, t_hidden, t_weight, t_bias, tg: TokenTargets, rows: DistillRows,
                            scale: torch.Tensor, o: DistillOptions, call: Call):
    """dX, dW, db from both heads' logits recomputed chunk by chunk, for per-token row scales ``scale``."""
    n, d = hidden.shape
    acc, dtype, v = rows.m_z.dtype, hidden.dtype, call.shard.valid_rows
    w, b, tw, tb = heads(weight, bias, t_weight, t_bias, v)
    need_dx, need_dw, need_db = call.needs_grad
    chunk = chunk_tokens(o.chunk_gib(), call.shard, dtype)
    dx = torch.zeros(n, d, dtype=acc, device=hidden.device) if need_dx else None
    dw = torch.zeros(v, d, dtype=acc, device=hidden.device) if need_dw else None
    db = torch.zeros(v, dtype=acc, device=hidden.device) if need_db and bias is not None else None
    kd, ce = row_weights(scale, o)
    if v > 0:
        for c0 in range(0, n, chunk):
            sl = slice(c0, min(n, c0 + chunk))
            z1 = chunk_logits(hidden[sl], w, b, o.softcap, acc)
            y = chunk_logits(t_hidden[sl], tw, tb, o.teacher_softcap, acc, o.inv_t)
            g = _logit_grad(z1, y, rows.rows(sl), kd[sl], None if ce is None else ce[sl], tg.idx[sl],
                            tg.in_shard[sl], o)
            accumulate_grads(g, hidden[sl], w, sl, dx, dw, db)
            del z1, y, g
    return (None if dx is None else dx.to(dtype), weight_grad(dw, weight.shape[0], dtype),
            pad_rows(db, weight.shape[0], dtype))


# ------------------------------------------------------------------------------------------------------------
# autograd


_TORCH = SimpleNamespace(distill_forward=distill_forward, distill_recompute_grads=distill_recompute_grads,
                         scale_cast=scale_cast)


def backend_of(call: Call):
    """The call's backend's ``distill_forward``, ``distill_recompute_grads`` and ``scale_cast``: the module
    ``vpce.distill_triton``, or the torch backend's above."""
    if call.plan.backend == "triton":
        from . import distill_triton
        return distill_triton
    return _TORCH


class LinearDistillationFunction(torch.autograd.Function):
    """Student ``hidden [N, D_s]``, ``weight``, ``bias``; teacher ``t_hidden [N, D_t]``, ``t_weight``, ``t_bias``
    (detached: no gradient); ``target [N]``; ``token_weight [N]`` or None. Returns the loss per ``o.reduction``."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight, o: DistillOptions,
                call: Call):
        tg = TokenTargets(target, call.shard, o.ignore_index, token_weight)
        forward = backend_of(call).distill_forward
        loss_tok, rows, fast = forward(hidden, weight, bias, t_hidden, t_weight, t_bias, tg, o, call)
        ctx.o, ctx.call, ctx.fast = o, call, fast  # fast: None after its one use
        ctx.denominator = tg.denominator(loss_tok.dtype)
        ctx.dtype, ctx.rows = hidden.dtype, weight.shape[0]
        if rows is not None:
            ctx.save_for_backward(hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight, *rows)
        return tg.reduce(loss_tok, o.reduction)

    @staticmethod
    def backward(ctx, grad):
        with torch.autocast(grad.device.type, enabled=False):
            return LinearDistillationFunction._backward(ctx, grad)

    @staticmethod
    def _backward(ctx, grad):
        none = (None,) * 7
        o, call = ctx.o, ctx.call
        g = grad.detach().to(ctx.denominator.dtype)
        if o.reduction == "mean":
            g = g / ctx.denominator
        if call.plan.route != "fast":
            hidden, weight, bias, t_hidden, t_weight, t_bias, target, token_weight, *rows = ctx.saved_tensors
            tg = TokenTargets(target, call.shard, o.ignore_index, token_weight)
            scale = tg.row_scale(g.expand(hidden.shape[0]) if g.dim() == 0 else g.reshape(-1))
            recompute = backend_of(call).distill_recompute_grads
            return (*recompute(hidden, weight, bias, t_hidden, t_weight, t_bias, tg, DistillRows(*rows), scale, o,
                               call), *none)
        if ctx.fast is None:
            raise RuntimeError("vpce: this loss formed its gradients in forward and they were already used; for "
                               "a second backward pass use memory_budget='lean'")
        grads, ctx.fast = ctx.fast, None
        return (*finish_fast_grads(grads, g, ctx.dtype, ctx.rows, None, backend_of(call).scale_cast), *none)


# ------------------------------------------------------------------------------------------------------------
# the public function


def make_distill_options(*, divergence, beta, temperature, temperature_squared, ce_weight, has_target, ignore_index,
                         reduction, softcap, teacher_softcap, memory_budget) -> DistillOptions:
    """Validate the per-token options (``ValueError``/``TypeError`` naming the argument) into ``DistillOptions``."""
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence: expected one of {DIVERGENCES}, got {divergence!r}")
    if divergence == "jsd":
        check_number("beta", beta, low=0.0, allow_none=True)
        if beta is not None and beta > 1:
            raise ValueError(f"beta: expected a number in [0, 1], got {beta}")
    elif beta is not None:
        raise ValueError(f"beta: expected None with divergence={divergence!r} (beta is the JSD's mixture weight; "
                         f"pass divergence='jsd'), got {beta!r}")
    check_number("temperature", temperature, low=0.0, low_open=True)
    if temperature == math.inf:
        raise ValueError("temperature: expected a finite number > 0, got inf")
    check_bool("temperature_squared", temperature_squared)
    check_number("ce_weight", ce_weight, low=0.0)
    if ce_weight > 1:
        raise ValueError(f"ce_weight: expected a number in [0, 1], got {ce_weight}")
    if ce_weight > 0 and not has_target:
        raise ValueError(f"target: expected a tensor of hard labels with ce_weight={ce_weight}, got None")
    check_int("ignore_index", ignore_index, allow_none=False)
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction: expected one of {REDUCTIONS}, got {reduction!r}")
    check_number("softcap", softcap, low=0.0, low_open=True, allow_none=True)
    check_number("teacher_softcap", teacher_softcap, low=0.0, low_open=True, allow_none=True)
    memory_budget = check_memory_budget(memory_budget)
    beta = 0.5 if beta is None else float(beta)
    kind = divergence if divergence != "jsd" or 0 < beta < 1 else ("forward_kl" if beta == 0 else "reverse_kl")
    t = float(temperature)
    return DistillOptions(kind=kind, beta=beta, inv_t=1.0 / t, kd_scale=(1 - ce_weight) * (t * t if
                          temperature_squared else 1.0), ce_weight=float(ce_weight),
                          ignore_index=int(ignore_index) if has_target else -1, reduction=reduction,
                          softcap=None if softcap is None else float(softcap),
                          teacher_softcap=None if teacher_softcap is None else float(teacher_softcap),
                          memory_budget=memory_budget)


def _is_dtensor(x) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(x, DTensor)


def _check_teacher(hidden, weight, t_hidden, t_weight, t_bias, sequence_parallel):
    """The teacher's tensors against the student's (already checked): same dtype, device, tokens and vocab rows."""
    for name, t in (("teacher_hidden", t_hidden), ("teacher_weight", t_weight)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t_bias is not None and not isinstance(t_bias, torch.Tensor):
        raise TypeError(f"teacher_bias: expected a torch.Tensor or None, got {type(t_bias).__name__}")
    for name, t in (("teacher_hidden", t_hidden), ("teacher_weight", t_weight), ("teacher_bias", t_bias)):
        if t is None:
            continue
        if t.dtype != hidden.dtype:
            raise TypeError(f"{name}: expected dtype {hidden.dtype} (hidden's), got {t.dtype}")
        if t.device != hidden.device:
            raise ValueError(f"{name}: expected device {hidden.device} (hidden's), got {t.device}")
    lead = tuple(hidden.shape[:-1])
    if t_hidden.dim() < 1 or tuple(t_hidden.shape[:-1]) != lead:
        what = "this rank's slice, as hidden" if sequence_parallel else "hidden's leading dims"
        raise ValueError(f"teacher_hidden: expected shape [{', '.join(map(str, lead))}, D_teacher] ({what}), got "
                         f"{tuple(t_hidden.shape)}")
    if t_weight.dim() != 2 or t_weight.shape != (weight.shape[0], t_hidden.shape[-1]):
        raise ValueError(f"teacher_weight: expected shape ({weight.shape[0]}, {t_hidden.shape[-1]}) (the student "
                         f"weight's vocab rows, teacher_hidden's last dim), got {tuple(t_weight.shape)}")
    if t_bias is not None and t_bias.shape != (weight.shape[0],):
        raise ValueError(f"teacher_bias: expected shape ({weight.shape[0]},), got {tuple(t_bias.shape)}")


def linear_distillation_loss(hidden, weight, teacher_hidden, teacher_weight, target=None, bias=None,
                             teacher_bias=None, *, divergence="forward_kl", beta=None, temperature=1.0,
                             temperature_squared=False, ce_weight=0.0, ignore_index=-100, reduction="mean",
                             token_weight=None, softcap=None, teacher_softcap=None, group=None, vocab_start=None,
                             vocab_size=None, sequence_parallel=False, backend="auto", memory_budget="auto",
                             validate=False):
    """Distillation loss between a student head ``hidden @ weight.T (+ bias)`` and a teacher head
    ``teacher_hidden @ teacher_weight.T (+ teacher_bias)`` without materializing either's logits.

    Args:
        hidden: the student's ``[..., D_s]`` fp32/fp16/bf16 (fp64 too) hidden states.
        weight: ``[V_local, D_s]``, the student's lm_head or, under ``group``, this rank's rows of it.
        teacher_hidden: ``[..., D_t]``, hidden's leading shape and dtype; the hidden sizes may differ.
        teacher_weight: ``[V_local, D_t]``, the same vocab rows as ``weight``.
        target: None, or ``[...]`` int64/int32 global ids (the full sequence under ``sequence_parallel``):
            tokens whose target is ``ignore_index`` count for nothing, and with ``ce_weight > 0`` the hard labels
            of the cross-entropy term.
        bias, teacher_bias: ``[V_local]`` or None.
        divergence: ``"forward_kl"`` (KL(teacher || student)), ``"reverse_kl"`` (KL(student || teacher)) or
            ``"jsd"``, the generalized Jensen-Shannon divergence with ``beta`` (default 0.5; 0 and 1 give the
            forward and reverse KL, as TRL's ``generalized_jsd_loss`` defines them).
        beta: the JSD's weight of the teacher in the mixture; only with ``divergence="jsd"``.
        temperature: > 0, divides both heads' (capped) logits of the divergence.
        temperature_squared: multiply the divergence by ``temperature**2`` (Hinton et al.).
        ce_weight: in [0, 1]; the loss is ``(1 - ce_weight) * divergence + ce_weight * cross_entropy`` of the
            untempered student logits against ``target``.
        reduction: ``"mean"`` over non-ignored tokens (weighted by ``token_weight``), ``"sum"`` or ``"none"``.
        token_weight: float, target's (or hidden's leading) shape, no grad: scales each token's loss.
        softcap, teacher_softcap: each head's logits become ``c * tanh(logits / c)`` before the temperature.
        group, vocab_start, vocab_size, sequence_parallel, validate: as in ``linear_cross_entropy``; both heads are
            sharded over ``group`` with the same rows. Under ``sequence_parallel`` both hidden states are this
            rank's slices.
        backend: ``"auto"`` (Triton on CUDA, torch otherwise), ``"triton"`` or ``"torch"`` (the chunked PyTorch
            backend; float64 too).
        memory_budget: ``"auto"``/``"fast"`` (gradients formed in forward), ``"lean"`` (recomputed in backward),
            or GiB of live chunk data.

    Returns:
        The fp32 loss (fp64 for fp64 inputs): a scalar, or the tokens' shape for ``reduction="none"``. The teacher
        gets no gradient: its tensors are used detached, whether or not they require grad.
    """
    originals = (hidden, weight, bias, teacher_hidden, teacher_weight, teacher_bias, target)
    has_target = target is not None
    if not has_target and isinstance(hidden, torch.Tensor) and hidden.dim() >= 1:
        _, world = parallel.group_rank_and_size(group)
        lead = tuple(hidden.shape[:-1])
        if sequence_parallel is True and lead:
            lead = (lead[0] * world,) + lead[1:]
        target = torch.zeros(lead, dtype=torch.int64, device=hidden.device)  # no token ignored (ignore_index -1)
    teacher_hidden, teacher_weight, teacher_bias = autocast_operands(teacher_hidden, teacher_weight, teacher_bias)
    box = {}

    def local_checks():
        for name, x in zip(("hidden", "weight", "bias", "teacher_hidden", "teacher_weight", "teacher_bias",
                            "target"), originals):
            if _is_dtensor(x):
                raise TypeError(f"{name}: expected a plain torch.Tensor (linear_distillation_loss takes this rank's "
                                f"local shards with group=, vocab_start=), got a DTensor")
        box["o"] = make_distill_options(
            divergence=divergence, beta=beta, temperature=temperature, temperature_squared=temperature_squared,
            ce_weight=ce_weight, has_target=has_target, ignore_index=ignore_index, reduction=reduction,
            softcap=softcap, teacher_softcap=teacher_softcap, memory_budget=memory_budget)
        _check_teacher(box["hidden"], box["weight"], teacher_hidden, teacher_weight, teacher_bias, sequence_parallel)
        check_token_weight(token_weight, target)

    def plan(needs, _dtype, backend_name, sharded, sp):
        o = box["o"]
        return plan_distillation(o.reduction, o.memory_budget == "lean", needs, backend_name, sharded, sp)

    def fields():
        o = box["o"]
        short = {"forward_kl": "fwd_kl", "reverse_kl": "rev_kl"}.get(divergence, divergence)  # read in messages
        return [("divergence", short), ("beta", o.beta), ("temperature", float(temperature)),
                ("temperature_squared", temperature_squared), ("ce_weight", o.ce_weight),
                ("target given", has_target), ("reduction", o.reduction), ("ignore_index", o.ignore_index),
                ("softcap", o.softcap), ("teacher_softcap", o.teacher_softcap), ("memory_budget", o.memory_budget),
                ("token_weight", token_weight is not None), ("teacher hidden size", teacher_hidden.shape[-1]),
                ("teacher dtype", dtype_name(teacher_hidden.dtype)), ("teacher_bias", teacher_bias is not None)]

    def checks_with_student(_weight, _cast):
        # the student's hidden and weight as prepare_call computes with them (under autocast: cast)
        box["hidden"], box["weight"], _ = autocast_operands(hidden, weight, None)
        local_checks()

    h2, weight2, bias2, target, call = prepare_call(
        "distill", hidden, weight, target, bias, group=group, vocab_start=vocab_start, vocab_size=vocab_size,
        sequence_parallel=sequence_parallel, backend=backend,
        validate=validate, ignore_index=(ignore_index if isinstance(ignore_index, int) else -100) if has_target
        else -1, local_checks=checks_with_student, plan=plan, fields=fields)
    o = box["o"]
    t2 = teacher_hidden.detach().reshape(-1, teacher_hidden.shape[-1])
    if call.plan.sequence_parallel and call.shard.sharded and call.plan.dx_reduce != "forward":
        t2 = parallel.gather_sequence(t2.contiguous(), call.shard)  # (the Triton fast route gathers it itself)
    tw = teacher_weight.detach()
    tb = None if teacher_bias is None else teacher_bias.detach()
    tw1 = None if token_weight is None else token_weight.reshape(-1).to(accumulation_dtype(h2.dtype))
    if torch.compiler.is_compiling():
        if call.shard.sharded:
            raise NotImplementedError("vpce.linear_distillation_loss under torch.compile supports one process; call "
                                      "it outside the compiled region under a group")
        from . import library
        with torch.autocast(h2.device.type, enabled=False):
            loss = library.linear_distillation_loss(h2, weight2, bias2, t2, tw, tb, target.reshape(-1), tw1,
                                                    call.plan.backend, o, call.shard.vocab_size, call.needs_grad)
        return loss.reshape(target.shape) if o.reduction == "none" else loss
    hidden_in = h2
    if call.plan.dx_reduce == "region":
        hidden_in = parallel.enter_vocab_parallel(h2, call.shard, call.plan.sequence_parallel)
    with torch.autocast(h2.device.type, enabled=False):  # the operands are already in the compute dtype
        loss = LinearDistillationFunction.apply(hidden_in, weight2, bias2, t2, tw, tb, target.reshape(-1), tw1, o,
                                                call)
    return loss.reshape(target.shape) if o.reduction == "none" else loss
