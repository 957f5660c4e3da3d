"""Per-token formulas shared by both backends: outputs from the global softmax statistics, and the per-row
coefficients of the gradient.

With ``z`` the (soft-capped, tempered) logits over the real global vocab ``V`` and ``t`` the target, every output
vpce offers is a function of the per-token statistics of ``vpce.rank_stats.RankStats`` (exchanged once per chunk
under a group): the max ``M``, ``log S = log sum_j exp(z_j - M)``, ``nll = -log p_t`` and ``q = 1 - p_t`` (both
formed without cancellation), ``sum_j z_j`` and ``E[z] = sum_j p_j z_j``.

The gradient with respect to the pre-cap logit ``x_j`` always has the form::

    dL/dx_j = (p_j (a + b (z_j - M)) + d) * dcap_j                      j != t
    dL/dx_t = ((a + c) - a q + b (z_t - M) p_t + d) * dcap_t               (= the same, with p_t = 1 - q)

so a backend only needs the per-row vectors ``a, b, c, d`` (the ``1/T`` folded in). Writing the target's entry
through ``q`` keeps a confident token's ``p_t - 1`` exact where ``p_t`` itself rounds to 1.

* cross-entropy with label smoothing ``eps`` and z-loss ``zl``, row scale ``s`` (upstream gradient x token weight,
  times the logit scale):
  ``loss = (1 - eps) nll + eps (lse - sum_j z_j / V) + zl lse^2``;
  ``a = s (1 + 2 zl lse)``, ``b = 0``, ``c = -s (1 - eps)``, ``d = -s eps / V``;
* the same with per-class weights ``w`` (``class_weight``; torch's ``cross_entropy(weight=w)``), ``W = sum_j w_j``
  and the additive statistic ``sum_j w_j z_j`` in place of ``sum_j z_j``:
  ``loss = (1 - eps) w_t nll + (eps / V) (W lse - sum_j w_j z_j) + zl w_t lse^2``;
  ``a = s ((1 - eps) w_t + eps W / V + 2 zl w_t lse)``, ``c = -s (1 - eps) w_t``, and ``d = -s eps / V`` times
  the column's weight ``w_j`` (the backends' per-column term);
* log-probability and entropy with upstream gradients ``gL``, ``gH``:
  ``log p_t = -nll``, ``H = lse - E[z]``; ``dH/dz_j = p_j (E[z] - z_j)``; so
  ``a = -gL + gH (E[z] - M)``, ``b = -gH``, ``c = gL``, ``d = 0``.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch

from ..options import LogProbLossOptions, LossOptions
from ..rank_stats import RankStats
from ..targets import TokenTargets

__all__ = ["RowStats", "Coefficients", "ce_loss", "ce_coefficients", "ce_token_outputs", "logprob_outputs",
           "logprob_coefficients", "target_probability", "ce_metrics", "logprob_extras", "Evaluation",
           "evaluate_loss_fn", "logprob_part_outputs", "loss_fn_coefficients"]


class RowStats(NamedTuple):
    """What a gradient pass needs of each token's global statistics: ``M``, ``log S`` and ``q = 1 - p_t``."""

    m: torch.Tensor
    log_s: torch.Tensor
    q: torch.Tensor

    @staticmethod
    def empty(n: int, dtype: torch.dtype, device) -> "RowStats":
        return RowStats(*(torch.empty(n, dtype=dtype, device=device) for _ in range(3)))

    @staticmethod
    def of(st: RankStats) -> "RowStats":
        return RowStats(st.m, st.log_s, st.q)

    def store(self, sl: slice, st: RankStats):
        self.m[sl], self.log_s[sl], self.q[sl] = st.m, st.log_s, st.q

    def rows(self, sl: slice) -> "RowStats":
        return RowStats(self.m[sl], self.log_s[sl], self.q[sl])

    @property
    def lse(self) -> torch.Tensor:
        return self.m + self.log_s


class Coefficients(NamedTuple):
    """Per-row gradient coefficients; ``b`` and ``d`` are None where they are zero."""

    a: torch.Tensor
    b: torch.Tensor | None
    c: torch.Tensor
    d: torch.Tensor | None

    def rows(self, sl: slice) -> "Coefficients":
        return Coefficients(*(None if x is None else x[sl] for x in self))


def ce_loss(st: RankStats, opts: LossOptions, vocab_size: int, class_weight=None) -> torch.Tensor:
    """Per-token loss; ``class_weight``: ``(w_t, W)`` (``TokenTargets.class_rows``), ``st.sums[0]`` then being
    ``sum_j w_j z_j``."""
    eps = opts.label_smoothing
    if class_weight is not None:
        wt, total = class_weight
        loss = wt * st.nll if not eps else \
            (1 - eps) * wt * st.nll + eps * (total * st.lse - st.sums[0]) / vocab_size
        if opts.z_loss:
            loss = loss + opts.z_loss * wt * st.lse * st.lse
        return loss
    loss = st.nll if not eps else (1 - eps) * st.nll + eps * (st.lse - st.sums[0] / vocab_size)
    if opts.z_loss:
        loss = loss + opts.z_loss * st.lse * st.lse
    return loss


