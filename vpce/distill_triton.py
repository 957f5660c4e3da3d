"""Triton backend of ``linear_distillation_loss``: cuBLAS writes both heads' chunk logits, bandwidth-bound Triton
kernels (``vpce.kernels``, the distillation section) read them. The formulas, the packed statistics and their
exchange are ``vpce.distill``'s, shared with the torch backend.

Fast route (``mean``/``sum`` with gradients), per chunk of ``C`` tokens:

1. cuBLAS writes the student's logits ``h W^T (+ b)`` and the teacher's ``h' W'^T (+ b')`` into two ``[C, V_local]``
   buffers in the inputs' dtype (``torch.mm(..., out=)``, the bias through ``addmm``);
2. ``kernels.distill_stats``: one pass over both buffers (soft caps and temperature applied on load, in fp32)
   writes per-(row, tile) statistics, then a per-row reduce over the tiles packs this shard's ``[R, C]``
   statistics exactly as the torch backend packs them; ``distill.exchange_chunk_stats`` exchanges and combines
   them (one all-gather under a group);
3. JSD only: ``kernels.distill_mixture``, a second pass over both buffers, gives this shard's ``[K_q, K_p]``, and
   the second all-gather (the same call of ``exchange_chunk_stats``);
4. ``kernels.distill_grad_`` overwrites the student's buffer with ``dL/dx`` at unit upstream scale;
5. cuBLAS: ``dX[chunk] = G @ W`` (fp32 out; under a group summed over the ranks asynchronously, under the dW GEMM
   and the next chunk: ``parallel.HiddenGradReduce``, as the cross-entropy's Triton fast route) and
   ``dW += G^T @ X[chunk]`` into an fp32 accumulator.

Under sequence parallelism the fast route gathers both heads' hidden slices itself: the student's first, then the
teacher's (the larger, at ``D_t``) beside the first chunk's student GEMM.

Backward scales the held fp32 gradients by the upstream gradient (``grads.finish_fast_grads``). Memory: the two
buffers (``FAST_GIB`` together by default, at most ``DW_SHARE`` times the fp32 dW accumulator's size: in bf16
chunks of at most 1.5 D tokens), their tile statistics, the fp32 dX and dW.

Lean route (``reduction="none"``, ``memory_budget="lean"``): forward is steps 1-3 over chunks of ``LEAN_GIB``,
keeping each token's ``DistillRows``. Backward recomputes both heads' logits block by block with cuBLAS and runs
the gradient kernel, in the order that holds the smaller fp32 accumulator (as the cross-entropy's
``triton_backend.recompute_grads``): vocab-major while ``N <= V_local`` (each ``[N, V_b]`` block's dW in one GEMM,
``dX`` summed over the blocks in fp32), token-major beyond (each token block's ``dX`` finished before the next,
``dW`` summed over the token blocks in fp32). The backward needs no exchange.

The logits are rounded to the inputs' dtype once, as ``F.linear`` rounds them in plain PyTorch; everything after
is fp32. No host syncs, no atomics: every kernel writes each output element from one program.
"""

from __future__ import annotations

import torch

from . import kernels
from .distill import KL_HEAD, DistillOptions, DistillRows, exchange_chunk_stats, heads, local_stats, row_weights, \
    rows_layout, token_loss
from .gemm import addmm_out_, logits_into, mm_into, mm_out
from .grads import FastGrads, add_block, pad_rows, written_rows
from .parallel import HiddenGradReduce, gather_sequence, start_gather_sequence
from .routing import Call
from .targets import TokenTargets

__all__ = ["distill_forward", "distill_recompute_grads", "scale_cast", "FAST_GIB", "LEAN_GIB"]

FAST_GIB = 1.5        # both logit buffers of the fast route together, ...
DW_SHARE = 1.5        # ... at most this times the fp32 dW accumulator's size (every chunk's dW GEMM reads and
                      # writes that accumulator: one H200, the JSD step 138.00 ms in 2048-token chunks against
                      # 134.94 ms in 3072-token chunks, docs/benchmarks.md, run baaeae5)
MIN_GIB = 0.25        # ... and their floor when that accumulator is small
LEAN_GIB = 0.4        # both buffers of the lean route's forward chunks and backward blocks
LEAN_TOKEN_BLOCK = 4096  # tokens per block of the lean backward's token-major order (N > V_local)
ROW_ALIGN = 128       # chunks of at least this many tokens are a multiple of it (GEMM tiles)

scale_cast = kernels.scale_cast

_KIND = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}    # the gradient kernel's divergence


