"""vpce.linear_distillation_loss with both heads sharded over gloo ranks: exact against the float64 oracle on the
whole vocab, and every rank fails together when the ranks disagree.

Every rank builds the same full problem from a seed, keeps its rows of both heads (and, with sequence
parallelism, its slice of both hidden states), and checks the loss, dX (or its slice) and its own dW/db rows.
Layouts: even, uneven, padded with the last rank all padding, explicit ``vocab_start``, sequence parallel; every
divergence, reduction, and route; several chunks per call (the JSD's two exchanges per chunk line up). The torch
backend in float64 on 3 ranks, the Triton backend in fp32 (the CPU interpreter) on 2.
"""

import zlib

import pytest
import torch
import torch.distributed as dist

import vpce
from distributed import cpu_triton, run_ranks
from problems import leaf
from test_distillation import make_pair
from vpce.reference import reference_distillation, rel_err

TIMEOUT = 120  # seconds for a whole spawn; a hung collective fails the test


def cases(world: int) -> list[dict]:
    even = [14] * world
    uneven = [23, 6, 17][:world]
    return [
        dict(name="even-fkl-mean", sizes=even, opts=dict(divergence="forward_kl")),
        dict(name="uneven-rkl-none-caps-bias", sizes=uneven, bias=True, reduction="none",
             opts=dict(divergence="reverse_kl", softcap=3.0, teacher_softcap=6.0)),
        dict(name="uneven-jsd-sum-ce-temperature", sizes=uneven, reduction="sum",
             opts=dict(divergence="jsd", beta=0.3, ce_weight=0.4, temperature=1.5, temperature_squared=True)),
        dict(name="padded-last-rank-jsd-none", sizes=even, vocab_size=sum(even[:-1]) - 2 if world > 1 else 11,
             reduction="none", bias=True, opts=dict(divergence="jsd", ce_weight=0.2)),
        dict(name="explicit-start-fkl-token-weight", sizes=uneven, explicit=True, token_weight=True,
             opts=dict(divergence="forward_kl", ce_weight=0.5)),
        dict(name="tiny-chunks-jsd-lean", sizes=uneven, opts=dict(divergence="jsd", memory_budget=3e-6)),
        dict(name="tiny-chunks-rkl-fast-no-target", sizes=even, no_target=True,
             opts=dict(divergence="reverse_kl", memory_budget=3e-6)),
        dict(name="sp-fkl-mean", sizes=even, sp=True, opts=dict(divergence="forward_kl", ce_weight=0.3)),
        dict(name="sp-jsd-none-uneven", sizes=uneven, sp=True, reduction="none", bias=True,
             opts=dict(divergence="jsd", beta=0.7, temperature=0.8)),
        dict(name="sp-rkl-lean-tiny-chunks", sizes=uneven, sp=True,
             opts=dict(divergence="reverse_kl", memory_budget="lean")),
    ]


def _shard(x, sizes, rank):
    start = sum(sizes[:rank])
    return None if x is None else x[start:start + sizes[rank]]


def _check_case(rank, world, group, case):
    sizes, red = case["sizes"], case.get("reduction", "mean")
    rows = sum(sizes)
    vsize = case.get("vocab_size", rows)
    seq, batch = 4 * world, 3
    x = make_pair((seq, batch), 9, 13, rows, vocab_size=vsize, bias=case.get("bias", False), reduction=red,
                  scale=2.0, seed=zlib.crc32(case["name"].encode()) % 1000, dtype=case.get("dtype", torch.float64))
    sp = case.get("sp", False)
    mine = slice(rank * 4, (rank + 1) * 4)
    h = leaf(x.hidden[mine] if sp else x.hidden)
    th = x.t_hidden[mine] if sp else x.t_hidden
    w, b = leaf(_shard(x.weight, sizes, rank)), leaf(_shard(x.bias, sizes, rank))
    tw, tb = _shard(x.t_weight, sizes, rank), _shard(x.t_bias, sizes, rank)
    opts = dict(reduction=red, **case["opts"])
    if case.get("token_weight"):
        opts["token_weight"] = x.token_weight
    target = None if case.get("no_target") else x.target
    layout = dict(vocab_start=sum(sizes[:rank]), vocab_size=vsize) if case.get("explicit") else \
        dict(vocab_size=None if vsize == rows else vsize)
    loss = vpce.linear_distillation_loss(h, w, th, tw, target, b, tb, group=group, sequence_parallel=sp, **layout,
                                         backend=case.get("backend", "auto"), **opts)
    (loss * x.grad.to(loss.dtype)).sum().backward()
    opts.pop("memory_budget", None)
    ref = reference_distillation(x.hidden, x.weight, x.t_hidden, x.t_weight, target, x.bias, x.t_bias, grad=x.grad,
                                 vocab_size=vsize, **opts)
    pairs = [("loss", loss, ref.loss), ("dX", h.grad, ref.dhidden[mine] if sp else ref.dhidden),
             ("dW", w.grad, _shard(ref.dweight, sizes, rank))]
    if b is not None:
        pairs.append(("db", b.grad, _shard(ref.dbias, sizes, rank)))
    return [(case["name"], name, rel_err(got, want)) for name, got, want in pairs]


