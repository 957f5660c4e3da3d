"""Rank functions of tests/integrations/test_integration_trl.py, in a module that does not import TRL's trainers (spawned ranks
import it; ``vpce.integrations.trl`` imports only the ``trl`` package itself)."""

import torch
import torch.distributed as dist


def tp_head(rank, world, v, outputs):
    """The vpce head with ``group=`` on the whole weight (TRL gathers a TP DTensor): fields, dX and dW."""
    import vpce.integrations.trl as vtrl

    gen = torch.Generator().manual_seed(1)
    h, w = torch.randn(40, 16, generator=gen), torch.randn(v - 5, 16, generator=gen)  # v - 5 rows: uneven chunks
    t = torch.randint(0, v - 5, (40,), generator=gen)
    leaves = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    out = vtrl.VpceLogProbHead(group=dist.group.WORLD).apply(*leaves, None, t, 0.9, 32768, None, 1.0, outputs)
    (out[0].sum() + out[1].sum()).backward()
    return [x.detach().numpy() for x in out] + [leaves[0].grad.numpy(), leaves[1].grad.numpy()]
