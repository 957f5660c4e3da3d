"""GEMMs of fp16/bf16 operands with an fp32 (or fp64) result, on any device.

On CUDA (torch >= 2.10) one cuBLAS call does it: ``torch.mm(a, b, out_dtype=torch.float32)`` and
``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` accumulate the bf16 products in fp32 and never round
the result to bf16. Where the device has no such kernel (CPU) the operands are upcast block by block along the
reduction dimension, so the extra memory stays bounded.

Which of the two is used is decided once per device type, by capability: a probe on 1x1 tensors the first time.
An error from a real GEMM (out of memory, a bad shape) propagates; it never switches the path.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["mm_out", "mm_into", "addmm_out_", "logits_into", "has_mixed_gemm"]

_UPCAST_ELEMS = 1 << 24  # elements of ``b`` upcast at a time on the fallback path


@functools.cache
def has_mixed_gemm(device_type: str) -> bool:
    """Whether ``torch.mm``/``torch.addmm`` take 16-bit operands with ``out_dtype=torch.float32`` on this device
    type (probed once on 1x1 tensors)."""
    if device_type == "cpu":
        return False
    try:
        a = torch.ones(1, 1, dtype=torch.bfloat16, device=device_type)
        acc = torch.zeros(1, 1, dtype=torch.float32, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(acc, a, a, beta=0, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _mixed(a: torch.Tensor, out_dtype: torch.dtype) -> bool:
    return out_dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16) and has_mixed_gemm(a.device.type)


def mm_out(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` with the result in ``out_dtype``; ``a``, ``b`` in their own (equal) dtype."""
    if a.dtype == out_dtype:
        return a @ b
    if _mixed(a, out_dtype):
        return torch.mm(a, b, out_dtype=out_dtype)
    out = a.new_zeros((a.shape[0], b.shape[1]), dtype=out_dtype)
    return addmm_out_(out, a, b)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` written straight into ``out`` (e.g. a row slice of a bigger result), in ``out``'s dtype."""
    if a.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    if _mixed(a, out.dtype):  # beta=0: cuBLAS does not read ``out`` (NaN or garbage in it never propagates)
        return torch.addmm(out, a, b, beta=0, out_dtype=out.dtype, out=out)
    return out.copy_(mm_out(a, b, out.dtype))


def addmm_out_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in ``acc``'s dtype, in place."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if _mixed(a, acc.dtype):
        return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    step = max(1, _UPCAST_ELEMS // max(1, b.shape[1]))
    for k0 in range(0, a.shape[1], step):
        acc.addmm_(a[:, k0:k0 + step].to(acc.dtype), b[k0:k0 + step].to(acc.dtype))
    return acc


def logits_into(out: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``out = h @ w.T (+ b)`` in ``out``'s (the inputs') dtype, the bias added before the one rounding, as
    ``F.linear`` does (cuBLAS's bias epilogue)."""
    if b is None:
        return torch.mm(h, w.t(), out=out)
    return torch.addmm(b, h, w.t(), out=out)
