"""Random test problems shared by the single-process and distributed tests."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Option sets that every backend must get exactly right, alone and combined.
VARIANTS = {
    "plain": {},
    "smooth": {"label_smoothing": 0.1},
    "zloss": {"z_loss": 1e-3},
    "softcap": {"softcap": 3.0},
    "all": {"label_smoothing": 0.2, "z_loss": 1e-2, "softcap": 5.0},
}


@dataclass
class Problem:
    hidden: torch.Tensor
    weight: torch.Tensor
    target: torch.Tensor
    bias: torch.Tensor | None
    grad: torch.Tensor
    vocab_size: int


def make_problem(n: int | tuple, d: int, rows: int, *, dtype=torch.float32, vocab_size=None, bias=False,
                 ignore_frac=0.0, scale=1.0, reduction="mean", seed=0, target_dtype=torch.int64) -> Problem:
    """Hidden ``[*n, d]``, weight ``[rows, d]``, targets in ``[0, vocab_size)`` with a fraction ignored.

    ``scale`` multiplies the logits' spread: 30 gives confident (peaked) softmaxes. ``grad`` is the
    upstream gradient to apply: a random per-token tensor for ``none``, a random scalar otherwise.
    """
    gen = torch.Generator().manual_seed(seed)
    shape = (n,) if isinstance(n, int) else tuple(n)
    v = rows if vocab_size is None else vocab_size
    hidden = torch.randn(*shape, d, generator=gen, dtype=torch.float64)
    weight = torch.randn(rows, d, generator=gen, dtype=torch.float64) * (scale / d**0.5)
    b = torch.randn(rows, generator=gen, dtype=torch.float64) * scale if bias else None
    target = torch.randint(0, v, shape, generator=gen)
    drop = torch.rand(shape, generator=gen) < ignore_frac
    target = torch.where(drop, torch.full_like(target, -100), target).to(target_dtype)
    grad = (torch.randn(shape, generator=gen, dtype=torch.float64) if reduction == "none"
            else torch.randn((), generator=gen, dtype=torch.float64) + 2.0)
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return Problem(cast(hidden), cast(weight), target, cast(b), grad, v)


def tie_problem(n, d, rows, *, dtype, vocab_size=None, seed=0, ignore_frac=0.2, bias=True) -> Problem:
    """Integer-valued hidden, weight and bias (``bias``; else none): the logits are small exact integers in every
    dtype and summation order, so ties are everywhere. Targets: a tied maximum (the lowest, the highest or a middle
    id of the tie) for most tokens, else random; some ignored."""
    gen = torch.Generator().manual_seed(seed)
    v = rows if vocab_size is None else vocab_size
    hidden = torch.randint(-1, 2, (n, d), generator=gen).double()
    weight = torch.randint(-1, 2, (rows, d), generator=gen).double()
    b = torch.randint(-1, 2, (rows,), generator=gen).double()
    z = hidden @ weight[:v].t() + (b[:v] if bias else 0.0)
    target = torch.randint(0, v, (n,), generator=gen)
    for i in range(n):
        tied = (z[i] == z[i].max()).nonzero().flatten()
        pick = int(torch.randint(0, 4, (), generator=gen))
        if pick < 3:
            target[i] = tied[[0, -1, len(tied) // 2][pick]]
    drop = torch.rand(n, generator=gen) < ignore_frac
    target = torch.where(drop, -100, target)
    grad = torch.randn((), generator=gen, dtype=torch.float64) + 2.0
    return Problem(hidden.to(dtype), weight.to(dtype), target, b.to(dtype) if bias else None, grad, v)


def leaf(x: torch.Tensor | None) -> torch.Tensor | None:
    return None if x is None else x.detach().clone().requires_grad_()


def stats_epilogue_stand_in(calls):
    """What ``vpce.backends.gemm.logits_with_stats`` computes (one quack GEMM with an epilogue on a GPU), in torch: P, the
    log-sum-exp of every logit as P holds it (capped and scaled), the target's raw fp32 logit (-inf where it is
    not in these columns)."""
    def run(p, h, w, t_local, zt, folded=None, sum_z=False, class_weight=None):
        softcap, inv_t = (None, 1.0) if folded is None else (folded.softcap, folded.inv_t)
        calls.append(tuple(p.shape))
        torch.mm(h, w.t(), out=p)
        capped = (lambda x: x) if softcap is None else (lambda x: inv_t * softcap * torch.tanh(x / softcap))  # noqa
        z = capped(p.float())
        here = t_local >= 0
        raw = (h.double() * w[t_local.clamp(min=0).long()].double()).sum(1).float()
        zt.copy_(torch.where(here, raw, -math.inf))
        sums = None
        if sum_z:  # every column's logit as P holds it, the target's too, times its class weight
            sums = (z * (1.0 if class_weight is None else class_weight.float())).sum(1)
        return torch.logsumexp(z, 1), sums
    return run
