"""Per-token formulas shared by both backends: outputs from the global softmax statistics, and the per-row
coefficients of the gradient.

With ``z`` the (soft-capped, tempered) logits over the real global vocab ``V`` and ``t`` the target, every output
vpce offers is a function of a few per-token statistics (all exchanged once per chunk under a group):
``lse = log sum_j exp(z_j)``, the target logit ``z_t``, ``sum_j z_j`` and ``E[z] = sum_j p_j z_j``.

Its gradient with respect to the pre-cap logit ``x_j`` always has the form::

    dL/dx_j = (p_j (a + b z_j) + c [j == t] + d) * dcap_j / T

so a backend only needs the per-row vectors ``a, b, c, d`` (the ``1/T`` folded in):

* cross-entropy with label smoothing ``eps`` and z-loss ``zl``, row scale ``s`` (upstream gradient x token weight):
  ``loss = lse - (1 - eps) z_t - (eps / V) sum_j z_j + zl lse^2``;
  ``a = s (1 + 2 zl lse)``, ``b = 0``, ``c = -s (1 - eps)``, ``d = -s eps / V``;
* log-probability and entropy with upstream gradients ``gL``, ``gH``:
  ``log p_t = z_t - lse``, ``H = lse - E[z]``; ``dH/dz_j = p_j (E[z] - z_j)``; so
  ``a = -gL + gH E[z]``, ``b = -gH``, ``c = gL``, ``d = 0``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .options import LossOptions
from .targets import TokenTargets

__all__ = ["Coefficients", "ce_loss", "ce_coefficients", "logprob_outputs", "logprob_coefficients"]


class Coefficients(NamedTuple):
    """Per-row gradient coefficients; ``b`` and ``d`` are None where they are zero."""

    a: torch.Tensor
    b: torch.Tensor | None
    c: torch.Tensor
    d: torch.Tensor | None

    def rows(self, sl: slice) -> "Coefficients":
        return Coefficients(*(None if x is None else x[sl] for x in self))


def ce_loss(lse: torch.Tensor, zt: torch.Tensor, sum_z: torch.Tensor | None, opts: LossOptions,
            vocab_size: int) -> torch.Tensor:
    loss = lse - (1 - opts.label_smoothing) * zt
    if opts.label_smoothing:
        loss = loss - (opts.label_smoothing / vocab_size) * sum_z
    if opts.z_loss:
        loss = loss + opts.z_loss * lse * lse
    return loss


def ce_coefficients(scale: torch.Tensor, lse: torch.Tensor, opts: LossOptions, vocab_size: int) -> Coefficients:
    eps = opts.label_smoothing
    a = scale * (1 + 2 * opts.z_loss * lse) if opts.z_loss else scale
    d = scale * (-eps / vocab_size) if eps else None
    return Coefficients(a.contiguous(), None, (scale * -(1 - eps)).contiguous(), None if d is None else d.contiguous())


def logprob_outputs(tg: TokenTargets, lse: torch.Tensor, zt: torch.Tensor, mean_z: torch.Tensor | None):
    """Per-token ``(log p_t, entropy or None)``: 0 on ignored tokens, NaN on out-of-range targets."""
    everything = slice(None)
    ent = None if mean_z is None else tg.token_loss(lse - mean_z, everything)
    return tg.token_loss(zt - lse, everything), ent


def logprob_coefficients(tg: TokenTargets, g_logp: torch.Tensor | None, g_ent: torch.Tensor | None,
                         mean_z: torch.Tensor | None, inv_t: float, like: torch.Tensor) -> Coefficients:
    """Coefficients for upstream gradients on log p_t and the entropy (either may be None: unused). Ignored
    targets get zero coefficients; an out-of-range target poisons its row with NaN."""
    keep = tg.keep & ~tg.bad
    zero = torch.zeros_like(like)
    gl = zero if g_logp is None else torch.where(keep, g_logp.to(like.dtype), zero) * inv_t
    a, b = -gl, None
    if g_ent is not None and mean_z is not None:
        gh = torch.where(keep, g_ent.to(like.dtype), zero) * inv_t
        a, b = gh * mean_z - gl, -gh
    a = torch.where(tg.bad, float("nan"), a)
    return Coefficients(a.contiguous(), None if b is None else b.contiguous(), gl.contiguous(), None)
