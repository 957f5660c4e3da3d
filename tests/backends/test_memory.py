"""The torch backend's peak extra memory is bounded by its chunk budget as N grows (measured, on CPU).

``vpce.memory.PeakMemory`` counts every tensor storage allocated during fwd+bwd. Beyond the gradients and the
fp32 accumulators (which do not grow with N) vpce may only grow by O(N * D) (dX in fp32 and in the input dtype)
plus O(N) per-token statistics; plain PyTorch grows by several copies of the ``[N, V]`` logits.
"""

import pytest
import torch
import torch.nn.functional as F

import vpce
from vpce.memory import PeakMemory

from vpce.options import DEFAULT_CHUNK_GIB


def peak_bytes(fn, n: int, d: int, v: int, budget):
    gen = torch.Generator().manual_seed(n)
    h = torch.randn(n, d, generator=gen, requires_grad=True)
    w = (torch.randn(v, d, generator=gen) / d**0.5).requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen)
    with PeakMemory("cpu") as pm:
        fn(h, w, t, budget).backward()
    return pm.peak


def vpce_loss(h, w, t, budget):
    return vpce.linear_cross_entropy(h, w, t, memory_budget=budget)


def torch_loss(h, w, t, budget):
    return F.cross_entropy(F.linear(h, w).float(), t)


# (memory_budget, D, V, token counts): each route measured over several chunks at every N (fast: 21-token chunks;
# lean: the default 0.25 GiB, 524 tokens at V = 32000), N at least doubling. The peak grows linearly in N here
# (fast: 291 B/token between any two of 512, 2048, 8192 tokens), so two sizes give its slope.
CASES = [(2.0 / 1024, 32, 6000, [512, 2048]), ("lean", 8, 32000, [1024, 2048])]


@pytest.mark.parametrize("budget,D,V,ns", CASES, ids=["fast-2MiB", "lean-default"])
def test_peak_memory_flat_in_n(budget, D, V, ns):
    peaks = [peak_bytes(vpce_loss, n, D, V, budget) for n in ns]
    weight_terms = 4 * V * D * 4           # dW fp32 accumulator, dW, and slack for one more copy of each
    gib = budget if isinstance(budget, float) else DEFAULT_CHUNK_GIB
    chunk = gib * 2**30 * 1.5              # the budget, plus the per-chunk temporaries it does not model
    per_token = 2 * D * 4 + 64             # dX in fp32 and in the input dtype, per-token statistics
    for n, p in zip(ns, peaks):
        bound = weight_terms + chunk + n * per_token
        assert p <= bound, f"N={n}: peak {p / 2**20:.2f} MiB > bound {bound / 2**20:.2f} MiB (peaks {peaks})"
    growth = (peaks[-1] - peaks[0]) / (ns[-1] - ns[0])
    assert growth <= per_token, f"peak grows by {growth:.0f} B/token, more than O(D) ({per_token} B): {peaks}"
    # and the unfused loss at the largest N needs the [N, V] logits several times over
    unfused = peak_bytes(torch_loss, ns[-1], D, V, None)
    assert unfused >= 2 * ns[-1] * V * 4 and unfused > 4 * peaks[-1], (unfused, peaks[-1])
