"""The distillation's formulas, per-chunk statistics and their exchange, shared by both backends
(``backends.pytorch.distill_forward``, ``backends.triton.distill_forward``) of
``vpce.distill.linear_distillation_loss``: the divergence between a student head ``hidden @ weight.T (+ bias)`` and a
teacher head ``teacher_hidden @ teacher_weight.T (+ teacher_bias)`` over a vocab that may be sharded over a
tensor-parallel group, with exact loss and exact student gradients. (The softmax family's are
``vpce.formulas.softmax``.)

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
softmax statistics of the cross-entropy (``vpce.rank_stats.combine_rank_stats``): each rank sends local maxima and
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

The torch backend (CPU, or ``backend="torch"``; ``vpce.backends.pytorch``) holds a few fp32 ``[C, V_local]`` chunk
tensors, never ``[N, V]``. The Triton backend (``vpce.backends.triton``; ``backend="triton"``) computes the same
statistics with bandwidth-bound kernels over cuBLAS-written logits and exchanges them through the same
``exchange_chunk_stats``.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .. import parallel
from ..options import DistillOptions
from ..rank_stats import RankStats, combine_rank_stats
from ..routing import Call
from ..targets import TokenTargets

__all__ = ["DistillStats", "DistillRows", "KL_HEAD", "rows_layout", "local_stats", "exchange_chunk_stats",
           "mixture_sums", "token_loss", "row_weights", "heads", "log_softmax", "log_mixture"]


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
    ce: RankStats | None
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


def log_softmax(z: torch.Tensor, m: torch.Tensor, log_s: torch.Tensor) -> torch.Tensor:
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
    z = z1 * o.student.inv_t if o.student.inv_t != 1.0 else z1
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
    ``vpce.rank_stats.combine_rank_stats`` does: ``M = max_r m_r``, ``S = sum_r x_r exp(m_r - M)``,
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


def log_mixture(s: torch.Tensor, u: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta q + (1 - beta) p)`` from the log-probabilities ``s = log p``, ``u = log q``."""
    return torch.logaddexp(s + math.log1p(-beta), u + math.log(beta))


def mixture_sums(z1, y, st: DistillStats, o: DistillOptions) -> torch.Tensor:
    """The JSD's second pass on this shard: ``[K_q, K_p]`` partial sums ``[2, c]``."""
    z = z1 * o.student.inv_t if o.student.inv_t != 1.0 else z1
    s = log_softmax(z, st.m_z, st.log_s_z)
    u = log_softmax(y, st.m_y, st.log_s_y)
    log_m = log_mixture(s, u, o.beta)
    p, q = s.exp(), u.exp()
    return torch.stack([_weighted(q, u - log_m), _weighted(p, s - log_m)])


def exchange_chunk_stats(packed: torch.Tensor, mixture_sums, o: DistillOptions, call: Call,
                         combine_heads=_combine_heads, combine_ce=combine_rank_stats) -> DistillStats:
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


def row_weights(scale: torch.Tensor, o: DistillOptions) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-row gradient weights from the row scale (upstream gradient x token weight; 0 ignored, NaN bad)."""
    return scale * (o.kd_scale * o.student.inv_t), (scale * o.ce_weight) if o.ce_weight > 0 else None


def heads(weight, bias, t_weight, t_bias, v):
    cut = lambda x: None if x is None else x[:v]  # noqa: E731  (padding rows are never part of the softmax)
    return cut(weight), cut(bias), cut(t_weight), cut(t_bias)
