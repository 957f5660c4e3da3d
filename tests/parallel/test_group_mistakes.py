"""Mistakes under a group that no shape reveals, refused with the same error on every rank instead of a wrong loss,
and ``is_top1`` at exact ties across shard boundaries.

- The whole lm_head passed on every rank without ``vocab_start``: the shards would be stacked by rank into a vocab
  ``world`` times too large, and the loss would be finite and wrong. The agreement's checksum of each rank's first
  weight rows tells it from real shards (which hold different rows), on the host where the layout is learned.
- Different hidden states on the ranks (each rank computes every token's loss over its shard): caught with
  ``validate=True`` (a checksum of the hidden states in the agreement), except under sequence parallelism, where
  each rank passes its own slice by design.
- ``is_top1`` of ``linear_log_probs`` and ``token_accuracy`` judge a tie by the lowest global id, as
  ``torch.argmax``, also where the tied logits sit on different ranks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import vpce
from distributed import cpu_triton, run_ranks
from problems import tie_problem

CUDA = torch.cuda.is_available()
BACKENDS = ["torch", pytest.param("triton", marks=cpu_triton)]
SIZES = [76, 75, 40]  # uneven shards; the first boundary splits ids 75 and 76


def _head(seed=0, n=12, d=16, v=151):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, d, generator=gen), torch.randn(v, d, generator=gen),
            torch.randint(0, v, (n,), generator=gen))


def _calls(backend):
    """Each public entry on (hidden, weight, target, group, **kw): the error must come from all of them."""
    return {
        "cross_entropy": lambda h, w, t, **kw: vpce.linear_cross_entropy(h, w, t, backend=backend, **kw),
        "log_probs": lambda h, w, t, **kw: vpce.linear_log_probs(h, w, t, backend=backend, **kw),
        "distillation": lambda h, w, t, **kw: vpce.linear_distillation_loss(h, w, h, w, t, backend=backend, **kw),
    }


def _outcome(fn):
    try:
        fn()
        return "ok"
    except ValueError as e:
        return f"ValueError: {e}"


def _full_weight_on_every_rank(rank, world, backend):
    h, w, t = _head()
    out = {}
    for name, call in _calls(backend).items():
        for validate in (False, True):
            out[f"{name}-{validate}"] = _outcome(lambda: call(h, w, t, group=dist.group.WORLD, validate=validate))
    # the same weight with vocab_start given: the layout check names the overlap
    out["vocab_start"] = _outcome(lambda: vpce.linear_cross_entropy(h, w, t, backend=backend, group=dist.group.WORLD,
                                                                      vocab_start=0, vocab_size=w.shape[0]))
    # real shards of a constant (zero-initialized) head are not mistaken for it
    zeros = torch.zeros(SIZES[rank], w.shape[1])
    out["zero shards"] = _outcome(lambda: vpce.linear_cross_entropy(h, zeros, t.clamp(max=sum(SIZES[:world]) - 1),
                                                                    backend=backend, group=dist.group.WORLD))
    return out


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_full_weight_on_every_rank_is_refused(world, backend):
    results = run_ranks(_full_weight_on_every_rank, world, backend, timeout=240)
    for key in results[0]:
        if key == "zero shards":
            assert all(r[key] == "ok" for r in results), [r[key] for r in results]
            continue
        texts = [r[key] for r in results]
        assert all(t.startswith("ValueError") for t in texts), (key, texts)
        if key != "vocab_start":
            assert all("weight: expected this rank's shard of the lm_head rows" in t and "same 151 rows" in t
                       for t in texts), (key, texts)
            assert len(set(texts)) == 1, texts  # the same message on every rank
        else:
            assert all("vocab_start" in t and "overlaps" in t for t in texts), texts


def _hidden_differs(rank, world, backend, sp):
    h, w, t = _head(n=6 * world)
    start = sum(SIZES[:rank])
    shard = w[start:start + SIZES[rank]] if rank < world - 1 else w[start:]
    out = {}
    for name, call in _calls(backend).items():
        mine = h + rank * 2.0**-10 if not sp else h[rank * 6:(rank + 1) * 6]
        for validate in (False, True):
            out[f"{name}-{validate}"] = _outcome(lambda: call(mine, shard, t, group=dist.group.WORLD,
                                                              validate=validate, sequence_parallel=sp))
        out[f"{name}-same"] = _outcome(lambda: call(h if not sp else mine, shard, t, group=dist.group.WORLD,
                                                    validate=True, sequence_parallel=sp))
    return out


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_different_hidden_states_are_refused_with_validate(world, backend):
    results = run_ranks(_hidden_differs, world, backend, False, timeout=240)
    for name in _calls(backend):
        texts = [r[f"{name}-True"] for r in results]
        assert len(set(texts)) == 1 and texts[0].startswith("ValueError: hidden: expected the same hidden states "
                                                            "on every rank"), texts
        assert all(r[f"{name}-False"] == "ok" for r in results), "without validate the hidden states are not read"
        assert all(r[f"{name}-same"] == "ok" for r in results)


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
def test_sequence_parallel_slices_may_differ_with_validate():
    results = run_ranks(_hidden_differs, 2, "torch", True, timeout=240)
    for r in results:
        assert all(v == "ok" for v in r.values()), r


# -- is_top1 and token_accuracy at exact ties across shard boundaries ------------------------------------------

OPTIONS = [{}, dict(temperature=0.5), dict(softcap=4.0), dict(memory_budget="lean")]


def _ties(rank, world, backend):
    dtype = torch.float64 if backend == "torch" else torch.float32
    sizes = SIZES[:world]
    start, rows = sum(sizes[:rank]), sizes[rank]
    p = tie_problem(24, 4, sum(sizes), dtype=dtype, seed=5 + world)
    out = {}
    for i, kw in enumerate(OPTIONS):
        lp_kw = {k: v for k, v in kw.items() if k != "memory_budget"}
        h = p.hidden.clone().requires_grad_()
        lp = vpce.linear_log_probs(h, p.weight[start:start + rows], p.target, p.bias[start:start + rows],
                                   backend=backend, group=dist.group.WORLD, return_top1=True, **lp_kw)
        lp[0].sum().backward()
        out[f"logprobs-{i}"] = lp[1].numpy()
        ce = vpce.linear_cross_entropy(p.hidden, p.weight[start:start + rows], p.target, p.bias[start:start + rows],
                                       backend=backend, group=dist.group.WORLD, reduction="none",
                                       return_token_accuracy=True,
                                       **{k: v for k, v in kw.items() if k != "temperature"})
        out[f"ce-{i}"] = ce.token_accuracy.numpy()
    return out


@pytest.mark.skipif(CUDA, reason="gloo ranks on CPU")
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_is_top1_takes_the_lowest_id_at_ties_across_shards(world, backend):
    dtype = torch.float64 if backend == "torch" else torch.float32
    sizes = SIZES[:world]
    p = tie_problem(24, 4, sum(sizes), dtype=dtype, seed=5 + world)
    z = p.hidden.double() @ p.weight.double().t() + p.bias.double()
    keep = p.target != -100
    t = p.target.clamp(min=0)
    want = (z.argmax(-1) == t) & keep  # torch.argmax: the lowest id among the maxima
    owner = torch.bucketize(torch.arange(sum(sizes)), torch.tensor(sizes).cumsum(0), right=True)
    tied_higher = keep & (z.gather(1, t[:, None]).squeeze(1) == z.amax(-1)) & (z.argmax(-1) != t)
    assert tied_higher.sum() >= 2, "the problem must hold targets tied with a maximum of a lower id"
    if world > 1:
        assert (tied_higher & (owner[z.argmax(-1)] != owner[t])).sum() >= 1, "no tie across a shard boundary"
    for rank, res in enumerate(run_ranks(_ties, world, backend, timeout=300)):
        for i, kw in enumerate(OPTIONS):
            for kind in ("logprobs", "ce"):  # temperature and soft cap are monotonic: the same ties, the same ids
                got = torch.from_numpy(res[f"{kind}-{i}"]).bool() & keep
                assert torch.equal(got, want), (kind, kw, rank, (got != want).nonzero().flatten().tolist())
