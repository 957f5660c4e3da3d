"""The Triton backend's engine: one forward chunk loop (``chunk_loop``) and one block loop for the recompute
(``block_loop``), shared by every loss family (``vpce.backends.triton.softmax``: cross-entropy, log-probs and a
loss of the log-probs; ``vpce.backends.triton.distill``: the distillation).

Each loss supplies a small per-chunk (per-block) step; the loops own the chunking, the GEMMs of dX, dW and db, and
their accumulators. The softmax losses share one step whose ``on_part(part, stats) -> Coefficients`` is the
per-loss seam; the distillation has its own. The speculative route's flag-gated recompute
(``softmax._gated_recompute``) is a loop of its own: its kernels are gated by a device flag and its dW GEMM is
Triton's.

The logits are rounded to the inputs' dtype once, as ``F.linear`` rounds them in plain PyTorch; everything after
is fp32. No host syncs, no atomics: every kernel writes each output element from one program.
"""

from __future__ import annotations

import torch

from ...parallel import HiddenGradReduce
from ...routing import Call, Finish, round_to
from ..gemm import add_product, mm_into
from ..grads import FastGrads, add_block, weight_grad, written_rows

__all__ = ["chunk_loop", "block_loop", "flat_buffer", "buffer_view"]


def block_loop(hidden, weight, bias, call: Call, step, main_weight=None):
    """The lean block loop: dX, dW and db from the gradient recomputed block by block by ``step``, in whichever
    order holds the smaller fp32 accumulator:

    * vocab-major (``N <= V_local``): each vocab block over all tokens; its dW in one GEMM (no dW accumulator),
      dX summed over the blocks in fp32 ``[N, D]``;
    * token-major (``N > V_local``, long sequences): each token block over the whole vocab; its dX finished
      before the next block (fp32 ``[N_b, D]`` only), dW summed over the token blocks in fp32 ``[V_local, D]``
      (or straight into ``main_grad``). The extra memory then stays fixed as N grows.

    ``step``: its ``buffers`` logits buffers of ``[N_b, V_b]`` fit the plan's ``block_gib``, ``V_b`` a multiple of
    ``step.align``, ``N_b`` the plan's ``block_tokens`` (token-major); ``step.alloc(nb, vb, n, v)`` allocates them,
    ``step.tokens(tok)`` gives what a token block needs, ``step.block(h, tok, per_tok, v0, v1)`` recomputes the
    gradient of tokens ``tok`` and vocab rows ``[v0, v1)`` into its buffer and returns it. ``hidden`` contiguous.
    ``main_weight``: add dW in fp32 into its ``main_grad`` instead of returning it.
    """
    n, d = hidden.shape
    v, n_rows, dtype = call.shard.valid_rows, weight.shape[0], hidden.dtype
    need_dx, need_dw, need_db = call.needs_grad
    into_main = main_weight is not None and need_dw
    db = torch.zeros(n_rows, dtype=torch.float32, device=hidden.device) if need_db and bias is not None else None
    token_major = 0 < v < n
    sizes = call.plan.sizes
    nb = max(1, min(n, sizes.block_tokens) if token_major else n)
    vb = round_to(int(sizes.block_gib * 2**30) // max(1, step.buffers * nb * hidden.element_size()), step.align)
    vb = min(vb, max(v, 1))
    step.alloc(nb, vb, n, v)
    dx = dw = dx_acc = None
    if token_major:
        if need_dx:
            dx = torch.empty(n, d, dtype=dtype, device=hidden.device)
            dx_acc = torch.empty(nb, d, dtype=torch.float32, device=hidden.device) if v > vb else None
        if need_dw and not into_main:
            dw = torch.zeros(n_rows, d, dtype=torch.float32, device=hidden.device)
    else:
        dx = written_rows(n, d, n if v else 0, torch.float32, hidden.device) if need_dx else None
        dw = written_rows(n_rows, d, v if n else 0, dtype, hidden.device) if need_dw and not into_main else None
    main_grad = main_weight.main_grad if into_main else None
    for n0 in range(0, n if v else 0, nb):
        n1 = min(n, n0 + nb)
        h, tok = hidden[n0:n1], slice(n0, n1)
        per_tok = step.tokens(tok)
        for v0 in range(0, v, vb):
            v1 = min(v, v0 + vb)
            gz = step.block(h, tok, per_tok, v0, v1)
            add_block(gz, h, weight[v0:v1], slice(v0, v1), tok, dx=dx, dx_acc=dx_acc, dw=dw, db=db,
                      token_major=token_major, main_grad=main_grad)
        if dx_acc is not None and dx is not None:
            dx[tok] = dx_acc[: n1 - n0]
    if dx is not None and dx.dtype != dtype:
        dx = dx.to(dtype)
    if into_main:
        dw = weight_grad(None, main_weight, dtype)
    elif dw is not None and dw.dtype != dtype:
        dw = dw.to(dtype)
    return dx, dw, None if db is None else db.to(dtype)


def chunk_loop(hidden, w, b, chunk: int, call: Call, step, form: bool = True, finish: Finish = Finish(),
               whole_p: torch.Tensor | None = None) -> FastGrads | None:
    """The forward chunk loop, every loss and route: per chunk ``sl`` of ``chunk`` tokens the per-loss ``step(sl,
    first)`` takes the chunk's statistics and outputs (from its logits buffer where the route holds one, ``first``: the
    first chunk's logits already written, launched before the forward's set-up) and, where ``form``, writes the chunk's
    gradient over them and returns that ``[c, V_local]`` buffer (None on an all-padding shard); the chunk's dX rows
    (fp32, or the hidden's dtype with ``Plan.dx_in_forward``) and dW (db: fp32) follow (with ``dx_reduce ==
    "forward"``, dX summed over the group, overlapped with the dW GEMM and the next chunk). ``finish``
    (``routing.Finish``): whether the last chunk's dW GEMM (``FastGrads.last``) and, with one chunk and no group, dX's
    GEMM (``FastGrads.dx_last``) wait for backward, where one quack GEMM each writes them scaled. ``whole_p``: ``P``
    of every token (``Finish.one_dw``), where each chunk's step leaves its gradient in that chunk's rows; dW is then
    one GEMM over all of it after the last chunk (left to backward with ``Finish.defer_dw``), none per chunk.
    Returns the held ``FastGrads``, or None without ``form``."""
    n, d = hidden.shape
    if not form:
        for c0 in range(0, n, chunk):
            step(slice(c0, min(n, c0 + chunk)), c0 == 0)
        return None
    shard, plan, needs = call.shard, call.plan, call.needs_grad
    dev = hidden.device
    v = shard.valid_rows
    dx = dx_last = None
    defer_dx = finish.defer_dx
    if needs[0] and not defer_dx:  # an all-padding shard contributes zeros (and still joins the collectives)
        # fp32 for the group's sum and the caller's scaling, else each chunk's rows written once in the hidden's dtype
        dx_dtype = hidden.dtype if plan.dx_in_forward else torch.float32
        dx = (torch.empty if v > 0 else torch.zeros)(n, d, dtype=dx_dtype, device=dev)
    reduce_dx = HiddenGradReduce(dx, shard, plan.sequence_parallel) \
        if dx is not None and plan.dx_reduce == "forward" else None
    dw = None  # fp32 accumulator, allocated by the first chunk's GEMM (no zero fill)
    last = None
    db = torch.zeros(v, dtype=torch.float32, device=dev) if needs[2] and b is not None else None
    for c0 in range(0, n, chunk):
        sl = slice(c0, min(n, c0 + chunk))
        g = step(sl, c0 == 0)
        if defer_dx:
            dx_last = (g, w)
        elif v > 0 and dx is not None:
            mm_into(dx[sl], g, w)
        if reduce_dx is not None:  # overlaps this chunk's dW GEMM and the next chunk
            reduce_dx.add(sl)
        if v == 0:
            continue
        if needs[1] and (whole_p is None or sl.stop == n):  # with whole_p: one dW GEMM, over every chunk's rows
            gw, x = (g, hidden[sl]) if whole_p is None else (whole_p, hidden)
            if finish.defer_dw and sl.stop == n:
                last = (gw, x)
            else:
                dw = add_product(dw, gw.t(), x)
        if db is not None:
            db += g.sum(0, dtype=torch.float32)
    if needs[1] and dw is None and last is None:  # no chunk ran (no tokens, or an all-padding shard)
        dw = torch.zeros(v, d, dtype=torch.float32, device=dev)
    return FastGrads(dx, dw, db, reduce_dx, last, dx_last)  # dX's sum awaited in backward, after dW's cast


def flat_buffer(numel: int, dtype, device) -> torch.Tensor | None:
    return torch.empty(numel, dtype=dtype, device=device) if numel else None


def buffer_view(buf: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A contiguous ``[rows, cols]`` view of the front of a flat buffer."""
    return buf[: rows * cols].view(rows, cols)
