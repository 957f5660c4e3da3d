"""The float64 reference (one place): dense logits over the whole (unsharded) vocab, plain autograd. Deliberately naive.

Independent of vpce's chunked backend: it materializes ``[N, V]`` in float64 and differentiates with torch's
autograd, so it checks both the forward formulas and the hand-written gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class Result:
    loss: torch.Tensor
    dhidden: torch.Tensor | None
    dweight: torch.Tensor | None
    dbias: torch.Tensor | None


def _float64_logits(hidden, weight, bias, softcap, vocab_size):
    """float64 leaves (h, w, b) and the (soft-capped) logits over the real vocab ``v`` (rows past it dropped)."""
    v = weight.shape[0] if vocab_size is None else vocab_size
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    z = F.linear(h, w[:v], None if b is None else b[:v])
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return h, w, b, z, v


def reference(hidden, weight, target, bias=None, *, grad=None, ignore_index=-100, reduction="mean",
              label_smoothing=0.0, z_loss=0.0, softcap=None, vocab_size=None, token_weight=None) -> Result:
    """Loss and gradients in float64. ``weight`` is the whole vocab (padding rows allowed past vocab_size).

    ``grad`` is the upstream gradient of the returned loss (scalar or per-token); None means 1.
    """
    h, w, b, z, v = _float64_logits(hidden, weight, bias, softcap, vocab_size)
    z = z.reshape(-1, v)
    t = target.reshape(-1).long()
    keep = t != ignore_index
    safe = torch.where(keep, t, 0)
    lse = torch.logsumexp(z, dim=-1)
    zt = z.gather(1, safe[:, None]).squeeze(1)
    per = lse - (1 - label_smoothing) * zt - label_smoothing * z.mean(-1) + z_loss * lse**2
    tw = torch.ones_like(per) if token_weight is None else token_weight.reshape(-1).double()
    per = torch.where(keep, per * tw, torch.zeros_like(per))
    if reduction == "mean":
        den = torch.where(keep, tw, 0).sum()
        loss = per.sum() / (den if den != 0 else 1)
    elif reduction == "sum":
        loss = per.sum()
    else:
        loss = per.reshape(target.shape)
    g = torch.ones_like(loss) if grad is None else grad.double().expand_as(loss)
    dh, dw, *db = torch.autograd.grad(loss, [h, w] + ([b] if b is not None else []), g, allow_unused=True)
    zero = lambda x, like: torch.zeros_like(like) if x is None else x  # noqa: E731
    return Result(loss.detach(), zero(dh, h), zero(dw, w), zero(db[0], b) if b is not None else None)


def torch_eager(hidden, weight, target, bias=None, *, grad=None, ignore_index=-100, reduction="mean",
                label_smoothing=0.0, z_loss=0.0, softcap=None, vocab_size=None) -> Result:
    """What a user writes today, in the inputs' dtype: ``F.linear`` then fp32 cross-entropy. For error bars."""
    v = weight.shape[0] if vocab_size is None else vocab_size
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    z = F.linear(h, w[:v], None if b is None else b[:v]).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z.reshape(-1, v)
    t = target.reshape(-1).long()
    keep = t != ignore_index
    per = F.cross_entropy(z, t, ignore_index=ignore_index, reduction="none", label_smoothing=label_smoothing)
    if z_loss:
        per = per + torch.where(keep, z_loss * torch.logsumexp(z, -1) ** 2, 0)
    if reduction == "mean":
        loss = per.sum() / keep.sum().clamp(min=1)
    elif reduction == "sum":
        loss = per.sum()
    else:
        loss = per.reshape(target.shape)
    g = torch.ones_like(loss) if grad is None else grad.float().expand_as(loss)
    dh, dw, *db = torch.autograd.grad(loss, [h, w] + ([b] if b is not None else []), g)
    return Result(loss.detach(), dh, dw, db[0] if b is not None else None)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """``|a - b| / |b|`` in float64; NaN anywhere gives inf; two zero tensors give 0."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    if a.shape != b.shape:
        raise AssertionError(f"shape {tuple(a.shape)} != {tuple(b.shape)}")
    if not torch.isfinite(a).all():
        return float("inf")
    num, den = (a - b).norm().item(), b.norm().item()
    return num / den if den > 0 else num


def describe(a: torch.Tensor, b: torch.Tensor) -> str:
    """Max abs error and where, for failure messages."""
    d = (a.detach().double().cpu() - b.detach().double().cpu()).abs()
    if d.numel() == 0:
        return "empty"
    i = int(d.reshape(-1).argmax())
    idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), d.shape)) if d.dim() else ()
    return f"max abs err {d.reshape(-1)[i].item():.3e} at {idx}"


def reference_log_probs(hidden, weight, target, bias=None, *, g_logp=None, g_ent=None, temperature=1.0,
                        softcap=None, vocab_size=None, ignore_index=-100):
    """float64 per-token log p(target) and entropy of softmax(cap(logits) / T); gradients for upstream
    ``g_logp`` / ``g_ent`` (None: that output unused). Ignored tokens give 0 for both outputs."""
    h, w, b, z, v = _float64_logits(hidden, weight, bias, softcap, vocab_size)
    logq = torch.log_softmax(z / temperature, dim=-1)
    keep = target != ignore_index
    logp = torch.where(keep, logq.gather(-1, torch.where(keep, target, 0).long()[..., None]).squeeze(-1), 0)
    ent = torch.where(keep, -(logq.exp() * logq).sum(-1), 0)
    total = 0
    if g_logp is not None:
        total = total + (logp * g_logp.double()).sum()
    if g_ent is not None:
        total = total + (ent * g_ent.double()).sum()
    dh, dw, *db = torch.autograd.grad(total, [h, w] + ([b] if b is not None else []))
    return logp.detach(), ent.detach(), Result(None, dh, dw, db[0] if b is not None else None)
