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


def _float64_logits(hidden, weight, bias, softcap, vocab_size, logit_scale=1.0):
    """float64 leaves (h, w, b) and the (scaled, soft-capped) logits over the real vocab ``v`` (rows past it
    dropped)."""
    v = weight.shape[0] if vocab_size is None else vocab_size
    h = hidden.detach().double().requires_grad_()
    w = weight.detach().double().requires_grad_()
    b = None if bias is None else bias.detach().double().requires_grad_()
    z = F.linear(h, w[:v], None if b is None else b[:v])
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return h, w, b, z, v


def _reduce(per: torch.Tensor, tw: torch.Tensor, counted: torch.Tensor, keep: torch.Tensor, reduction: str):
    """Per-token losses times their token weights, 0 where not kept; ``mean`` divides by ``counted`` summed over
    the kept tokens (1 where that is 0)."""
    per = torch.where(keep, per * tw, torch.zeros_like(per))
    if reduction == "mean":
        den = torch.where(keep, counted, 0).sum()
        return per.sum() / (den if den != 0 else 1)
    return per.sum() if reduction == "sum" else per


def reference(hidden, weight, target, bias=None, *, grad=None, ignore_index=-100, reduction="mean",
              label_smoothing=0.0, z_loss=0.0, softcap=None, vocab_size=None, token_weight=None,
              logit_scale=1.0, class_weight=None, token_scaling=False) -> Result:
    """Loss and gradients in float64. ``weight`` is the whole vocab (padding rows allowed past vocab_size).

    ``grad`` is the upstream gradient of the returned loss (scalar or per-token); None means 1. ``class_weight``
    (``[rows]``, padding rows ignored) weights the loss as ``F.cross_entropy(weight=...)`` does, written out here:
    per token ``(1 - eps) w_t (-log p_t) + (eps / V) sum_c w_c (-log p_c) + z_loss w_t lse^2``, and ``mean``
    divides by the sum of ``w_t`` (times the token weights) over non-ignored tokens. ``token_scaling``
    multiplies each token's loss by its detached target probability (DFT).
    """
    h, w, b, z, v = _float64_logits(hidden, weight, bias, softcap, vocab_size, logit_scale)
    z = z.reshape(-1, v)
    t = target.reshape(-1).long()
    keep = t != ignore_index
    safe = torch.where(keep, t, 0)
    lse = torch.logsumexp(z, dim=-1)
    zt = z.gather(1, safe[:, None]).squeeze(1)
    tw = torch.ones_like(lse) if token_weight is None else token_weight.reshape(-1).double()
    if class_weight is None:
        per = lse - (1 - label_smoothing) * zt
        if label_smoothing:  # (a -inf logit makes the mean -inf: no 0 * inf where there is no smoothing)
            per = per - label_smoothing * z.mean(-1)
        if z_loss:
            per = per + z_loss * lse**2
        counted = tw
    else:
        cw = class_weight.detach().double()[:v]
        wt = cw[safe]
        per = (1 - label_smoothing) * wt * (lse - zt)
        if label_smoothing:
            per = per + label_smoothing / v * ((lse[:, None] - z) * cw).sum(-1)
        if z_loss:
            per = per + z_loss * wt * lse**2
        counted = tw * wt
    if token_scaling:
        per = per * torch.exp(zt - lse).detach()
    loss = _reduce(per, tw, counted, keep, reduction).reshape(target.shape if reduction == "none" else ())
    g = torch.ones_like(loss) if grad is None else grad.double().expand_as(loss)
    dh, dw, *db = torch.autograd.grad(loss, [h, w] + ([b] if b is not None else []), g, allow_unused=True)
    zero = lambda x, like: torch.zeros_like(like) if x is None else x  # noqa: E731
    return Result(loss.detach(), zero(dh, h), zero(dw, w), zero(db[0], b) if b is not None else None)


def torch_eager(hidden, weight, target, bias=None, *, grad=None, ignore_index=-100, reduction="mean",
                label_smoothing=0.0, z_loss=0.0, softcap=None, vocab_size=None, logit_scale=1.0,
                class_weight=None) -> Result:
    """What a user writes today, in the inputs' dtype: ``F.linear`` then fp32 cross-entropy. For error bars."""
    v = weight.shape[0] if vocab_size is None else vocab_size
    h = hidden.detach().clone().requires_grad_()
    w = weight.detach().clone().requires_grad_()
    b = None if bias is None else bias.detach().clone().requires_grad_()
    z = F.linear(h, w[:v], None if b is None else b[:v]).float()
    if logit_scale != 1.0:
        z = z * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    z = z.reshape(-1, v)
    t = target.reshape(-1).long()
    keep = t != ignore_index
    cw = None if class_weight is None else class_weight.to(z.device, torch.float32)[:v]
    per = F.cross_entropy(z, t, weight=cw, ignore_index=ignore_index, reduction="none",
                          label_smoothing=label_smoothing)
    wt = torch.ones_like(per) if cw is None else cw[torch.where(keep, t, 0)]
    if z_loss:
        per = per + torch.where(keep, z_loss * wt * torch.logsumexp(z, -1) ** 2, 0)
    if reduction == "mean":
        loss = per.sum() / torch.where(keep, wt, 0).sum().clamp(min=1e-30 if cw is not None else 1)
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


