"""The Triton backend's distillation (``distill_forward``, ``distill_recompute_grads``;
``vpce.formulas.distill``), on the engine's loops (``vpce.backends.triton.engine``):
cuBLAS writes both heads' chunk logits, bandwidth-bound Triton kernels (``vpce.kernels.distill``) read
them. The formulas, the packed statistics and their exchange are ``vpce.formulas.distill``', shared with
the torch backend.

Fast route (``mean``/``sum`` with gradients), per chunk of ``C`` tokens:

1. cuBLAS writes the student's logits ``h W^T (+ b)`` and the teacher's ``h' W'^T (+ b')`` into two ``[C, V_local]``
   buffers in the inputs' dtype (``torch.mm(..., out=)``, the bias through ``addmm``);
2. ``kernels.distill_stats``: one pass over both buffers (soft caps and temperature applied on load, in fp32)
   writes per-(row, tile) statistics, then a per-row reduce over the tiles packs this shard's ``[R, C]``
   statistics exactly as the torch backend packs them; ``formulas.distill.exchange_chunk_stats`` exchanges and combines
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
buffers (``routing.Sizing.distill_fast_gib`` together by default, at most ``distill_dw_share`` times the fp32 dW
accumulator's size: in bf16 chunks of at most 1.5 D tokens), their tile statistics, the fp32 dX and dW.

Lean route (``reduction="none"``, ``memory_budget="lean"``): forward is steps 1-3 over chunks of
``routing.Sizing.distill_lean_gib``, keeping each token's ``DistillRows``. Backward recomputes both heads' logits block
by block with cuBLAS and runs the gradient kernel, in the cross-entropy's block loop (``engine.block_loop``), in the
order that holds the smaller fp32 accumulator: vocab-major while ``N <= V_local`` (each ``[N, V_b]`` block's dW in one
GEMM, ``dX`` summed over the blocks in fp32), token-major beyond (each token block's ``dX`` finished before the next,
``dW`` summed over the token blocks in fp32). The backward needs no exchange.
The logits are rounded to the inputs' dtype once, as ``F.linear`` rounds them in plain PyTorch; everything after
is fp32. No host syncs, no atomics: every kernel writes each output element from one program.
"""

from __future__ import annotations

import torch

from ... import kernels
from ...formulas.distill import KL_HEAD, DistillRows, exchange_chunk_stats, heads, local_stats, row_weights, \
    rows_layout, token_loss
from ...options import DistillOptions
from ...parallel import gather_sequence, start_gather_sequence
from ...routing import Call
from ...targets import TokenTargets
from ..gemm import logits_into
from .engine import block_loop, buffer_view, chunk_loop, flat_buffer

__all__ = ["distill_forward", "distill_recompute_grads"]


_KIND = {"forward_kl": 0, "reverse_kl": 1, "jsd": 2}    # the gradient kernel's divergence


def _distill_kernel_options(o: DistillOptions) -> dict:
    return dict(student=o.student, teacher=o.teacher)


def _distill_chunk_stats(z, y, t_local, tg: TokenTargets, sl: slice, o: DistillOptions, call: Call):
    """The chunk's global ``DistillStats`` (``z`` None: this shard's rows are all padding); the exchanges are
    ``distill.exchange_chunk_stats``'s."""
    c = sl.stop - sl.start
    dev = tg.idx.device
    if z is None:
        packed = local_stats(None, None, tg, sl, o, c, torch.float32, dev)
    else:
        packed = torch.empty(rows_layout(o)[1], c, dtype=torch.float32, device=dev)
        kernels.distill_stats(z, y, t_local, packed, kl=KL_HEAD[o.kind], ce=o.ce_weight > 0,
                              **_distill_kernel_options(o))

    def mixture_sums(st):
        if z is None:
            return torch.zeros(2, c, dtype=torch.float32, device=dev)
        return kernels.distill_mixture(z, y, st.m_z, st.log_s_z, st.m_y, st.log_s_y, beta=o.beta,
                                       **_distill_kernel_options(o))
    return exchange_chunk_stats(packed, mixture_sums, o, call, combine_heads=kernels.combine_distill_heads,
                                combine_ce=kernels.combine_rank_stats)


def _distill_grad_(z, y, t_local, rows: DistillRows, kd, ce, o: DistillOptions):
    """``dL/dx`` over the student's logits ``z``, in place."""
    kernels.distill_grad_(z, y, z, t_local, rows, kd, ce, kind=_KIND[o.kind], beta=o.beta, **_distill_kernel_options(o))


