"""How a backend hands back the gradients: the fast route's held gradients (``FastGrads``) finished in backward,
and the weight gradient as ``weight.grad`` or, Megatron-style, added into ``weight.main_grad``.

With ``accumulate_main_grad`` the fp32 weight gradient is added into ``weight.main_grad`` (fp32, never rounded to
the weight's dtype), as megatron-core's gradient-accumulation fusion does. If the parameter carries
``grad_added_to_main_grad`` (Megatron's DDP sets it), that flag is set and a placeholder of the weight's shape is
returned (zeros when ``zero_out_wgrad``) so that DDP's post-accumulation hook still runs; otherwise None.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from .gemm import add_product, addmm_out_, mm_into, mm_out, scaled_hidden_grad, scaled_weight_grad

__all__ = ["FastGrads", "finish_fast_grads", "scaled", "check_main_grad", "pad_rows", "weight_grad",
           "weight_grad_to_main", "add_block", "written_rows"]


class FastGrads(NamedTuple):
    """The fast route's gradients, formed in forward at unit upstream scale (fp32, fp64 for fp64 inputs); dW and
    db over the shard's valid rows. Each is None where not needed.

    ``dx_sum``: dX's sum over the tensor-parallel group, still in flight (``vpce.parallel.HiddenGradReduce``);
    ``summed()`` waits for it. Backward waits only after dW's scale and cast, which the last chunk's all-reduce
    runs beside: in forward it would wait behind the last dW GEMM, which holds every SM until it ends.

    ``last``: ``(g, x)``, the last chunk's gradient ``[c, V_local]`` and hidden rows, whose dW GEMM was left to backward
    (``vpce.backends.gemm.hopper_dw_ready``): there it reads ``dw`` (None: there was one chunk) as C and writes the
    weight's dtype, scaled (``finish_fast_grads``)."""

    dx: torch.Tensor | None
    dw: torch.Tensor | None
    db: torch.Tensor | None
    dx_sum: object | None = None
    last: tuple[torch.Tensor, torch.Tensor] | None = None
    dx_last: tuple[torch.Tensor, torch.Tensor] | None = None
    """``(g, w)``: the whole call's gradient ``[N, V]`` (one chunk, no group) and the weight's valid rows, whose dX
    GEMM was left to backward (``dx`` is then None): one quack GEMM writes dX scaled in its 16-bit dtype."""
    mean_folded: bool = False
    """The cross-entropy's ``mean`` ``1/count`` is in the held gradients already (dX written in the hidden's dtype
    in forward, ``routing.Plan.dx_in_forward``): backward scales them by the upstream gradient alone."""

    def summed(self) -> tuple:
        """``(dx, dw, db)``, unscaled, with dX summed over the group (this rank's rows of it under sequence
        parallelism) and a deferred last dW GEMM (``last``) done here into the fp32 accumulator: for a caller that
        scales the held gradients itself (the ``torch.compile`` op, ``vpce.library``)."""
        return self.summed_dx(), self.dw_in_fp32(), self.db

    def dw_in_fp32(self) -> torch.Tensor | None:
        """The fp32 dW accumulator with a deferred last chunk (``last``) added into it (or alone: one chunk)."""
        return self.dw if self.last is None else add_product(self.dw, self.last[0].t(), self.last[1])

    def summed_dx(self) -> torch.Tensor | None:
        """dX in fp32, summed over the group (waits for ``dx_sum``), or the deferred one chunk's (``dx_last``)."""
        if self.dx_last is not None:
            return mm_out(*self.dx_last, torch.float32)
        return self.dx if self.dx_sum is None else self.dx_sum.finish()


def check_main_grad(weight: torch.Tensor):
    main = getattr(weight, "main_grad", None)
    if not isinstance(main, torch.Tensor) or main.shape != weight.shape or main.device != weight.device:
        got = "no main_grad" if main is None else f"main_grad {tuple(main.shape)} on {main.device}"
        raise ValueError(f"accumulate_main_grad: expected weight.main_grad, a tensor of the weight's shape "
                         f"{tuple(weight.shape)} on {weight.device}, got {got}")


def weight_grad_to_main(weight: torch.Tensor, dw: torch.Tensor | None,
                        scale: torch.Tensor | None = None) -> torch.Tensor | None:
    """Add the gradient of the valid rows, ``dw`` times ``scale`` (a 0-d tensor; None: ``dw`` is scaled already),
    into ``weight.main_grad``, in one pass over the fp32 accumulator (a separate ``mul_`` read and wrote all of it
    once more: 2 x 1.96 GiB on the Llama-3-8B head at tp=1); the grad to return."""
    if dw is not None:
        main = weight.main_grad[: dw.shape[0]]
        main.add_(dw) if scale is None else main.addcmul_(dw, scale)
    if hasattr(weight, "grad_added_to_main_grad"):
        weight.grad_added_to_main_grad = True
        make = torch.zeros_like if getattr(weight, "zero_out_wgrad", False) else torch.empty_like
        return make(weight, requires_grad=False)
    return None


def pad_rows(g: torch.Tensor | None, rows: int, dtype: torch.dtype) -> torch.Tensor | None:
    """Gradient of the valid rows -> gradient of all ``rows`` (padding rows 0), in ``dtype``."""
    if g is None:
        return None
    if g.shape[0] == rows:
        return g.to(dtype)
    out = g.new_zeros((rows,) + tuple(g.shape[1:]), dtype=dtype)
    out[: g.shape[0]] = g
    return out