def _rank_main(rank, world):
    torch.manual_seed(0)
    out = []
    for case in cases(world):
        out += _check_case(rank, world, dist.group.WORLD, case)
    return out


def test_sharded_equals_oracle():
    """3 ranks (one spawn: every layout and option set in turn on the same group)."""
    for rank, results in enumerate(run_ranks(_rank_main, 3, timeout=TIMEOUT)):
        for case, name, err in results:
            assert err < 1e-11, f"rank={rank} case={case}: {name} rel err {err:.3e}"


def triton_cases(world: int) -> list[dict]:
    """The Triton backend in fp32 (the CPU interpreter without CUDA): the fast route's dX summed in forward (hidden
    replicated, and sequence parallel with its own gather), the lean route, the JSD's second exchange, an
    all-padding last rank (fast and lean), several chunks (``memory_budget``: GiB of both logit buffers, 6 or 14
    tokens here; 16 + 8 in the two-chunk case), the default budget's one chunk under sequence parallelism."""
    fp32 = dict(dtype=torch.float32, backend="triton")
    even, uneven = [40] * world, [53, 30, 45][:world]
    return [dict(fp32, **c) for c in [
        dict(name="uneven-jsd-mean-ce-temperature", sizes=uneven, bias=True,
             opts=dict(divergence="jsd", beta=0.3, ce_weight=0.4, temperature=1.5, softcap=3.0, memory_budget=2e-6)),
        dict(name="padded-last-rank-jsd-mean-fast", sizes=even, vocab_size=sum(even[:-1]) - 2,
             opts=dict(divergence="jsd", ce_weight=0.3, memory_budget=2e-6)),
        dict(name="padded-last-rank-fkl-none", sizes=even, vocab_size=sum(even[:-1]) - 2, reduction="none",
             bias=True, token_weight=True, opts=dict(divergence="forward_kl", ce_weight=0.2, memory_budget=2e-6)),
        dict(name="sp-rkl-sum-fast", sizes=uneven, sp=True, reduction="sum",
             opts=dict(divergence="reverse_kl", teacher_softcap=4.0, memory_budget=2e-6)),
        dict(name="sp-jsd-none-lean", sizes=uneven, sp=True, reduction="none", bias=True,
             opts=dict(divergence="jsd", beta=0.7, temperature=0.8)),
        dict(name="two-chunks-jsd-mean-ce-bias", sizes=uneven, bias=True,
             opts=dict(divergence="jsd", beta=0.4, ce_weight=0.3, memory_budget=16 * 2 * 53 * 4 / 2**30)),
        dict(name="sp-fkl-sum-one-chunk", sizes=even, sp=True, reduction="sum", opts=dict(divergence="forward_kl")),
    ]]


def _triton_rank_main(rank, world):
    return [r for case in triton_cases(world) for r in _check_case(rank, world, dist.group.WORLD, case)]


@cpu_triton
def test_triton_sharded_equals_oracle():
    """2 ranks, the Triton backend in fp32: within 1e-5 (loss) / 2e-5 (gradients) of float64."""
    for rank, results in enumerate(run_ranks(_triton_rank_main, 2, timeout=TIMEOUT)):
        for case, name, err in results:
            tol = 1e-5 if name == "loss" else 2e-5
            assert err <= tol, f"rank={rank} case={case}: {name} rel err {err:.3e}"


DISAGREEMENTS = {
    "beta": ["beta", "0.5, 0.25", "ranks 0, 1"],
    "temperature": ["temperature", "1.0, 2.0"],
    "divergence": ["divergence", "'rev_kl', 'fwd_kl'"],
    "teacher-shape": ["teacher_hidden", "found on rank 1", "every rank raises it"],
}


