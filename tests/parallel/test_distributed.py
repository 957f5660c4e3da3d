"""Vocab parallelism on real gloo ranks: the sharded result equals the float64 oracle on the whole vocab.

Each world size runs in one spawn; every rank builds the same full problem from a seed, keeps its shard of
rows (and, with sequence parallelism, its slice of tokens), runs vpce, and checks the loss, the full ``dX`` (or
its slice) and its own ``dW``/``db`` rows against the oracle. Covers even, uneven and padded shards (one rank
all padding), explicit and default ``vocab_start``, sequence parallelism, a TP sub-group inside a bigger world,
every reduction with random upstream gradients, the loss variants, both memory routes, and fp32/bf16 runs
compared with the single-process result.
"""

import zlib

import pytest
import torch
import torch.distributed as dist

import vpce
from distributed import cpu_triton, run_ranks
from vpce.reference import reference, rel_err
from problems import VARIANTS, leaf, make_problem


def cases(world: int) -> list[dict]:
    """Shard layouts and options for one world size: (name, sizes, vocab_size, options...)."""
    even = [24] * world
    uneven = [31, 7, 50, 12][:world]
    out = [
        dict(name="even-mean", sizes=even, reduction="mean"),
        dict(name="even-none-lean", sizes=even, reduction="none", memory_budget="lean"),
        dict(name="uneven-sum-bias", sizes=uneven, reduction="sum", bias=True),
        dict(name="uneven-none-variants", sizes=uneven, reduction="none", opts=VARIANTS["all"], bias=True),
        dict(name="padded-mean-smooth", sizes=even, vocab_size=sum(even) - 5, reduction="mean",
             opts=VARIANTS["smooth"], bias=True),
        dict(name="explicit-start", sizes=uneven, reduction="mean", explicit=True),
        dict(name="ignored-30pct-tiny-chunks", sizes=uneven, reduction="mean", ignore=0.3, memory_budget=1e-7),
        dict(name="all-ignored", sizes=even, reduction="mean", ignore=1.0),
        dict(name="sp-mean", sizes=even, reduction="mean", sp=True),
        dict(name="sp-none-uneven-variants", sizes=uneven, reduction="none", sp=True, opts=VARIANTS["all"]),
        dict(name="sp-lean", sizes=uneven, reduction="sum", sp=True, memory_budget="lean", ignore=0.3),
    ]
    if world >= 2:
        # the last rank's rows are all padding
        out.append(dict(name="last-rank-all-padding", sizes=even, vocab_size=sum(even[:-1]) - 3,
                        reduction="none", opts=VARIANTS["smooth"]))
    return out


def _shard(x, sizes, rank):
    start = sum(sizes[:rank])
    return None if x is None else x[start:start + sizes[rank]]


def _check_case(rank, world, group, case, dtype=torch.float64):
    sizes, red = case["sizes"], case["reduction"]
    rows = sum(sizes)
    vsize = case.get("vocab_size", rows)
    seq, batch = 6 * world, 3
    p = make_problem((seq, batch), 19, rows, dtype=dtype, vocab_size=vsize, bias=case.get("bias", False),
                     ignore_frac=case.get("ignore", 0.1), reduction=red, seed=zlib.crc32(case["name"].encode()) % 1000)
    opts = dict(reduction=red, **case.get("opts", {}))
    sp = case.get("sp", False)
    h = leaf(p.hidden[rank * 6:(rank + 1) * 6] if sp else p.hidden)
    w, b = leaf(_shard(p.weight, sizes, rank)), leaf(_shard(p.bias, sizes, rank))
    explicit = dict(vocab_start=sum(sizes[:rank]), vocab_size=vsize) if case.get("explicit") else \
        dict(vocab_size=None if vsize == rows else vsize)
    loss = vpce.linear_cross_entropy(h, w, p.target, b, group=group, sequence_parallel=sp,
                                     memory_budget=case.get("memory_budget", "auto"), **explicit, **opts)
    (loss * p.grad.to(loss.dtype)).sum().backward()
    ref = reference(p.hidden, p.weight, p.target, p.bias, grad=p.grad, vocab_size=vsize, **opts)
    want_dx = ref.dhidden[rank * 6:(rank + 1) * 6] if sp else ref.dhidden
    pairs = [("loss", loss, ref.loss), ("dX", h.grad, want_dx), ("dW", w.grad, _shard(ref.dweight, sizes, rank))]
    if b is not None:
        pairs.append(("db", b.grad, _shard(ref.dbias, sizes, rank)))
    return [(case["name"], name, rel_err(got, want)) for name, got, want in pairs]