def target_probability(st: RankStats) -> torch.Tensor:
    """``p_t = exp(-nll)``, exact for tiny and for confident ``p_t`` alike (``token_scaling``'s factor)."""
    return torch.exp(-st.nll)


def ce_metrics(st: RankStats, opts: LossOptions, skip=()) -> dict[str, torch.Tensor]:
    """The per-token metrics ``opts.metrics`` asks for (before masking) but those in ``skip``: the z-loss term
    ``z_loss * lse^2``, the argmax indicator (1.0 or 0.0), the entropy ``lse - E[z]``."""
    out = {}
    if "z_loss" in opts.metrics and "z_loss" not in skip:
        out["z_loss"] = opts.z_loss * st.lse * st.lse
    if "token_accuracy" in opts.metrics and "token_accuracy" not in skip:
        out["token_accuracy"] = st.top1
    if "entropy" in opts.metrics and "entropy" not in skip:
        out["entropy"] = st.lse - st.expectations[0]
    return out


def ce_token_outputs(st: RankStats, opts: LossOptions, vocab_size: int, tg: TokenTargets, part: slice,
                     loss_tok: torch.Tensor, metrics: dict[str, torch.Tensor], skip=()):
    """Fill rows ``part`` of the per-token loss (class-weighted, times ``p_t`` with ``token_scaling``, whose factor
    goes to ``tg.scaling``) and of the asked metrics but those in ``skip`` (filled elsewhere), from the part's
    global statistics. Both backends call it."""
    loss = ce_loss(st, opts, vocab_size, tg.class_rows(part))
    if opts.token_scaling:
        tg.scaling[part] = target_probability(st)
        loss = loss * tg.scaling[part]
    loss_tok[part] = tg.token_loss(loss, part)
    for k, value in ce_metrics(st, opts, skip).items():
        metrics[k][part] = tg.metric(value, part)


def ce_coefficients(scale: torch.Tensor, lse: torch.Tensor, opts: LossOptions, vocab_size: int,
                    class_weight=None) -> Coefficients:
    """``class_weight``: ``(w_t, W)`` as for ``ce_loss``; ``d`` is then the row factor of the per-column term
    ``d w_j``."""
    eps = opts.label_smoothing
    if opts.folded.inv_t != 1.0:
        scale = scale * opts.folded.inv_t  # dz/dx = logit_scale (times the cap's derivative)
    d = scale * (-eps / vocab_size) if eps else None
    if class_weight is not None:
        wt, total = class_weight
        sw = scale * wt
        a = sw * (1 - eps) + scale * (eps * total / vocab_size) if eps else sw
        if opts.z_loss:
            a = a + sw * (2 * opts.z_loss * lse)
        c = sw * -(1 - eps)
        return Coefficients(a.contiguous(), None, c.contiguous(), None if d is None else d.contiguous())
    a = scale * (1 + 2 * opts.z_loss * lse) if opts.z_loss else scale
    return Coefficients(a.contiguous(), None, (scale * -(1 - eps)).contiguous(), None if d is None else d.contiguous())


def logprob_outputs(tg: TokenTargets, st: RankStats, entropy: bool):
    """Per-token ``(log p_t, entropy or None)``: 0 on ignored tokens, NaN on out-of-range targets."""
    everything = slice(None)
    ent = tg.token_loss(st.lse - st.expectations[0], everything) if entropy else None
    return tg.token_loss(-st.nll, everything), ent


def loss_fn_metric_outputs(o, n: int, dev) -> dict:
    """Buffers of the metric outputs a ``LogProbLossOptions`` asks for (``is_top1``, ``mean_logits``), by name."""
    out = {}
    if o.top1:
        out["is_top1"] = torch.zeros(n, dtype=torch.bool, device=dev)
    if o.mean_logits:
        out["mean_logits"] = torch.zeros(n, dtype=torch.float32, device=dev)
    return out


def store_metric_outputs(out: dict, tg: TokenTargets, st: RankStats, part: slice, vocab_size: int) -> None:
    """The metric outputs of tokens ``part`` from their global statistics (as ``logprob_extras``)."""
    if "is_top1" in out:
        out["is_top1"][part] = tg.metric(st.top1, part) == 1
    if "mean_logits" in out:
        out["mean_logits"][part] = tg.metric(st.sums[0] / vocab_size, part)