def weight_grad(dw: torch.Tensor | None, weight_or_rows, dtype: torch.dtype) -> torch.Tensor | None:
    """The weight's gradient to return: ``dw`` padded and cast, or (given the weight itself) added into its
    ``main_grad``."""
    if isinstance(weight_or_rows, torch.Tensor):
        return weight_grad_to_main(weight_or_rows, None if dw is None else dw.float())
    return pad_rows(dw, weight_or_rows, dtype)


def scaled(acc: torch.Tensor, g: torch.Tensor, dtype: torch.dtype, scale_cast: Callable) -> torch.Tensor:
    """``acc * g`` in ``dtype`` for a held gradient ``acc`` (fp32 or fp64, or dX in its 16-bit dtype,
    ``routing.Plan.dx_in_forward``) and a 0-d fp32 ``g``: in place where ``dtype`` is ``acc``'s (fp32 parameters
    under autocast: no rounding and no copy), else in ``scale_cast``'s one pass. A 16-bit ``acc`` is scaled in
    place by ``scale_cast(..., out=acc)``, in fp32: ``mul_`` would round ``g`` to ``acc``'s dtype first."""
    if acc.dtype != dtype:
        return scale_cast(acc, g, dtype)
    if acc.dtype in (torch.float16, torch.bfloat16):
        return scale_cast(acc, g, dtype, out=acc)
    return acc.mul_(g)


def finish_fast_grads(grads: FastGrads, g: torch.Tensor, dtypes: tuple[torch.dtype, torch.dtype, torch.dtype],
                      rows: int, main_weight: torch.Tensor | None, scale_cast: Callable):
    """Scale the held gradients by the upstream gradient ``g`` (0-d, with ``1/count`` for ``mean``) and return them
    in ``dtypes`` (dX's, dW's, db's: each input's own, so fp32 parameters that autocast cast get their fp32
    accumulators back, unrounded), dW padded to ``rows`` or added into ``main_weight.main_grad``. dW first: dX's
    sum over the group may still be running (``FastGrads.dx_sum``). A deferred last chunk (``FastGrads.last``) is
    one GEMM that reads the accumulator and writes dW scaled in its 16-bit dtype; for an fp32 dW it is added into
    the accumulator first."""
    dw, db = grads.dw, grads.db
    dx_dtype, dw_dtype, db_dtype = dtypes
    db = None if db is None else pad_rows(db.mul_(g), rows, db_dtype)
    if grads.last is not None and main_weight is None and dw_dtype in (torch.float16, torch.bfloat16):
        dw = pad_rows(scaled_weight_grad(dw, *grads.last, g, dw_dtype), rows, dw_dtype)
    else:
        dw = grads.dw_in_fp32()
        if main_weight is not None:  # fp32 straight into main_grad, never rounded
            dw = weight_grad_to_main(main_weight, dw, g)
        elif dw is not None:
            dw = pad_rows(scaled(dw, g, dw_dtype, scale_cast), rows, dw_dtype)
    if grads.dx_last is not None and dx_dtype in (torch.float16, torch.bfloat16):
        return scaled_hidden_grad(*grads.dx_last, g, dx_dtype), dw, db
    dx = grads.summed_dx()
    return None if dx is None else scaled(dx, g, dx_dtype, scale_cast), dw, db


def written_rows(rows: int, cols: int, written: int, dtype: torch.dtype, device) -> torch.Tensor:
    """A ``[rows, cols]`` buffer whose first ``written`` rows the caller overwrites in full: only the others are
    zeroed (the lean backward's vocab-major dX and dW, whose first GEMM writes every row: zeroing all of dW
    first would be one more full pass over it)."""
    out = torch.empty(rows, cols, dtype=dtype, device=device)
    out[written:].zero_()
    return out


def add_block(gz: torch.Tensor, h: torch.Tensor, w_block: torch.Tensor, vs: slice, tok: slice, *, dx, dx_acc, dw, db,
              token_major: bool, main_grad=None):
    """One recomputed gradient block ``gz = dL/dz [tok, vs]`` of a lean backward into its results, in the order
    the caller walks (``vpce.backends.triton.recompute_grads`` says which accumulator each order keeps):
    vocab-major: the block's dW in one GEMM over all tokens, dX summed in fp32 (the first block's written, the
    others' added); token-major: dW summed in fp32 (or into ``main_grad``), dX in one GEMM when the vocab is one
    block (``dx_acc`` None), else summed in ``dx_acc``; ``db`` summed in fp32."""
    if main_grad is not None:
        addmm_out_(main_grad[vs], gz.t(), h)  # fp32 accumulation into main_grad
    elif dw is not None and token_major:
        addmm_out_(dw[vs], gz.t(), h)  # fp32, summed over the token blocks
    elif dw is not None:
        torch.mm(gz.t(), h, out=dw[vs])  # the block's dW over all tokens: one GEMM, one rounding
    if dx is not None and not token_major:
        mm_into(dx, gz, w_block) if vs.start == 0 else addmm_out_(dx, gz, w_block)  # fp32, summed over the blocks
    elif dx is not None and dx_acc is None:
        torch.mm(gz, w_block, out=dx[tok])  # the whole vocab in one block: one GEMM, one rounding
    elif dx is not None:
        acc = dx_acc[: gz.shape[0]]
        mm_into(acc, gz, w_block) if vs.start == 0 else addmm_out_(acc, gz, w_block)
    if db is not None:
        db[vs] += gz.sum(0, dtype=torch.float32)