def _disagree_main(rank, world):
    """Each rank passes its own value of one option (or one rank a bad teacher): every rank must raise the same
    error, and the group must still work afterwards. All cases in turn on one group."""
    x = make_pair(6, 5, 7, 8 * world, seed=1)
    w, tw = x.weight[rank * 8:(rank + 1) * 8], x.t_weight[rank * 8:(rank + 1) * 8]
    out = {}
    for what in DISAGREEMENTS:
        opts, th = dict(divergence="jsd"), x.t_hidden
        if what == "beta":
            opts["beta"] = 0.5 if rank == 0 else 0.25
        elif what == "temperature":
            opts["temperature"] = 1.0 + rank
        elif what == "divergence":
            opts = dict(divergence="forward_kl" if rank else "reverse_kl")
        elif what == "teacher-shape" and rank == world - 1:
            th = x.t_hidden[:4]
        try:
            vpce.linear_distillation_loss(x.hidden, w, th, tw, x.target, group=dist.group.WORLD, **opts)
            message = None
        except (ValueError, TypeError) as e:
            message = f"{type(e).__name__}: {e}"
        after = vpce.linear_distillation_loss(x.hidden, w, x.t_hidden, tw, x.target, group=dist.group.WORLD)
        out[what] = (message, float(after))
    return out


def test_disagreeing_ranks_fail_together():
    ranks = run_ranks(_disagree_main, 2, timeout=TIMEOUT)
    for what, words in DISAGREEMENTS.items():
        messages = [r[what][0] for r in ranks]
        assert messages[0] is not None and len(set(messages)) == 1, f"{what}: ranks raised differently: {messages}"
        for word in words:
            assert word in messages[0], f"{what}: {word!r} not in {messages[0]!r}"
        assert ranks[0][what][1] == ranks[1][what][1], f"{what}: the group is usable after the error and agrees"


GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nccl_main(rank, world):
    """bf16 on NCCL, layout given (the device-decided agreement, no host sync): the sharded result against the
    same call on one GPU, replicated and sequence parallel, uneven shards with padding."""
    dev = torch.device("cuda", rank)
    sizes = [4100, 3900][:world]
    x = make_pair(1024 * world, 128, 192, sum(sizes), vocab_size=sum(sizes) - 37, dtype=torch.bfloat16, bias=True,
                  scale=3.0, seed=15)
    c = lambda t: None if t is None else t.to(dev)  # noqa: E731
    out = []
    for divergence, sp in (("forward_kl", False), ("jsd", True), ("reverse_kl", True)):
        opts = dict(divergence=divergence, ce_weight=0.2, temperature=1.3, vocab_size=x.vocab_size)
        mine = slice(rank * 1024, (rank + 1) * 1024)
        h = leaf(c(x.hidden[mine] if sp else x.hidden))
        w = leaf(c(_shard(x.weight, sizes, rank)))
        loss = vpce.linear_distillation_loss(h, w, c(x.t_hidden[mine] if sp else x.t_hidden),
                                             c(_shard(x.t_weight, sizes, rank)), c(x.target),
                                             None, c(_shard(x.t_bias, sizes, rank)), group=dist.group.WORLD,
                                             vocab_start=sum(sizes[:rank]), sequence_parallel=sp, **opts)
        loss.backward()
        h1, w1 = leaf(c(x.hidden)), leaf(c(x.weight))
        one = vpce.linear_distillation_loss(h1, w1, c(x.t_hidden), c(x.t_weight), c(x.target), None, c(x.t_bias),
                                            **opts)
        one.backward()
        want_dx = h1.grad[mine] if sp else h1.grad
        out.append((divergence, sp, rel_err(loss, one), rel_err(h.grad, want_dx),
                    rel_err(w.grad, _shard(w1.grad, sizes, rank))))
    return out


@pytest.mark.skipif(GPUS < 2, reason="needs 2 CUDA GPUs")
def test_nccl_sharded_equals_single_gpu():
    for rank, results in enumerate(run_ranks(_nccl_main, 2, backend="nccl", timeout=TIMEOUT)):
        for divergence, sp, loss_err, dx_err, dw_err in results:
            where = f"rank {rank} {divergence} sp={sp}"
            assert loss_err < 1e-5, f"{where}: loss differs from tp=1 by {loss_err:.2e}"
            # dX is summed over the shards in fp32 and rounded to bf16 once, like tp=1's
            assert dx_err < 1e-2 and dw_err < 1e-2, f"{where}: dX {dx_err:.2e} dW {dw_err:.2e} vs tp=1"
