"""Comparisons shared by the integration tests: a model patched with vpce against the stock model."""

from __future__ import annotations

import torch


def rel_err(got: torch.Tensor, want: torch.Tensor) -> tuple[float, str]:
    """Max abs error over max |want|, and where the max error sits."""
    diff = (got.detach().double() - want.detach().double()).abs()
    idx = tuple(int(i) for i in torch.unravel_index(diff.argmax(), diff.shape)) if diff.dim() else ()
    return diff.max().item() / max(want.detach().abs().max().item(), 1e-30), f"index {idx}"


def assert_close(got, want, rtol, what):
    err, where = rel_err(got, want)
    assert err <= rtol, f"{what}: rel err {err:.3e} > {rtol:.0e} at {where} (got {got.flatten()[:4]}...)"


def assert_grads_close(patched, stock, rtol):
    """Every parameter's gradient of ``patched`` against the same-named one of ``stock``."""
    stock_params = dict(stock.named_parameters())
    for name, p in patched.named_parameters():
        q = stock_params[name]
        assert (p.grad is None) == (q.grad is None), f"{name}: grad presence differs"
        if p.grad is not None:
            assert_close(p.grad, q.grad, rtol, f"grad of {name}")
