"""Never a hang, never a silent wrong answer across ranks (gloo ranks, spawned with timeouts so that a hang fails).

Each case is a mistake or an edge a real job can hit: shard layouts that change between calls, process groups
created and destroyed in a loop, sub-groups used alternately, any one argument that differs between ranks, an
error that only one rank can see, ``-inf`` logits over whole shards or tiles. Every rank must return the exact
result, or every rank must raise the same clear error within seconds.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import vpce
from distributed import cpu_triton, run_ranks
from problems import leaf, make_problem
from vpce import parallel
from vpce.reference import reference, reference_log_probs, rel_err

CUDA = torch.cuda.is_available()
BACKENDS = ["torch", "triton"]
TIMEOUT = 120  # seconds for a whole spawn; a hung collective fails the test


def _sharded_loss(rank, sizes, p, *, group, layout=(), backend="torch", **opts):
    """This rank's call on its shard of ``p`` (``layout``: which of vocab_start/vocab_size to pass); returns the
    relative errors of (loss, dX, dW) against the float64 reference."""
    start = sum(sizes[:rank])
    h, w = leaf(p.hidden), leaf(p.weight[start:start + sizes[rank]])
    layout = {k: v for k, v in (("vocab_start", start), ("vocab_size", p.vocab_size)) if k in layout}
    loss = vpce.linear_cross_entropy(h, w, p.target, group=group, backend=backend, **layout, **opts)
    loss.backward()
    ref = reference(p.hidden, p.weight, p.target, vocab_size=p.vocab_size, **opts)
    return (rel_err(loss, ref.loss), rel_err(h.grad, ref.dhidden),
            rel_err(w.grad, ref.dweight[start:start + sizes[rank]]))


# -- layouts that change between calls, groups created and destroyed, sub-groups ----------------------------------

def _layout_changes(rank, world, backend):
    g = dist.group.WORLD
    errs = []
    for sizes in ([15, 12, 9], [9, 9, 9], [15, 12, 9], [9, 9, 9], [4, 20, 12]):
        p = make_problem(11, 8, sum(sizes), dtype=torch.float64 if backend == "torch" else torch.float32, seed=3)
        for layout in ((), ("vocab_start",), ("vocab_size",), ("vocab_start", "vocab_size")):
            errs.append(_sharded_loss(rank, sizes, p, group=g, backend=backend, layout=layout))
    return errs


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=cpu_triton)])
def test_layout_changes_between_calls(backend):
    """Uneven then even shards and back, without ``vocab_start``: the layout is learned per call, never from a
    rank-local cache (a hit on one rank and a miss on another desynchronized the collectives)."""
    tol = 1e-10 if backend == "torch" else 2e-5
    for rank, errs in enumerate(run_ranks(_layout_changes, 3, backend, timeout=TIMEOUT)):
        for i, e in enumerate(errs):
            assert max(e) < tol, f"rank {rank}, call {i}: errors (loss, dX, dW) {e}"


def _groups_in_a_loop(rank, world):
    out = []
    for round_, sizes in enumerate(([12, 12, 12], [8, 8, 8], [12, 12, 12], [5, 11, 4], [8, 8, 8])):
        g = dist.new_group(list(range(world)))
        p = make_problem(7, 6, sum(sizes), dtype=torch.float64, seed=round_)
        out.append(_sharded_loss(rank, sizes, p, group=g))
        dist.destroy_process_group(g)
    # two sub-groups used alternately by rank 1 ({0, 1} and {1, 2}), each with its own layout
    a, b = dist.new_group([0, 1]), dist.new_group([1, 2])
    for i in range(4):
        for grp, members, sizes in ((a, [0, 1], [10, 6]), (b, [1, 2], [7, 14])):
            if rank in members:
                p = make_problem(5, 6, sum(sizes), dtype=torch.float64, seed=10 + i)
                out.append(_sharded_loss(members.index(rank), sizes, p, group=grp))
    return out


def test_groups_created_and_destroyed_and_sub_groups():
    """A destroyed group's id() is reused by the next one: no layout may survive its group. Sub-groups that share
    a rank and differ in layout, used alternately."""
    for rank, errs in enumerate(run_ranks(_groups_in_a_loop, 3, timeout=TIMEOUT)):
        for i, e in enumerate(errs):
            assert max(e) < 1e-10, f"rank {rank}, call {i}: errors (loss, dX, dW) {e}"


# -- any one argument that differs between ranks -------------------------------------------------------------------

def _base_call(rank):
    p = make_problem(6, 8, 20, dtype=torch.float32, seed=1)
    world = dist.get_world_size()
    sizes = [20 // world + (r < 20 % world) for r in range(world)]
    start = sum(sizes[:rank])
    return dict(hidden=leaf(p.hidden), weight=leaf(p.weight[start:start + sizes[rank]]), target=p.target.clone())


def _mismatch(rank, key):
    """Rank 1 changes one thing; returns what each rank saw: ('ok', loss) or (error type, message)."""
    args = _base_call(rank)
    call = vpce.linear_cross_entropy
    if rank == 1 and key != "none":
        if key == "hidden tokens":
            args["hidden"] = leaf(torch.randn(7, 8))
            args["target"] = torch.zeros(7, dtype=torch.int64)
        elif key == "hidden size":
            args["hidden"], args["weight"] = leaf(torch.randn(6, 9)), leaf(torch.randn(8, 9))
        elif key == "hidden dtype":
            args["hidden"] = leaf(args["hidden"].detach().double())
            args["weight"] = leaf(args["weight"].detach().double())
            args["backend"] = "torch"
        elif key == "target":
            args["target"][2] = (args["target"][2] + 1) % 20
        elif key == "bad target":
            args["target"][4] = 20
        elif key == "vocab_start":  # an overlap: rank 1 claims rows that rank 0 holds
            args.update(vocab_start=1)
        elif key == "local error":
            args["reduction"] = "avg"
        elif key == "requires_grad":
            args["hidden"] = args["hidden"].detach()
        elif key == "class_weight":  # only rank 1 weights its classes
            args["class_weight"] = torch.rand(args["weight"].shape[0])
        elif key == "weight cast":  # under autocast only rank 1's weight is already bf16 (the others' are cast)
            args["weight"] = leaf(args["weight"].detach().bfloat16())
        else:
            args.update(dict(MISMATCHES)[key])
    if key == "vocab_start" and rank != 1:
        world = dist.get_world_size()
        args.update(vocab_start=sum(20 // world + (r < 20 % world) for r in range(rank)))
    try:
        # "weight cast": every rank under CPU autocast, the chunk sizes hang on the cast (vpce.routing._fast_chunk)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=key == "weight cast"):
            loss = call(args.pop("hidden"), args.pop("weight"), args.pop("target"), group=dist.group.WORLD, **args)
        return ("ok", float(loss.sum()))
    except (ValueError, TypeError) as e:
        return (type(e).__name__, str(e))


MISMATCHES = [
    ("z_loss", dict(z_loss=1e-3)),
    ("reduction", dict(reduction="sum")),
    ("label_smoothing", dict(label_smoothing=0.1)),
    ("softcap", dict(softcap=5.0)),
    ("ignore_index", dict(ignore_index=3)),
    ("memory_budget", dict(memory_budget="lean")),
    ("backend", dict(backend="triton")),
    ("vocab_size", dict(vocab_size=19)),
    ("sequence_parallel", dict(sequence_parallel=True)),
    ("logit_scale", dict(logit_scale=2.0)),
    ("return_token_accuracy", dict(return_token_accuracy=True)),
    ("token_scaling", dict(token_scaling=True)),
]
OTHER = ["hidden tokens", "hidden size", "hidden dtype", "target", "bad target", "vocab_start", "local error",
         "requires_grad", "class_weight", "weight cast"]
EXPECT = {  # the field the shared error must name
    "hidden tokens": "hidden", "hidden size": "hidden", "hidden dtype": "dtype", "target": "target",
    "bad target": "target: expected ids in [0, 20)", "vocab_start": "vocab_start", "local error": "reduction",
    "requires_grad": "requires_grad", "vocab_size": "vocab_size", "sequence_parallel": "sequence_parallel",
}


def _mismatches(rank, world, keys):
    """Every case in turn on the same ranks: after an agreed error the ranks must still be in step."""
    return [_mismatch(rank, key) for key in keys] + [_mismatch(rank, "none")]


@pytest.mark.parametrize("world", [2, 4])
def test_one_argument_differs_between_ranks(world):
    """For each single difference, every rank raises the same ValueError/TypeError naming the field, within
    seconds; none hangs, none returns a value (a different z_loss gave each rank its own loss; a different route
    gave dX wrong by 80-300 %). A last, consistent call still works on the same ranks."""
    keys = [k for k, _ in MISMATCHES] + OTHER
    per_rank = run_ranks(_mismatches, world, keys, timeout=TIMEOUT)
    for i, key in enumerate(keys):
        seen = [r[i] for r in per_rank]
        assert "ok" not in {s[0] for s in seen}, f"{key}: a rank returned a loss: {seen}"
        assert len(set(seen)) == 1, f"{key}: ranks raised different errors: {seen}"
        assert seen[0][0] in ("ValueError", "TypeError"), seen[0]
        want = EXPECT.get(key, key)
        assert want in seen[0][1], f"{key}: {want!r} not in {seen[0][1]!r}"
    last = [r[-1] for r in per_rank]
    assert last[0][0] == "ok" and len(set(last)) == 1, f"the consistent call after the errors: {last}"


def _device_verdict(rank, world, differ):
    """The agreement decided on the device (no host read): a disagreement gives a NaN poison on every rank."""
    facts = parallel.CallFacts(entry="ce", fields=(("z_loss", 0.1 * rank if differ else 0.0),), rows=10,
                               vocab_start=10 * rank, vocab_size=20, target=torch.arange(5))
    pending = parallel.agree(dist.group.WORLD, facts, torch.device("cpu"), read=False).poison
    assert isinstance(pending, parallel.PendingPoison)  # left in flight: the call's first GEMM starts beside it
    # the first statistics exchange comes after it on every rank, and its combine resolves the verdict
    shard = parallel.VocabShard(dist.group.WORLD, rank, world, 10 * rank, 10, 20)
    packed = torch.stack([torch.full((3,), float(rank)), torch.ones(3), torch.full((3,), -math.inf)])
    st = parallel.start_stats_exchange(packed, 0, shard, pending).wait()
    return float(parallel.poison_value(pending)), math.isnan(float(st.lse[0]))


@pytest.mark.parametrize("differ", [False, True])
def test_device_verdict_is_nan_on_every_rank(differ):
    got = run_ranks(_device_verdict, 2, differ, timeout=TIMEOUT)
    assert all(math.isnan(g) and nan for g, nan in got) if differ else got == [(0.0, False), (0.0, False)]


def _device_verdict_with_error(rank, world):
    """On the device path a rank with an argument error still sends its fingerprint, then raises its own error;
    the others get NaN."""
    error = ValueError("reduction: expected one of ('mean', 'sum', 'none'), got 'avg'") if rank == 1 else None
    facts = parallel.CallFacts(entry="ce", rows=10, vocab_start=10 * rank, vocab_size=20, target=torch.arange(5),
                               error=error)
    try:
        agreement = parallel.agree(dist.group.WORLD, facts, torch.device("cpu"), read=False)
        return float(parallel.poison_value(agreement.poison))
    except ValueError as e:
        return str(e)


def test_device_verdict_with_an_argument_error():
    got = run_ranks(_device_verdict_with_error, 2, timeout=TIMEOUT)
    assert math.isnan(got[0]) and "reduction" in got[1], got


# -- -inf logits over whole shards and tiles ----------------------------------------------------------------------

def _neg_inf_shards(rank, world, backend, entry):
    sizes = [40, 24, 36][:world]
    v = sum(sizes)
    p = make_problem(9, 8, v, dtype=torch.float64 if backend == "torch" else torch.float32, bias=True, seed=4)
    bias = p.bias.clone()
    bias[sizes[0]:] = -math.inf  # every rank but the first masks all its rows
    bias[3:35] = -math.inf       # ... and inside the first, a full 32-column tile
    target = p.target.clone() % 3  # the targets keep finite logits
    start = sum(sizes[:rank])
    sl = slice(start, start + sizes[rank])
    h, w, b = leaf(p.hidden), leaf(p.weight[sl]), leaf(bias[sl])
    if entry == "ce":
        loss = vpce.linear_cross_entropy(h, w, target, b, group=dist.group.WORLD if world > 1 else None,
                                         backend=backend, label_smoothing=0.0)
        loss.backward()
        ref = reference(p.hidden, p.weight, target, bias)
        return rel_err(loss, ref.loss), rel_err(h.grad, ref.dhidden), rel_err(w.grad, ref.dweight[sl])
    logp, ent = vpce.linear_log_probs(h, w, target, b, group=dist.group.WORLD if world > 1 else None,
                                      backend=backend, return_entropy=True)
    g1 = torch.linspace(-1, 1, 9, dtype=torch.float64)
    (logp * g1.to(logp.dtype)).sum().add((ent * g1.flip(0).to(ent.dtype)).sum()).backward()
    r_logp, r_ent, ref = reference_log_probs(p.hidden, p.weight, target, bias, g_logp=g1, g_ent=g1.flip(0))
    return (rel_err(logp, r_logp), rel_err(ent, r_ent), rel_err(h.grad, ref.dhidden),
            rel_err(w.grad, ref.dweight[sl]))


def _neg_inf_both(rank, world, backend):
    return [_neg_inf_shards(rank, world, backend, entry) for entry in ("ce", "log_probs")]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world", [1, 2, 3])
def test_neg_inf_shards_and_tiles_are_exact(world, backend):
    """A ``-inf`` bias over whole shards (a legitimate vocab mask) and over a whole tile: finite and exact, at every
    tp, for the loss and for the log-probabilities with the entropy (the exp(z - m) with m = -inf gave NaN)."""
    if backend == "triton" and CUDA:
        pytest.skip("gloo ranks run the Triton kernels through the CPU interpreter")
    tol = 1e-10 if backend == "torch" else 2e-5
    for rank, per_entry in enumerate(run_ranks(_neg_inf_both, world, backend, timeout=TIMEOUT)):
        for entry, e in zip(("ce", "log_probs"), per_entry):
            assert max(e) < tol, f"rank {rank}, {entry}: errors {e}"


def test_all_logits_neg_inf_is_not_finite():
    """Every logit -inf for a token gives no finite loss (torch's own cross_entropy gives NaN)."""
    p = make_problem(5, 4, 12, dtype=torch.float64, seed=2)
    bias = torch.full((12,), -math.inf, dtype=torch.float64)
    want = torch.nn.functional.cross_entropy(p.hidden @ p.weight.t() + bias, p.target, reduction="none")
    assert not torch.isfinite(want).any()
    for backend in ("torch",) if CUDA else BACKENDS:
        loss = vpce.linear_cross_entropy(p.hidden.float(), p.weight.float(), p.target, bias.float(),
                                         reduction="none", backend=backend)
        assert not torch.isfinite(loss).any(), backend


def test_gemm_path_is_decided_by_capability(monkeypatch):
    """The fp32-output GEMM path is a capability of the device type, probed once on 1x1 tensors; an error in a real
    GEMM (an out-of-memory, say) propagates and never switches the path (a flag that flipped on any RuntimeError
    could differ between ranks)."""
    from vpce.backends import gemm

    assert gemm.has_mixed_gemm("cpu") is False
    a = torch.randn(4, 8, dtype=torch.bfloat16)
    b = torch.randn(8, 3, dtype=torch.bfloat16)
    want = a.float() @ b.float()
    torch.testing.assert_close(gemm.mm_out(a, b, torch.float32), want)

    def oom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory. Tried to allocate 20.00 GiB")
    monkeypatch.setattr(torch.Tensor, "addmm_", oom)
    with pytest.raises(RuntimeError, match="out of memory"):
        gemm.mm_out(a, b, torch.float32)
    monkeypatch.undo()
    assert gemm.has_mixed_gemm("cpu") is False
    torch.testing.assert_close(gemm.mm_out(a, b, torch.float32), want)
