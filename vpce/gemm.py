"""GEMMs of fp16/bf16 operands with an fp32 (or fp64) result, on any device.

On CUDA (torch >= 2.10) one cuBLAS call does it: ``torch.mm(a, b, out_dtype=torch.float32)`` and
``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` accumulate the bf16 products in fp32 and never round
the result to bf16. Where the device has no such kernel (CPU) the operands are upcast block by block along the
reduction dimension, so the extra memory stays bounded.
"""

from __future__ import annotations

import torch

__all__ = ["mm_out", "mm_into", "addmm_out_"]

_HAS_MIXED: dict[str, bool] = {}
_HAS_INTO: dict[str, bool] = {}
_UPCAST_ELEMS = 1 << 24  # elements of ``b`` upcast at a time on the fallback path


def _mixed(fn, *args, **kwargs):
    """Run a mixed-dtype cuBLAS call, or return None (remembered per device type) where there is none."""
    dev = args[0].device.type
    if not _HAS_MIXED.get(dev, True):
        return None
    try:
        out = fn(*args, **kwargs)
    except (RuntimeError, TypeError, NotImplementedError):
        _HAS_MIXED[dev] = False
        return None
    _HAS_MIXED[dev] = True
    return out


def mm_out(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` with the result in ``out_dtype``; ``a``, ``b`` in their own (equal) dtype."""
    if a.dtype == out_dtype:
        return a @ b
    out = _mixed(torch.mm, a, b, out_dtype=out_dtype)
    if out is not None:
        return out
    out = a.new_zeros((a.shape[0], b.shape[1]), dtype=out_dtype)
    addmm_out_(out, a, b)
    return out


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` written straight into ``out`` (e.g. a row slice of a bigger result), in ``out``'s dtype."""
    if a.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    dev = out.device.type
    if _HAS_INTO.get(dev, True):
        try:  # beta=0: cuBLAS does not read ``out`` (NaN or garbage in it never propagates)
            torch.addmm(out, a, b, beta=0, out_dtype=out.dtype, out=out)
            _HAS_INTO[dev] = True
            return out
        except (RuntimeError, TypeError, NotImplementedError):
            _HAS_INTO[dev] = False
    return out.copy_(mm_out(a, b, out.dtype))


def addmm_out_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in ``acc``'s dtype, in place."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if _mixed(torch.addmm, acc, a, b, out_dtype=acc.dtype, out=acc) is not None:
        return acc
    step = max(1, _UPCAST_ELEMS // max(1, b.shape[1]))
    for k0 in range(0, a.shape[1], step):
        acc.addmm_(a[:, k0:k0 + step].to(acc.dtype), b[k0:k0 + step].to(acc.dtype))
    return acc