def reference_metrics(hidden, weight, target, bias=None, *, temperature=1.0, softcap=None, vocab_size=None,
                      ignore_index=-100, z_loss=0.0) -> dict[str, torch.Tensor]:
    """float64 per-token metrics of ``softmax(cap(logits) / T)`` on the materialized logits, target's shape, 0 on
    ignored tokens: ``z_loss`` (the term ``z_loss * lse^2``), ``top1`` (``torch.argmax`` of the logits equals the
    target: ties go to the lowest id), ``entropy``, ``mean_logits``, ``log_sum_sq_probs`` (``log sum_j p_j^2``) and
    ``p_t``."""
    _, _, _, z, v = _float64_logits(hidden, weight, bias, softcap, vocab_size)
    z = (z / temperature).detach()
    keep = target != ignore_index
    safe = torch.where(keep, target, 0).long()
    logq = torch.log_softmax(z, -1)
    lse = torch.logsumexp(z, -1)
    finite = torch.where(torch.isneginf(z), 0.0, z)
    out = {
        "z_loss": z_loss * lse**2,
        "top1": (z.argmax(-1) == safe).double(),
        "entropy": lse - (logq.exp() * finite).sum(-1),
        "mean_logits": z.mean(-1),
        "log_sum_sq_probs": torch.logsumexp(2 * logq, -1),
        "p_t": logq.gather(-1, safe[..., None]).squeeze(-1).exp(),
    }
    return {k: torch.where(keep, x, 0.0) for k, x in out.items()}


def reference_log_probs(hidden, weight, target, bias=None, *, g_logp=None, g_ent=None, temperature=1.0,
                        softcap=None, vocab_size=None, ignore_index=-100, logit_scale=1.0):
    """float64 per-token log p(target) and entropy of softmax(cap(logit_scale * logits) / T); gradients for upstream
    ``g_logp`` / ``g_ent`` (None: that output unused). Ignored tokens give 0 for both outputs."""
    h, w, b, z, v = _float64_logits(hidden, weight, bias, softcap, vocab_size, logit_scale)
    logq = torch.log_softmax(z / temperature, dim=-1)
    keep = target != ignore_index
    logp = torch.where(keep, logq.gather(-1, torch.where(keep, target, 0).long()[..., None]).squeeze(-1), 0)
    zt = z / temperature
    finite = torch.where(torch.isneginf(zt), 0.0, zt)  # p = 0 there: no 0 * inf, in forward or backward
    ent = torch.where(keep, torch.logsumexp(zt, -1) - (logq.exp() * finite).sum(-1), 0)
    total = 0
    if g_logp is not None:
        total = total + (logp * g_logp.double()).sum()
    if g_ent is not None:
        total = total + (ent * g_ent.double()).sum()
    dh, dw, *db = torch.autograd.grad(total, [h, w] + ([b] if b is not None else []))
    return logp.detach(), ent.detach(), Result(None, dh, dw, db[0] if b is not None else None)