def _chunk(gib: float, cols: int, dtype: torch.dtype) -> int:
    """Tokens whose two ``[C, cols]`` logit buffers fit ``gib``; equal on every rank (``cols`` is
    ``columns_per_rank``)."""
    c = max(1, int(gib * 2**30) // (2 * cols * torch.empty((), dtype=dtype).element_size()))
    return c - c % ROW_ALIGN if c >= ROW_ALIGN else c


def _budget(o: DistillOptions, fast: bool, cols: int, d: int) -> float:
    if isinstance(o.memory_budget, float):
        return o.memory_budget
    if fast:
        return min(FAST_GIB, max(MIN_GIB, DW_SHARE * cols * d * 4 / 2**30))
    return LEAN_GIB


def _buffer(numel: int, dtype, device) -> torch.Tensor | None:
    return torch.empty(numel, dtype=dtype, device=device) if numel else None


def _view(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous ``[rows, cols]`` view of the front of a flat buffer."""
    return buf[: rows * cols].view(rows, cols)


def _kernel_options(o: DistillOptions) -> dict:
    return dict(softcap=o.softcap, t_softcap=o.teacher_softcap, inv_t=o.inv_t)


def _chunk_stats(z, y, t_local, tg: TokenTargets, sl: slice, o: DistillOptions, call: Call):
    """The chunk's global ``DistillStats`` (``z`` None: this shard's rows are all padding); the exchanges are
    ``distill.exchange_chunk_stats``'s."""
    c = sl.stop - sl.start
    dev = tg.idx.device
    if z is None:
        packed = local_stats(None, None, tg, sl, o, c, torch.float32, dev)
    else:
        packed = torch.empty(rows_layout(o)[1], c, dtype=torch.float32, device=dev)
        kernels.distill_stats(z, y, t_local, packed, kl=KL_HEAD[o.kind], ce=o.ce_weight > 0, **_kernel_options(o))

    def mixture_sums(st):
        if z is None:
            return torch.zeros(2, c, dtype=torch.float32, device=dev)
        return kernels.distill_mixture(z, y, st.m_z, st.log_s_z, st.m_y, st.log_s_y, beta=o.beta,
                                       **_kernel_options(o))
    return exchange_chunk_stats(packed, mixture_sums, o, call, combine_heads=kernels.combine_distill_heads,
                                combine_ce=kernels.combine_rank_stats)


def _grad_(z, y, t_local, rows: DistillRows, kd, ce, o: DistillOptions):
    """``dL/dx`` over the student's logits ``z``, in place."""
    kernels.distill_grad_(z, y, z, t_local, rows, kd, ce, kind=_KIND[o.kind], beta=o.beta, **_kernel_options(o))


def distill_forward(hidden, weight, bias, t_hidden, t_weight, t_bias, tg: TokenTargets, o: DistillOptions,
                    call: Call):
    """Per-token loss ``[N]`` (weighted, 0 on ignored tokens), and what backward needs: the fast route's unscaled
    ``FastGrads`` (with ``dx_reduce == "forward"``: already summed over the group, this rank's slice under
    sequence parallelism), or the lean route's ``DistillRows``."""
    shard, plan, needs = call.shard, call.plan, call.needs_grad
    t_gather = None
    if plan.dx_reduce == "forward" and plan.sequence_parallel:  # both heads' slices gathered here
        hidden = gather_sequence(hidden.contiguous(), shard)
        t_gather = start_gather_sequence(t_hidden, shard)  # under the first chunk's student GEMM
    hidden = hidden.contiguous()
    if t_gather is None:
        t_hidden = t_hidden.contiguous()
    n, d = hidden.shape
    dev, dtype = hidden.device, hidden.dtype
    v = shard.valid_rows
    w, b, tw, tb = heads(weight, bias, t_weight, t_bias, v)
    fast, keep = plan.route == "fast", plan.route == "lean"
    chunk = min(max(n, 1), _chunk(_budget(o, fast, shard.columns_per_rank, d), shard.columns_per_rank, dtype))
    zbuf, ybuf = (_buffer(chunk * v if n else 0, dtype, dev) for _ in range(2))
    first = min(n, chunk) if v > 0 else 0  # the first chunk's GEMMs go first, the host's set-up runs beside them
    if first:
        logits_into(_view(zbuf, first, v), hidden[:first], w, b)
    if t_gather is not None:  # the teacher's slices, gathered beside the first student GEMM
        t_hidden = t_gather.wait()
    if first:
        logits_into(_view(ybuf, first, v), t_hidden[:first], tw, tb)
    t_local = tg.local_columns()
    loss_tok = torch.empty(n, dtype=torch.float32, device=dev)
    rows = DistillRows.empty(n, o, torch.float32, dev) if keep else None
    dx = dw = db = reduce_dx = None
    if fast:  # unit upstream scale; 1/count (mean) and the upstream gradient are applied in backward
        unit = tg.row_scale(torch.ones((), dtype=torch.float32, device=dev).expand(n))
        if needs[0]:  # an all-padding shard contributes zeros (and still joins the collectives)
            dx = (torch.empty if v > 0 else torch.zeros)(n, d, dtype=torch.float32, device=dev)
        if dx is not None and plan.dx_reduce == "forward":
            reduce_dx = HiddenGradReduce(dx, shard, plan.sequence_parallel)
        db = torch.zeros(v, dtype=torch.float32, device=dev) if needs[2] else None
    for c0 in range(0, n, chunk):
        sl = slice(c0, min(n, c0 + chunk))
        c = sl.stop - sl.start
        z = y = None
        if v > 0:
            z, y = _view(zbuf, c, v), _view(ybuf, c, v)
            if c0 > 0:
                logits_into(z, hidden[sl], w, b)
                logits_into(y, t_hidden[sl], tw, tb)
        st = _chunk_stats(z, y, t_local[sl], tg, sl, o, call)
        loss_tok[sl] = tg.token_loss(token_loss(st, o), sl)
        if keep:
            rows.store(sl, DistillRows.of(st, o))
        if not fast:
            continue
        if v > 0:
            kd, ce = row_weights(unit[sl], o)
            _grad_(z, y, t_local[sl], DistillRows.of(st, o), kd, ce, o)
            if dx is not None:
                mm_into(dx[sl], z, w)
        if reduce_dx is not None:  # overlaps this chunk's dW GEMM and the next chunk
            reduce_dx.add(sl)
        if v > 0 and needs[1]:
            dw = mm_out(z.t(), hidden[sl], torch.float32) if dw is None else addmm_out_(dw, z.t(), hidden[sl])
        if v > 0 and db is not None:
            db += z.sum(0, dtype=torch.float32)
    if not fast:
        return loss_tok, rows, None
    if needs[1] and dw is None:  # no chunk ran (no tokens, or an all-padding shard)
        dw = torch.zeros(v, d, dtype=torch.float32, device=dev)
    return loss_tok, None, FastGrads(dx, dw, db, reduce_dx)  # dX's sum awaited in backward, after dW's cast


def distill_recompute_grads(hidden, weight, bias, t_hidden, t_weight, t_bias, tg: TokenTargets, rows: DistillRows,
                            scale: torch.Tensor, o: DistillOptions, call: Call):
    """dX, dW, db from both heads' logits recomputed block by block (cuBLAS) and the gradient kernel, for per-token
    row scales ``scale``; vocab-major while ``N <= V_local``, token-major beyond (see the module docstring)."""
    hidden, t_hidden = hidden.contiguous(), t_hidden.contiguous()
    n, d = hidden.shape
    dev, dtype = hidden.device, hidden.dtype
    v, n_rows = call.shard.valid_rows, weight.shape[0]
    w, b, tw, tb = heads(weight, bias, t_weight, t_bias, v)
    need_dx, need_dw, need_db = call.needs_grad
    kd, ce = row_weights(scale, o)
    t_local = tg.local_columns()
    token_major = 0 < v < n
    nb = max(1, min(n, LEAN_TOKEN_BLOCK) if token_major else n)
    gib = o.memory_budget if isinstance(o.memory_budget, float) else LEAN_GIB
    bn = kernels.distill_block_align(hidden)
    per_col = 2 * nb * hidden.element_size()
    vb = max(bn, int(gib * 2**30) // per_col // bn * bn)
    vb = min(vb, max(v, 1))
    zbuf, ybuf = (_buffer(nb * vb if n and v else 0, dtype, dev) for _ in range(2))
    db = torch.zeros(n_rows, dtype=torch.float32, device=dev) if need_db and bias is not None else None
    dx = dw = dx_acc = None
    if token_major:
        if need_dx:
            dx = torch.empty(n, d, dtype=dtype, device=dev)
            dx_acc = torch.empty(nb, d, dtype=torch.float32, device=dev) if v > vb else None
        if need_dw:
            dw = torch.zeros(n_rows, d, dtype=torch.float32, device=dev)
    else:
        dx = written_rows(n, d, n if v else 0, torch.float32, dev) if need_dx else None
        dw = written_rows(n_rows, d, v if n else 0, dtype, dev) if need_dw else None
    for n0 in range(0, n if v else 0, nb):
        n1 = min(n, n0 + nb)
        tok = slice(n0, n1)
        h = hidden[tok]
        block_rows = rows.rows(tok)
        for v0 in range(0, v, vb):
            v1 = min(v, v0 + vb)
            z, y = _view(zbuf, n1 - n0, v1 - v0), _view(ybuf, n1 - n0, v1 - v0)
            logits_into(z, h, w[v0:v1], None if b is None else b[v0:v1])
            logits_into(y, t_hidden[tok], tw[v0:v1], None if tb is None else tb[v0:v1])
            _grad_(z, y, t_local[tok] - v0, block_rows, kd[tok], None if ce is None else ce[tok], o)
            add_block(z, h, w[v0:v1], slice(v0, v1), tok, dx=dx, dx_acc=dx_acc, dw=dw, db=db,
                      token_major=token_major)
        if dx_acc is not None and dx is not None:
            dx[tok] = dx_acc[: n1 - n0]
    if dx is not None and dx.dtype != dtype:
        dx = dx.to(dtype)
    if dw is not None and dw.dtype != dtype:
        dw = dw.to(dtype)
    return dx, dw, pad_rows(db, n_rows, dtype)

