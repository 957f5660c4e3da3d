"""The softmax statistics of one token chunk over a vocab that may be sharded, and their combine across ranks.

Per token chunk each rank has a local max ``m_r`` (over its valid rows, with or without the target's: the combine holds
for either) and the sum ``x_r`` of ``exp(z - m_r)`` over its valid rows but the target's; the target logit ``t_r``
(``-inf`` on ranks that do not hold it); and optionally additive sums (the sum of all logits) and weighted sums (``w_r =
sum_j exp(z_j - m_r) z_j`` but the target's, for the entropy). They are packed into one ``[k, chunk]`` fp32 tensor that
``vpce.parallel`` exchanges with one all-gather; every rank combines them identically (``combine_rank_stats``;
``vpce.kernels.combine_rank_stats`` is its one-launch form)::

    T = max_r t_r,  M = max(max_r m_r, T),  X = sum_r x_r exp(m_r - M),  S = X + exp(T - M),  log S,
    nll = -log p_t = log1p(X exp(M - T)),  1 - p_t = X / S,  E[z] = (sum_r w_r exp(m_r - M) + exp(T - M) T) / S
    metrics: sum p^2 = (sum_r q_r exp(2 (m_r - M)) + exp(2 (T - M))) / S^2 (q_r: sum of exp(2 (z - m_r)) but the
    target's),  argmax = target  <=>  T' >= max_r m_r and T' > max_r b_r (b_r: max of the logits of a lower
    global id; T': the target logit as the logits that gave m_r and b_r hold it, which the fast route rounds to
    the inputs' dtype beside its fp32 T, so that a tie is judged on equal terms whichever rank holds each side)

Keeping the target's term out of ``X`` is what makes confident tokens exact: ``-log p_t`` and ``1 - p_t`` of a
token with ``p_t = 1 - 1e-7`` come without cancellation. A rank (or tile) whose logits are all ``-inf`` has
``m_r = -inf`` and contributes nothing.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

__all__ = ["RankStats", "combine_rank_stats"]


class RankStats(NamedTuple):
    """Global per-token softmax statistics of one token chunk (fp32, or fp64 for fp64 inputs)."""

    m: torch.Tensor
    """Max logit ``M`` (plus the agreement's poison)."""
    log_s: torch.Tensor
    """``log sum_j exp(z_j - M)``; ``lse = M + log_s``."""
    nll: torch.Tensor
    """``-log p_t`` without cancellation (inf where the token has no target in the vocab)."""
    q: torch.Tensor
    """``1 - p_t`` without cancellation."""
    sums: list[torch.Tensor]
    """Each additive statistic summed over the ranks (the sum of logits, for label smoothing)."""
    expectations: list[torch.Tensor]
    """Each weighted statistic's softmax expectation (``E[z]``, for the entropy)."""
    log_sum_sq: torch.Tensor | None = None
    """``log sum_j p_j^2`` (asked with ``sum_sq``), else None."""
    top1: torch.Tensor | None = None
    """1.0 where the target is the argmax with ties to the lowest global id (asked with ``max_before``), else 0.0;
    None when not asked."""

    @property
    def lse(self) -> torch.Tensor:
        return self.m + self.log_s

    @staticmethod
    def cat(parts: list["RankStats"], n_sums: int, n_expect: int, like: torch.Tensor, sum_sq: bool = False,
            max_before: bool = False) -> "RankStats":
        """The statistics of consecutive token chunks as one (``like``: an empty tensor of the dtype/device)."""
        if not parts:
            return RankStats(like, like, like, like, [like] * n_sums, [like] * n_expect, like if sum_sq else None,
                             like if max_before else None)
        cat = lambda i, j=None: torch.cat([p[i] if j is None else p[i][j] for p in parts])  # noqa: E731
        return RankStats(cat(0), cat(1), cat(2), cat(3), [cat(4, j) for j in range(n_sums)],
                         [cat(5, j) for j in range(n_expect)], cat(6) if sum_sq else None,
                         cat(7) if max_before else None)


def combine_rank_stats(every: torch.Tensor, n_sums: int, poison: torch.Tensor | None = None, sum_sq: bool = False,
                       max_before: bool = False) -> RankStats:
    """Every rank's packed statistics ``[W, R, C]`` (rows: max, sum of exp but the target, target logit, ``n_sums``
    additive statistics, the weighted sums, then with ``sum_sq`` the sum of ``exp(2 (z - m_r))`` but the target's
    and with ``max_before`` the max of the logits whose global id is below the target's and the target logit as
    those logits hold it) -> ``RankStats``; the same bytes in the same order on every rank.
    (``vpce.kernels.combine_rank_stats`` is the one-launch form.)"""
    n_w = every.shape[1] - 3 - n_sums - sum_sq - 2 * max_before
    m_all, x_all, t_all = every[:, 0], every[:, 1], every[:, 2]
    t = t_all.amax(0)
    mo = m_all.amax(0)
    m = torch.maximum(mo, t)  # a rank's max may leave the target out
    if poison is not None:
        m, mo = m + poison, mo + poison
    safe = torch.where(m == -math.inf, 0.0, m)
    rescale = torch.exp(m_all - safe)  # a rank with m_r = -inf contributes 0; NaN or +inf propagate
    x = (x_all * rescale).sum(0)
    e_t = torch.exp(t - safe)
    s = x + e_t
    d = m - t
    # -log p_t = log(S / e_t) = log1p(X exp(M - T)); past d = 20 the loss is large and plain sums lose nothing
    nll = torch.where(d <= 20, torch.log1p(x * torch.exp(torch.clamp(d, max=20))), d + torch.log(s))
    at_t = torch.where(e_t == 0, 0.0, e_t * t)  # the target's term of sum_j exp(z_j - M) z_j
    expect = [((every[:, 3 + n_sums + i] * rescale).sum(0) + at_t) / s for i in range(n_w)]
    log_s = torch.log(s)
    log_sum_sq = top1 = None
    row = 3 + n_sums + n_w
    if sum_sq:  # sum_j p_j^2 = (sum_r sq_r exp(2 (m_r - M)) + exp(2 (T - M))) / S^2
        log_sum_sq = torch.log((every[:, row] * rescale * rescale).sum(0) + e_t * e_t) - 2 * log_s
        row += 1
    if max_before:  # argmax = target (ties to the lowest id): T' is the max and beats every logit of a lower id
        ts = every[:, row + 1].amax(0)
        top1 = ((ts >= mo) & (ts > every[:, row].amax(0))).to(m.dtype)
    return RankStats(m, log_s, nll, x / s, [every[:, 3 + i].sum(0) for i in range(n_sums)], expect, log_sum_sq,
                     top1)