def _rank_main(rank, world, tp):
    """All cases on this rank. With ``tp < world`` the ranks form world // tp independent TP groups."""
    torch.manual_seed(0)
    groups = [dist.new_group(list(range(g * tp, (g + 1) * tp))) for g in range(world // tp)]
    group = groups[rank // tp]
    results = []
    for case in cases(tp):
        results += _check_case(rank % tp, tp, group, case)
    return results


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_sharded_equals_oracle(world):
    for rank_results in run_ranks(_rank_main, world, world):
        for case, name, err in rank_results:
            assert err < 1e-11, f"world={world} case={case}: {name} rel err {err:.3e}"


def test_tp_subgroups_inside_a_bigger_world():
    """4 ranks as 2 TP groups of 2 (data parallel x tensor parallel): each group is independent."""
    for rank_results in run_ranks(_rank_main, 4, 2):
        for case, name, err in rank_results:
            assert err < 1e-11, f"tp=2 of 4 case={case}: {name} rel err {err:.3e}"


def _low_precision_main(rank, world, dtype):
    """Sharded run in ``dtype`` against the same computation on one process (tp=1), on every rank."""
    sizes = [40, 23, 37, 29][:world]
    p = make_problem((4 * world, 2), 64, sum(sizes), dtype=dtype, reduction="none", ignore_frac=0.2, seed=3)
    out = []
    for sp in (False, True):
        h = leaf(p.hidden[rank * 4:(rank + 1) * 4] if sp else p.hidden)
        w = leaf(_shard(p.weight, sizes, rank))
        loss = vpce.linear_cross_entropy(h, w, p.target, group=dist.group.WORLD, sequence_parallel=sp,
                                         reduction="none")
        loss.backward(p.grad.to(loss.dtype))
        h1, w1 = leaf(p.hidden), leaf(p.weight)
        one = vpce.linear_cross_entropy(h1, w1, p.target, reduction="none")
        one.backward(p.grad.to(one.dtype))
        ref = reference(p.hidden, p.weight, p.target, grad=p.grad, reduction="none")
        want_dx = h1.grad[rank * 4:(rank + 1) * 4] if sp else h1.grad
        want_dx64 = ref.dhidden[rank * 4:(rank + 1) * 4] if sp else ref.dhidden
        out.append((sp, rel_err(loss, one), rel_err(h.grad, want_dx), rel_err(w.grad, _shard(w1.grad, sizes, rank)),
                    rel_err(h.grad, want_dx64), rel_err(h1.grad, ref.dhidden)))
    return out


@pytest.mark.parametrize("dtype,loss_tol,grad_tol", [(torch.float32, 1e-6, 1e-5), (torch.bfloat16, 1e-6, 1e-2)])
def test_low_precision_sharded_equals_single_process(dtype, loss_tol, grad_tol):
    for rank_results in run_ranks(_low_precision_main, 2, dtype):
        for sp, loss_err, dx_err, dw_err, dx64_sharded, dx64_single in rank_results:
            where = f"{dtype} sp={sp}"
            assert loss_err < loss_tol, f"{where}: loss differs from tp=1 by {loss_err:.2e}"
            assert dx_err < grad_tol and dw_err < grad_tol, f"{where}: dX {dx_err:.2e} dW {dw_err:.2e} vs tp=1"
            # the sum of shard contributions is rounded once more than tp=1: allow one rounding step
            assert dx64_sharded < 1.5 * dx64_single + 1e-6, f"{where}: dX err {dx64_sharded:.2e} vs {dx64_single:.2e}"


def _triton_chunked_main(rank, world):
    """The Triton route under a group with several token chunks, each run as two sub-chunks whose statistics
    exchanges overlap (fast route: dX summed in forward, chunk by chunk; SP: each chunk's rows reduced to the
    ranks that own them, pieces crossing slice boundaries). fp32 through the interpreter, against float64.

    Chunk and sub-chunk boundaries are put on multiples of 32 rows in this process (``ROW_ALIGN``: 128 by default, a
    GPU kernel's row block; 32 is the interpreter's largest), so a chunk of 4 x 32 = 128 tokens or more is split in
    two and a quarter of the tokens gives the same layout: at world 2, chunks [192 = 96 + 96, 24], the slice
    boundary at 108 inside the first chunk's second half; at world 3, chunks [192 = 96 + 96, 132 = 64 + 68], the
    boundaries at 108 and 216 inside the first chunk's second half and the second chunk's first half; ragged row
    blocks in the last chunk or half; the default budget's one chunk split at 96 / 160."""
    from vpce.backends.triton import softmax as triton_backend

    triton_backend.ROW_ALIGN = 32  # this rank's own process: nothing else sees it
    sizes = [40, 9, 33][:world]
    n = 108 * world  # with sequence parallelism each rank owns 108 rows; chunks of 192 cross those boundaries
    vsize = sum(sizes) - 4  # the last rows are padding
    cols = -(-vsize // world)
    budget = 192 * cols * 4 / 2**30  # fp32 P of 192 tokens: chunks [192, ..., rest], those of 128+ split in two
    out = []
    for name, red, sp, opts, mem, bias in [
        ("replicated-mean-smooth", "mean", False, {"label_smoothing": 0.1}, budget, True),
        ("sp-sum-zloss", "sum", True, {"z_loss": 1e-2}, budget, False),
        ("sp-mean-softcap-default-budget", "mean", True, {"softcap": 4.0}, "auto", False),
        ("replicated-lean", "mean", False, {}, "lean", False),
        ("sp-none", "none", True, {}, budget, True),
    ]:
        p = make_problem(n, 19, sum(sizes), dtype=torch.float32, vocab_size=vsize, bias=bias, ignore_frac=0.2,
                         reduction=red, seed=zlib.crc32(name.encode()) % 1000)
        rows = slice(rank * 108, (rank + 1) * 108)
        h = leaf(p.hidden[rows] if sp else p.hidden)
        w, b = leaf(_shard(p.weight, sizes, rank)), leaf(_shard(p.bias, sizes, rank))
        loss = vpce.linear_cross_entropy(h, w, p.target, b, group=dist.group.WORLD, sequence_parallel=sp,
                                         vocab_size=vsize, reduction=red, memory_budget=mem, backend="triton",
                                         **opts)
        (loss * p.grad.to(loss.dtype)).sum().backward()
        ref = reference(p.hidden, p.weight, p.target, p.bias, grad=p.grad, vocab_size=vsize, reduction=red,
                        **opts)
        want_dx = ref.dhidden[rows] if sp else ref.dhidden
        errs = [rel_err(loss, ref.loss), rel_err(h.grad, want_dx), rel_err(w.grad, _shard(ref.dweight, sizes, rank))]
        if b is not None:
            errs.append(rel_err(b.grad, _shard(ref.dbias, sizes, rank)))
        out.append((name, errs))
    return out


@cpu_triton
@pytest.mark.parametrize("world", [2, 3])
def test_triton_chunked_sharded_equals_oracle(world):
    for rank, results in enumerate(run_ranks(_triton_chunked_main, world)):
        for name, errs in results:
            assert max(errs) < 2e-5, f"world={world} rank={rank} {name}: loss/dX/dW/db rel errs {errs}"


def test_backward_casts_dw_before_it_waits_for_the_dx_sum():
    """The Triton fast route under a group leaves its last dX all-reduce in flight (``FastGrads.dx_sum``):
    ``grads.finish_fast_grads`` scales and casts dW (and db) first, then waits for dX's sum, then scales dX, so
    the collective runs beside the dW cast. A ``FastGrads`` with nothing in flight hands back its dX as it is."""
    from vpce.backends.grads import FastGrads, finish_fast_grads

    order = []
    dx, dw, db = torch.randn(4, 3), torch.randn(5, 3), torch.randn(5)

    class InFlight:  # stands in for parallel.HiddenGradReduce, whose finish() waits for the all-reduces
        def finish(self):
            order.append("wait for dX")
            return dx

    def scale_cast(t, g, dtype):
        order.append("dX" if t is dx else "dW")
        return (t * g).to(dtype)

    g = torch.tensor(0.5)
    want_dx, want_dw, want_db = dx * g, dw * g, db * g
    got_dx, got_dw, got_db = finish_fast_grads(FastGrads(dx, dw, db, InFlight()), g, (torch.bfloat16,) * 3, 6,
                                               None, scale_cast)
    assert order == ["dW", "wait for dX", "dX"], order
    assert torch.equal(got_dx, want_dx.bfloat16()) and torch.equal(got_dw[:5], want_dw.bfloat16()), (got_dx, got_dw)
    assert got_dw.shape == (6, 3) and not got_dw[5].any() and torch.equal(got_db[:5], want_db.bfloat16())
    assert all(a is b for a, b in zip(FastGrads(dx, dw, db).summed(), (dx, dw, db)))
