"""Experiment only (not in the package): the fast route's P chunk as PSHARE x the fp32 dW accumulator's size."""
import os
import torch
import vpce.routing as r

share = os.environ.get("PSHARE")
if share is not None:
    share = float(share)

    def _fast_chunk(opts, cols, dtype, d):
        if isinstance(opts.memory_budget, float):
            gib = opts.memory_budget
        else:
            gib = min(r.SIZING.fast_p_gib, max(r.SIZING.min_p_gib, share * cols * d * 4 / 2**30))
        per_tok = cols * torch.empty((), dtype=dtype).element_size()
        return r.round_to(int(gib * 2**30) // per_tok, r.ROW_ALIGN)

    r._fast_chunk = _fast_chunk