def distill_forward(hidden, weight, bias, t_hidden, t_weight, t_bias, tg: TokenTargets, o: DistillOptions,
                    call: Call):
    """Per-token loss ``[N]`` (weighted, 0 on ignored tokens), and what backward needs: the fast route's unscaled
    ``FastGrads`` (with ``dx_reduce == "forward"``: already summed over the group, this rank's slice under
    sequence parallelism), or the lean route's ``DistillRows``."""
    shard, plan = call.shard, call.plan
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
    chunk = min(max(n, 1), plan.sizes.chunk)
    zbuf, ybuf = (flat_buffer(chunk * v if n else 0, dtype, dev) for _ in range(2))
    first = min(n, chunk) if v > 0 else 0  # the first chunk's GEMMs go first, the host's set-up runs beside them
    if first:
        logits_into(buffer_view(zbuf, first, v), hidden[:first], w, b)
    if t_gather is not None:  # the teacher's slices, gathered beside the first student GEMM
        t_hidden = t_gather.wait()
    if first:
        logits_into(buffer_view(ybuf, first, v), t_hidden[:first], tw, tb)
    t_local = tg.local_columns()
    loss_tok = torch.empty(n, dtype=torch.float32, device=dev)
    rows = DistillRows.empty(n, o, torch.float32, dev) if keep else None
    unit = None
    if fast:  # unit upstream scale; 1/count (mean) and the upstream gradient are applied in backward
        unit = tg.row_scale(torch.ones((), dtype=torch.float32, device=dev).expand(n))

    def step(sl: slice, first: bool):
        """The distillation's chunk step: both heads' logits (the first chunk's already written), the statistics
        and the loss, the lean route's rows; on the fast route the gradient over the student's logits."""
        c = sl.stop - sl.start
        z = y = None
        if v > 0:
            z, y = buffer_view(zbuf, c, v), buffer_view(ybuf, c, v)
            if not first:
                logits_into(z, hidden[sl], w, b)
                logits_into(y, t_hidden[sl], tw, tb)
        st = _distill_chunk_stats(z, y, t_local[sl], tg, sl, o, call)
        loss_tok[sl] = tg.token_loss(token_loss(st, o), sl)
        if keep:
            rows.store(sl, DistillRows.of(st, o))
        if fast and v > 0:
            kd, ce = row_weights(unit[sl], o)
            _distill_grad_(z, y, t_local[sl], DistillRows.of(st, o), kd, ce, o)
        return z
    return loss_tok, rows, chunk_loop(hidden, w, b, chunk, call, step, form=fast)


class _DistillBlocks:
    """The distillation's block step: cuBLAS recomputes both heads' logits of a block into two flat buffers, and
    ``kernels.distill_grad_`` writes the gradient over the student's for the per-row weights ``kd``, ``ce``."""

    buffers = 2

    def __init__(self, hidden, t_hidden, w, b, tw, tb, tg: TokenTargets, rows: DistillRows, scale, o: DistillOptions):
        self.hidden, self.t_hidden, self.w, self.b, self.tw, self.tb = hidden, t_hidden, w, b, tw, tb
        self.rows, self.o = rows, o
        self.kd, self.ce = row_weights(scale, o)
        self.t_local = tg.local_columns()
        self.align = kernels.distill_block_align(hidden)

    def alloc(self, nb, vb, n, v):
        self.zbuf, self.ybuf = (flat_buffer(nb * vb if n and v else 0, self.hidden.dtype, self.hidden.device)
                                for _ in range(2))

    def tokens(self, tok):
        return self.rows.rows(tok)

    def block(self, h, tok, rows, v0, v1):
        rows_b, cols_b = tok.stop - tok.start, v1 - v0
        z, y = buffer_view(self.zbuf, rows_b, cols_b), buffer_view(self.ybuf, rows_b, cols_b)
        logits_into(z, h, self.w[v0:v1], None if self.b is None else self.b[v0:v1])
        logits_into(y, self.t_hidden[tok], self.tw[v0:v1], None if self.tb is None else self.tb[v0:v1])
        _distill_grad_(z, y, self.t_local[tok] - v0, rows, self.kd[tok], None if self.ce is None else self.ce[tok],
                       self.o)
        return z


def distill_recompute_grads(hidden, weight, bias, t_hidden, t_weight, t_bias, tg: TokenTargets, rows: DistillRows,
                            scale: torch.Tensor, o: DistillOptions, call: Call):
    """dX, dW, db from both heads' logits recomputed block by block (cuBLAS) and the gradient kernel, for per-token
    row scales ``scale``; the lean block loop (``engine.block_loop``): vocab-major while ``N <= V_local``, token-major
    beyond."""
    hidden, t_hidden = hidden.contiguous(), t_hidden.contiguous()
    w, b, tw, tb = heads(weight, bias, t_weight, t_bias, call.shard.valid_rows)
    step = _DistillBlocks(hidden, t_hidden, w, b, tw, tb, tg, rows, scale, o)
    return block_loop(hidden, weight, bias, call, step)
