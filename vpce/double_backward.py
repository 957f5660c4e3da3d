"""The one guard every ``torch.autograd.Function`` of vpce runs first in its backward.

vpce's backward passes are not differentiable again: they finish gradients formed in forward, recompute them with
kernels, or run collectives on them, none of it recorded by autograd. A backward with ``create_graph=True`` runs
in grad mode, so there the guard raises one clear error instead of returning a graph that is silently wrong.
"""

from __future__ import annotations

import torch

__all__ = ["refuse_double_backward"]


def refuse_double_backward(what: str) -> None:
    """Raise ``RuntimeError`` naming ``what`` (the public function whose gradients these are) when the backward
    runs under ``create_graph=True``."""
    if torch.is_grad_enabled():
        raise RuntimeError(f"vpce: double backward is not supported: the gradients of {what} cannot be "
                           f"differentiated again (backward or autograd.grad with create_graph=True); compute a "
                           f"gradient penalty on another path")