def chunked_reference(hidden, weight, target, *, chunk_gib: float = 1.0, group=None, vocab_start: int = 0,
                      max_rows: int | None = None) -> Result:
    """Mean cross-entropy of ``hidden @ weight.T`` over the whole vocab and its gradients, in float64, in token
    chunks: for problems too large for ``reference`` (the benchmark's shapes). Plain cross-entropy only (no
    bias, none ignored); ``hidden`` ``[N, D]``, ``target`` ``[N]``.

    Never ``[N, V]`` at once: per chunk of ``C`` tokens (``C`` chosen so that ``[C, rows]`` float64 logits take
    ``chunk_gib``), the float64 logits, their softmax and its gradient; ``dW`` accumulated in float64. Peak: the
    float64 weight and ``dW`` plus about two ``[C, rows]`` float64 chunks.

    Under a ``group`` (``torch.distributed``), ``weight`` is this rank's rows ``[vocab_start, vocab_start + rows)``
    of the vocab: per chunk the logits' max is all-reduced (MAX), ``sum exp(z - max)`` and the target logit (0
    where another rank holds it) are all-reduced together (SUM), and this shard's part of ``dX`` is all-reduced
    (SUM, float64). ``max_rows`` (the largest shard's rows) makes every rank use the same chunk, so that the
    collectives line up. Returns the float64 loss, the complete ``dX`` and this shard's ``dW``, both stored in
    fp32 (their rounding, ~6e-8, is far below any error the benchmark measures); ``dbias`` is None.
    """
    import torch.distributed as dist

    n, d = hidden.shape
    rows = weight.shape[0]
    chunk = max(1, int(chunk_gib * 2**30) // (8 * (max_rows or rows)))
    wd = weight.double()
    dw = torch.zeros_like(wd)
    dx = torch.empty(n, d, dtype=torch.float32, device=hidden.device)
    loss = torch.zeros((), dtype=torch.float64, device=hidden.device)
    for c0 in range(0, n, chunk):
        sl = slice(c0, min(n, c0 + chunk))
        xd = hidden[sl].double()
        z = xd @ wd.t()
        m = z.amax(1)
        if group is not None:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        local = target[sl] - vocab_start
        owns = (local >= 0) & (local < rows)
        idx = local.clamp(0, rows - 1)[:, None]
        zt = torch.where(owns, z.gather(1, idx).squeeze(1), 0.0)
        g = z.sub_(m[:, None]).exp_()  # exp(z - m), in place
        sums = torch.stack([g.sum(1), zt])
        if group is not None:
            dist.all_reduce(sums, group=group)
        lse = m + torch.log(sums[0])
        loss += (lse - sums[1]).sum()
        g.mul_(torch.exp(m - lse)[:, None])  # exp(z - lse)
        g.scatter_add_(1, idx, -owns.to(g.dtype)[:, None])
        g.div_(n)
        dxc = g @ wd
        if group is not None:
            dist.all_reduce(dxc, group=group)
        dx[sl] = dxc.float()
        dw.addmm_(g.t(), xd)
        del z, g, xd, dxc
    return Result(loss / n, dx, dw.float(), None)


def _xlogratio(prob: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``prob * (a - b)``, 0 where ``prob`` is 0 (``a`` or ``b`` may then be ``-inf``)."""
    return torch.where(prob == 0, torch.zeros_like(prob), prob * (a - b))


def distillation_per_token(s: torch.Tensor, u: torch.Tensor, divergence: str, beta: float | None) -> torch.Tensor:
    """The per-token divergence from student and teacher log-probabilities ``s``, ``u`` ``[..., V]``, by the
    generalized JSD's definition (TRL's ``generalized_jsd_loss``): ``forward_kl`` KL(q || p), ``reverse_kl``
    KL(p || q), ``jsd`` ``beta KL(q || m) + (1 - beta) KL(p || m)`` with ``m = beta q + (1 - beta) p``, where beta
    0 and 1 are the forward and the reverse KL."""
    import math

    beta = 0.5 if beta is None else beta
    if divergence == "forward_kl" or (divergence == "jsd" and beta == 0):
        return _xlogratio(u.exp(), u, s).sum(-1)
    if divergence == "reverse_kl" or (divergence == "jsd" and beta == 1):
        return _xlogratio(s.exp(), s, u).sum(-1)
    log_m = torch.logsumexp(torch.stack([s + math.log(1 - beta), u + math.log(beta)]), dim=0)
    return beta * _xlogratio(u.exp(), u, log_m).sum(-1) + (1 - beta) * _xlogratio(s.exp(), s, log_m).sum(-1)


def reference_distillation(hidden, weight, teacher_hidden, teacher_weight, target=None, bias=None,
                           teacher_bias=None, *, grad=None, divergence="forward_kl", beta=None, temperature=1.0,
                           temperature_squared=False, ce_weight=0.0, ignore_index=-100, reduction="mean",
                           token_weight=None, softcap=None, teacher_softcap=None, vocab_size=None,
                           dtype=torch.float64) -> Result:
    """``vpce.linear_distillation_loss`` by its definition, dense, differentiated by autograd (student only).

    ``dtype`` float64 (default) is the oracle. A 16-bit or fp32 ``dtype`` computes what a user writes today in that
    dtype, for error bars: ``F.linear`` in the inputs' dtype, then the loss on the fp32 logits, with autograd's
    casts.
    """
    if dtype == torch.float64:
        h, w, b, z1, v = _float64_logits(hidden, weight, bias, softcap, vocab_size)
        _, _, _, y, _ = _float64_logits(teacher_hidden, teacher_weight, teacher_bias, teacher_softcap, vocab_size)
    else:
        v = weight.shape[0] if vocab_size is None else vocab_size
        h, w = (x.detach().clone().requires_grad_() for x in (hidden, weight))
        b = None if bias is None else bias.detach().clone().requires_grad_()
        z1 = F.linear(h, w[:v], None if b is None else b[:v]).float()
        y = F.linear(teacher_hidden, teacher_weight[:v],
                     None if teacher_bias is None else teacher_bias[:v]).float().detach()
        if softcap is not None:
            z1 = softcap * torch.tanh(z1 / softcap)
        if teacher_softcap is not None:
            y = teacher_softcap * torch.tanh(y / teacher_softcap)
    y = y.detach()
    s = torch.log_softmax(z1 / temperature, -1)
    u = torch.log_softmax(y / temperature, -1)
    per = distillation_per_token(s, u, divergence, beta)
    if temperature_squared:
        per = per * temperature**2
    lead = tuple(z1.shape[:-1])
    t = torch.zeros(lead, dtype=torch.int64, device=z1.device) if target is None else target.long()
    keep = torch.ones(lead, dtype=torch.bool, device=z1.device) if target is None else t != ignore_index
    if ce_weight:
        ce = F.cross_entropy(z1.reshape(-1, v), torch.where(keep, t, 0).reshape(-1), reduction="none")
        per = (1 - ce_weight) * per + ce_weight * ce.reshape(lead)
    tw = torch.ones_like(per) if token_weight is None else token_weight.to(per.dtype)
    loss = _reduce(per, tw, tw, keep, reduction)
    g = torch.ones_like(loss) if grad is None else grad.to(loss.dtype).expand_as(loss)
    dh, dw, *db = torch.autograd.grad(loss, [h, w] + ([b] if b is not None else []), g, allow_unused=True)
    zero = lambda x, like: torch.zeros_like(like) if x is None else x  # noqa: E731
    return Result(loss.detach(), zero(dh, h), zero(dw, w), zero(db[0], b) if b is not None else None)


def chunked_reference_distillation(hidden, weight, teacher_hidden, teacher_weight, *, divergence="forward_kl",
                                   beta=None, chunk_gib: float = 1.0, group=None,
                                   shard_rows: list[int] | None = None) -> Result:
    """Mean distillation loss of the student head ``hidden @ weight.T`` against the teacher head ``teacher_hidden
    @ teacher_weight.T`` over the whole vocab and the student's gradients, in float64, in token chunks: for
    problems too large for ``reference_distillation`` (the benchmark's ``--distill`` shapes). The divergence is
    ``distillation_per_token``'s (TRL's generalized JSD; beta the teacher's weight in the mixture), temperature 1,
    no bias, none ignored, the mean over all ``N`` tokens; ``hidden`` ``[N, D]``, ``teacher_hidden`` ``[N, D_T]``.

    Per chunk of ``C`` tokens (``C`` chosen so that one ``[C, V]`` float64 tensor takes ``chunk_gib``; about a
    dozen are live at once, autograd's for the JSD included): both heads' float64 logits, the per-token divergence
    by its definition, and its gradient with respect to the student's logits by autograd (so the hand-written
    gradients of vpce's backends are checked, not reused); then ``dX = G @ W`` and ``dW += G.T @ X`` in float64.

    Under a ``group`` (``torch.distributed``) ``weight`` and ``teacher_weight`` are this rank's contiguous rows of
    the vocab and ``shard_rows`` the rows of every rank's shard, in rank order: per chunk both heads' logits are
    all-gathered (padded to the largest shard) so that every rank forms the divergence over the whole vocab, and
    each rank keeps its own columns of the gradient; its part of ``dX`` is all-reduced (SUM, float64). Returns the
    float64 loss, the complete ``dX`` and this shard's ``dW``, both stored in fp32; ``dbias`` is None.
    """
    import torch.distributed as dist

    n, d = hidden.shape
    rows = weight.shape[0]
    if group is not None:
        rank = dist.get_rank(group)
        if shard_rows is None or len(shard_rows) != dist.get_world_size(group) or shard_rows[rank] != rows:
            raise ValueError(f"shard_rows: expected every rank's rows (this rank's {rows} at index {rank}), got "
                             f"{shard_rows}")
    v = rows if group is None else sum(shard_rows)
    start = 0 if group is None else sum(shard_rows[:rank])
    chunk = max(1, int(chunk_gib * 2**30) // (8 * v))
    wd, wtd = weight.double(), teacher_weight.double()
    dw = torch.zeros_like(wd)
    dx = torch.empty(n, d, dtype=torch.float32, device=hidden.device)
    loss = torch.zeros((), dtype=torch.float64, device=hidden.device)

    def whole_vocab(local: torch.Tensor) -> torch.Tensor:
        """``[C, V]`` from every rank's ``[C, rows_r]`` columns (rank order)."""
        if group is None:
            return local
        most = max(shard_rows)
        padded = local.new_zeros(local.shape[0], most)
        padded[:, :rows] = local
        every = [torch.empty_like(padded) for _ in shard_rows]
        dist.all_gather(every, padded, group=group)
        return torch.cat([part[:, :r] for part, r in zip(every, shard_rows)], dim=1)

    for c0 in range(0, n, chunk):
        sl = slice(c0, min(n, c0 + chunk))
        xd = hidden[sl].double()
        z = whole_vocab(xd @ wd.t()).requires_grad_()
        y = whole_vocab(teacher_hidden[sl].double() @ wtd.t())
        s, u = torch.log_softmax(z, -1), torch.log_softmax(y, -1)
        part = distillation_per_token(s, u, divergence, beta).sum()
        (g,) = torch.autograd.grad(part / n, z)
        loss += part.detach()
        g = g[:, start:start + rows]
        dxc = g @ wd
        if group is not None:
            dist.all_reduce(dxc, group=group)
        dx[sl] = dxc.float()
        dw.addmm_(g.t(), xd)
        del z, y, s, u, part, g, xd, dxc
    return Result(loss / n, dx, dw.float(), None)


# -- TRL 1.16's post-training losses, written out (tests/post_training/test_post_training.py, the bench's TRL rows) ---------------

def trl_grpo(logp, old, ref, adv, mask, ent, *, beta, eps_low, eps_high, delta, loss_type, level,
             max_completion_length, num_items_in_batch):
    """The loss and logged metrics of ``GRPOTrainer._compute_loss`` (one process, no accumulation)."""
    if adv.dim() == 1:
        adv = adv.unsqueeze(1)
    old = logp.detach() if old is None else old
    log_ratio = logp - old
    if level == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    if beta != 0.0:
        per_token_kl = torch.exp(ref - logp) - (ref - logp) - 1
    if loss_type == "cispo":
        per_token_loss = -torch.clamp(coef_1, max=eps_high).detach() * adv * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - eps_low, 1 + eps_high)
        if delta is not None:
            coef_1 = torch.clamp(coef_1, max=delta)
        per_token_loss = -torch.min(coef_1 * adv, coef_2 * adv)
    if beta != 0.0:
        per_token_loss = per_token_loss + beta * per_token_kl
    if loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif loss_type == "dr_grpo":
        loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * max_completion_length)
    else:
        loss = (per_token_loss * mask).sum() / torch.as_tensor(num_items_in_batch).clamp(min=1.0)

    def global_masked_mean(x):
        if x.shape[1] == 1:
            return x.sum() / x.shape[0]
        return (x * mask).sum() / mask.sum().clamp(min=1.0)

    kl = global_masked_mean(per_token_kl) if beta != 0.0 else None
    coef_1 = torch.exp(log_w)  # the metrics take the unclipped ratio
    if loss_type == "cispo":
        clip = global_masked_mean(((coef_1 > eps_high) & (adv > 0)).double())
    else:
        clip = global_masked_mean((((coef_1 < 1 - eps_low) & (adv < 0)) | ((coef_1 > 1 + eps_high) & (adv > 0)))
                                  .double())
    return loss, kl, clip, global_masked_mean(ent)


def trl_dpo(logp_tok, ref_c, ref_r, mask, beta, loss_type):
    logps = logp_tok.sum(1)
    chosen_logps, rejected_logps = logps.chunk(2, dim=0)
    chosen_scores, rejected_scores = chosen_logps - ref_c, rejected_logps - ref_r
    delta_score = chosen_scores - rejected_scores
    if loss_type == "sigmoid":
        per_sequence_loss = -F.logsigmoid(beta * delta_score)
    elif loss_type == "hinge":
        per_sequence_loss = torch.relu(1 - beta * delta_score)
    else:
        chosen_mask, rejected_mask = mask.chunk(2, dim=0)
        ipo_delta = chosen_scores / chosen_mask.sum(1).clamp(min=1.0) - rejected_scores / rejected_mask.sum(1).clamp(
            min=1.0)
        per_sequence_loss = (ipo_delta - 1 / (2 * beta)) ** 2
    return per_sequence_loss.mean(), beta * chosen_scores.detach(), beta * rejected_scores.detach()
