"""The scaled-exponential route (``vpce.gemm.ScaledExps``, ``vpce.kernels.scaled_exp``): the gradient held as
``diag(v) (u ⊙ E)`` and read by quack's A-operand transforms.

* Its two kernels against float64 on any device (fp32 buffers: the interpreter has no bf16): the log-sum-exp
  from the groups' statistics, and the factors that turn ``E`` into the gradient, on wide rows, confident tokens,
  targets far below the row's max, rows whose mass sits in one block, targets on another rank and zero rows.
* On an sm_90 GPU with the hopper extra: the GEMMs (statistics epilogue, transformed dX and dW) against float64.
* On two such GPUs (NCCL, tp=2): the route is taken at a size where every token's gradient is one ``P``, and the
  loss and gradients are no worse than torch eager's against float64, confident, ignored and far-off tokens among
  them; a soft cap keeps the gradient pass.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from distributed import run_ranks
from vpce import kernels
from vpce.reference import reference, rel_err, torch_eager

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
GPUS = torch.cuda.device_count() if CUDA else 0


def _groups(z: torch.Tensor, group: int):
    """What the statistics epilogue writes for float64 logits ``z``: ``kk`` and ``sum_exp`` per group, and ``E``."""
    c, v = z.shape
    kk = (z.view(c, -1, group).amax(-1) / math.log(2)).round()
    e = torch.exp2(z / math.log(2) - kk.repeat_interleave(group, 1))
    return kk, e.view(c, -1, group).sum(-1), e


def _rows(c: int, v: int, seed: int = 0):
    """Float64 logits and targets with the hard cases in the first rows."""
    gen = torch.Generator().manual_seed(seed)
    z = torch.randn(c, v, generator=gen, dtype=torch.float64) * 3
    t = torch.randint(0, v, (c,), generator=gen)
    z[0] *= 40  # a wide row: groups hundreds of powers of two apart
    z[1, 7], t[1] = 30.0, 7  # confident: 1 - p_t about 1e-10
    t[2] = int(z[2].argmin())  # the target far below the row's max
    z[3] -= 200
    z[3, 70:134] += 200  # the mass in one block
    t[3] = 3
    z[8], t[8] = z[8] * 60, int((z[8] * 60).argmin())  # a target about 600 nats below the max
    return z, t


@pytest.mark.parametrize("group", [192, 128])
def test_lse_and_gradient_factors_against_float64(group):
    c, v = 37, group * 5
    z, t = _rows(c, v)
    kk, se, e = _groups(z, group)
    lse = kernels.scaled_exp_lse(kk.float().to(DEV), se.float().to(DEV)).cpu().double()
    want = torch.logsumexp(z, 1)
    assert ((lse - want).abs() / want.abs().clamp(min=1)).max() < 2e-7

    t_local = t.clone()
    t_local[4] = t_local[5] = -1  # the target on another rank
    gen = torch.Generator().manual_seed(1)
    a = torch.rand(c, generator=gen, dtype=torch.float64) + 0.5
    a[6] = 0.0  # an ignored token
    a[7] = -a[7]  # a negative row factor (a negative upstream weight)
    p = torch.softmax(z, 1)
    q = p.scatter(1, t[:, None], 0.0).sum(1)  # 1 - p_t without cancellation
    want_g = a[:, None] * p
    here = t_local >= 0
    want_g[here, t[here]] = -a[here] * q[here]

    e32 = e.float().to(DEV)
    strip = torch.full((v // 64, c), float("nan"), device=DEV)
    wide = torch.full((v // 64, c + 11), 7.0, device=DEV)
    v_out = torch.empty(c, device=DEV)
    kernels.scaled_exp_grad(e32, kk.float().to(DEV), t_local.to(DEV), want.float().to(DEV), q.float().to(DEV),
                            a.float().to(DEV), strip, v_out, group, strip2=wide[:, 5:5 + c])
    assert torch.equal(wide[:, 5:5 + c], strip) and (wide[:, :5] == 7).all() and (wide[:, 5 + c:] == 7).all()
    assert torch.isfinite(e32).all() and torch.isfinite(strip).all()
    # every strip entry a power of two (or 0: below the route's resolution)
    s = strip[strip != 0].cpu().double()
    assert torch.equal(torch.exp2(torch.log2(s).round()), s)
    got = v_out.cpu().double()[:, None] * strip.t().cpu().double().repeat_interleave(64, 1) * e32.cpu().double()
    scale = want_g.abs().amax(1, keepdim=True).clamp(min=1e-300)
    err = ((got - want_g).abs() / scale).amax(1)
    # the fp32 lse given carries half an ulp of |lse|: p's relative error
    assert (err <= 2e-6 + 4 * want.abs() * 2 ** -24).all(), err
    # the target's own entry to its relative precision, the confident and far-off ones included
    rows = torch.arange(c)[here & (a != 0)]
    rel = ((got[rows, t[rows]] - want_g[rows, t[rows]]).abs() / want_g[rows, t[rows]].abs()).max()
    assert rel < 1e-5, rel
    assert (got[6] == 0).all()


def _hopper(gpus: int = 1) -> bool:
    if GPUS < gpus or torch.cuda.get_device_capability(0)[0] != 9:
        return False
    from vpce import gemm

    return gemm._quack() is not None and gemm._scaled_exp_mods() is not None


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU and the hopper extra with A-operand transforms")
def test_gpu_gemms_against_float64():
    """``scaled_exps``' E and statistics, then ``ScaledExps``' dX (fp32 and bf16) and dW: within bf16 rounding of
    float64 (each entry rounded once, as torch's own gradient is)."""
    from vpce import gemm

    gen = torch.Generator().manual_seed(3)
    c, v, d = 512, 1536, 256
    h = (torch.randn(c, d, generator=gen) * 0.5).to(torch.bfloat16)
    w = (torch.randn(v, d, generator=gen) / d ** 0.5).to(torch.bfloat16)
    t = torch.randint(0, v, (c,), generator=gen)
    t_local = torch.where(torch.arange(c) % 5 == 0, -1, t)
    z = h.double() @ w.double().t()
    hd, wd = h.cuda(), w.cuda()
    e = torch.empty(c, v, dtype=torch.bfloat16, device="cuda")
    groups = v // gemm.SCALED_EXP_GROUP
    kk, se = torch.empty(c, groups, device="cuda"), torch.empty(c, groups, device="cuda")
    zt = torch.empty(c, device="cuda")
    gemm.scaled_exps(e, hd, wd, t_local.cuda(), zt, kk, se)
    want_kk, _, _ = _groups(z, gemm.SCALED_EXP_GROUP)
    k = kk.cpu().double()
    assert (k - want_kk).abs().max() <= 1 and torch.equal(k, k.round())  # fp32 and float64 maxima may round apart
    want_e = torch.exp2(z / math.log(2) - k.repeat_interleave(gemm.SCALED_EXP_GROUP, 1))
    assert rel_err(se, want_e.view(c, groups, -1).sum(-1)) < 1e-5 and rel_err(e, want_e) < 2 ** -8
    here = t_local >= 0
    assert rel_err(zt[here.cuda()], z[here, t_local[here]]) < 1e-6 and (zt[~here.cuda()] == -math.inf).all()

    lse = kernels.scaled_exp_lse(kk, se)
    want_lse = torch.logsumexp(z, 1)
    p = torch.softmax(z, 1)
    q = p.scatter(1, t[:, None], 0.0).sum(1)
    a = torch.rand(c, generator=gen, dtype=torch.float64) + 0.5
    strip = torch.empty(v // 64, c, dtype=torch.bfloat16, device="cuda")
    v_out = torch.empty(c, device="cuda")
    kernels.scaled_exp_grad(e, kk, t_local.cuda(), lse, q.float().cuda(), a.float().cuda(), strip, v_out,
                            gemm.SCALED_EXP_GROUP)
    g = a[:, None] * p
    g[here, t[here]] = -a[here] * q[here]
    held = gemm.ScaledExps(e, strip, v_out)
    for dtype in (torch.float32, torch.bfloat16):
        dx = held.hidden_grad_into(torch.empty(c, d, dtype=dtype, device="cuda"), wd)
        want = g @ w.double()
        eager = (g.to(torch.bfloat16).cuda() @ wd).double().cpu()  # torch's own: G rounded once, a bf16 GEMM
        assert rel_err(dx, want) <= max(1.5 * rel_err(eager, want), 2 ** -9), (dtype, rel_err(dx, want))
    scale = torch.tensor(0.75, device="cuda")
    for dtype, s in ((torch.bfloat16, scale), (torch.float32, None)):
        dw = held.weight_grad(hd, s, dtype)
        want = g.t() @ h.double() * (0.75 if s is not None else 1.0)
        eager = ((g.to(torch.bfloat16).cuda().t() @ hd).double() * (0.75 if s is not None else 1.0)).cpu()
        assert dw.dtype == dtype and rel_err(dw, want) <= max(1.5 * rel_err(eager, want), 2 ** -9), (dtype, rel_err(dw, want))


def _tp_main(rank, world, softcap):
    """Llama-like shapes at tp=2 scaled down: 384 columns per group-and-tile multiple, chunks of 1024 tokens of
    2048, so that every token's gradient is one ``P`` (``routing.one_weight_grad_gemm``). Returns the errors of
    vpce and of torch eager against float64, and which route ran."""
    import torch.distributed as dist

    import vpce
    import vpce.triton_backend as tb
    from vpce import routing

    n, d, vocab = 2048, 512, 2 * 3840
    rows = vocab // world
    gib = 1024 * rows * 2 / 2**30
    routing.SIZING = dataclasses.replace(routing.SIZING, fast_p_gib=gib, min_p_gib=gib)
    seen = []
    real = tb.scaled_exps
    tb.scaled_exps = lambda *a: seen.append(a[0].shape) or real(*a)
    gen = torch.Generator().manual_seed(7)
    h = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w = torch.randn(vocab, d, generator=gen, dtype=torch.float64) / d ** 0.5
    t = torch.randint(0, vocab, (n,), generator=gen)
    t[::9] = -100  # ignored
    h[1::9] = 12 * w[t[1::9]]  # confident
    far = torch.arange(2, n, 9)
    t[far] = (h[far] @ w.t()).argmin(1)  # the least likely token
    tw = torch.rand(n, generator=gen, dtype=torch.float64) + 0.5  # token weights
    h16, w16 = h.to(torch.bfloat16), w.to(torch.bfloat16)
    dev = torch.device("cuda", rank)
    hl = h16.to(dev).requires_grad_()
    wl = w16[rank * rows:(rank + 1) * rows].to(dev).requires_grad_()
    opts = dict(softcap=softcap) if softcap else {}
    loss = vpce.linear_cross_entropy(hl, wl, t.to(dev), group=dist.group.WORLD, vocab_start=rank * rows,
                                     vocab_size=vocab, token_weight=tw.to(dev, torch.float32), backend="triton",
                                     **opts)
    loss.backward()
    ref = reference(h16.double(), w16.double(), t, token_weight=tw, **opts)
    eager = torch_eager(h16.to(dev), w16.to(dev), t.to(dev), **opts)  # no token weights: its error scale only
    ref_plain = reference(h16.double(), w16.double(), t, **opts)
    mine = dict(loss=rel_err(loss, ref.loss), dx=rel_err(hl.grad, ref.dhidden),
                dw=rel_err(wl.grad, ref.dweight[rank * rows:(rank + 1) * rows]))
    theirs = dict(loss=rel_err(eager.loss, ref_plain.loss), dx=rel_err(eager.dhidden, ref_plain.dhidden),
                  dw=rel_err(eager.dweight, ref_plain.dweight))
    return mine, theirs, seen


@pytest.mark.skipif(not _hopper(2), reason="needs 2 sm_90 GPUs and the hopper extra with A-operand transforms")
@pytest.mark.parametrize("softcap", [None, 30.0], ids=["plain", "softcap"])
def test_nccl_tp2_route_against_float64(softcap):
    for rank, (mine, theirs, seen) in enumerate(run_ranks(_tp_main, 2, softcap, backend="nccl")):
        # the plain loss takes the route (one statistics GEMM per chunk), the soft cap keeps the gradient pass
        assert seen == ([] if softcap else [torch.Size([1024, 3840])] * 2), (rank, seen)
        assert mine["loss"] <= 1e-5, (rank, mine)
        for key in ("dx", "dw"):
            assert mine[key] <= max(1.25 * theirs[key], 2 ** -9), (rank, key, mine, theirs)