def logprob_extras(tg: TokenTargets, st: RankStats, lp, vocab_size: int) -> list[torch.Tensor]:
    """The detached extras ``linear_log_probs`` asks for, in its return order: ``is_top1`` (bool), the mean logit,
    ``log sum_j p_j^2``; 0 (False) on ignored tokens."""
    everything = slice(None)
    out = []
    if lp.top1:
        out.append(tg.metric(st.top1, everything) == 1)
    if lp.mean_logits:
        out.append(tg.metric(st.sums[0] / vocab_size, everything))
    if lp.log_sum_sq:
        out.append(tg.metric(st.log_sum_sq, everything))
    return out


def logprob_coefficients(tg: TokenTargets, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None,
                         centred_mean_z: torch.Tensor | None, inv_t: float, like: torch.Tensor) -> Coefficients:
    """Coefficients for upstream gradients on log p_t and the entropy (either may be None: unused);
    ``centred_mean_z = E[z] - M``. Ignored targets get zero coefficients; an out-of-range target poisons its row
    with NaN."""
    keep = tg.keep & ~tg.bad
    zero = torch.zeros_like(like)
    gl = zero if g_logp is None else torch.where(keep, g_logp.to(like.dtype), zero) * inv_t
    a, b = -gl, None
    if g_ent is not None and centred_mean_z is not None:
        gh = torch.where(keep, g_ent.to(like.dtype), zero) * inv_t
        a, b = gh * centred_mean_z - gl, -gh
    a = torch.where(tg.bad, float("nan"), a)
    return Coefficients(a.contiguous(), None if b is None else b.contiguous(), gl.contiguous(), None)


# -- a loss of the log-probabilities (``linear_log_prob_loss``): its per-token upstream gradients ------------------

class Evaluation(NamedTuple):
    """``loss_fn`` on some tokens: its summed value, and the gradients of that sum with respect to the tokens'
    ``log_probs`` and ``entropy`` (None where ``loss_fn`` does not get it)."""

    value: torch.Tensor
    g_logp: torch.Tensor
    g_ent: torch.Tensor | None

    def rows(self, sl: slice) -> "Evaluation":
        return Evaluation(self.value, self.g_logp[sl], None if self.g_ent is None else self.g_ent[sl])


def evaluate_loss_fn(o: LogProbLossOptions, logp: torch.Tensor, ent: torch.Tensor | None, keep: torch.Tensor,
                     inputs: dict, sl: slice) -> Evaluation:
    """``loss_fn`` on tokens ``sl`` (flat; whole rows in scope ``"sequence"``), with autograd on detached copies of
    their ``log_probs`` and ``entropy`` only: the per-token upstream gradients of the gradient pass."""
    shape = (-1, o.row) if o.scope == "sequence" else (-1,)
    with torch.enable_grad(), torch.autocast(logp.device.type, enabled=False):
        lp = logp.detach().reshape(shape).requires_grad_()
        en = None if ent is None else ent.detach().reshape(shape).requires_grad_()
        kw = {k: v[sl].reshape(shape + tuple(v.shape[1:])) for k, v in inputs.items()}
        out = o.loss_fn(lp, en, **kw)
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"loss_fn: expected it to return a torch.Tensor, got {type(out).__name__}")
        if out.shape == lp.shape:  # a per-token result: dropped at ignored tokens
            out = torch.where(keep[sl].reshape(shape), out, 0)
        total = out.sum()
        wrt = [lp] if en is None else [lp, en]
        grads = torch.autograd.grad(total, wrt, allow_unused=True) if total.requires_grad else [None] * len(wrt)
    g_logp = torch.zeros_like(logp) if grads[0] is None else grads[0].reshape(-1)
    g_ent = None
    if en is not None:
        g_ent = torch.zeros_like(logp) if grads[1] is None else grads[1].reshape(-1)
    return Evaluation(total.detach().to(logp.dtype), g_logp, g_ent)


def logprob_part_outputs(tg: TokenTargets, st: RankStats, part: slice, entropy: bool):
    """``(log_probs, entropy or None)`` of tokens ``part`` from their global statistics (0 at ignored tokens)."""
    logp = tg.token_loss(-st.nll, part)
    ent = tg.token_loss(st.lse - st.expectations[0], part) if entropy else None
    return logp, ent


def loss_fn_coefficients(tg: TokenTargets, part: slice, ev: Evaluation, st: RankStats, inv_t: float
                         ) -> Coefficients:
    """The gradient pass's coefficients of tokens ``part`` for the upstream gradients ``ev`` (of those tokens)."""
    sub = SimpleNamespace(keep=tg.keep[part], bad=tg.bad[part])
    centred = st.expectations[0] - st.m if ev.g_ent is not None else None
    return logprob_coefficients(sub, ev.g_logp, ev.g_ent, centred, inv_t, like=st.m)
