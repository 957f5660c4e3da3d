"""``memory_budget="auto"``: the fast route only where its buffers fit in free device memory (in one chunk where
that fits too), the same route and chunks on every rank (``vpce.routing.settle_by_memory``, the smallest fit over
the group in ``vpce.parallel.agree``)."""

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vpce
from distributed import cpu_triton, run_ranks
from vpce import parallel, routing
from vpce.options import LossOptions
from vpce.reference import reference, rel_err
from problems import leaf, make_problem

CUDA = torch.cuda.is_available()
TIMEOUT = 180  # seconds: a hung collective fails the test


def test_p_chunk_and_the_weights_cast_copy_share_the_accumulators_size():
    """The Triton fast route's ``P``: the fp32 dW accumulator's size (2 GiB at most); where the Function casts an
    fp32 weight under autocast, ``P`` and that 16-bit copy together (the HF Trainer step's peak); a numeric budget
    as given. The compact route's: at most the 16-bit dW's size and 1 GiB. Equal on every rank: from the columns
    per rank, with the cast in the agreement."""
    shard = parallel.VocabShard(None, 0, 1, 0, 128256, 128256)
    fast = routing.settle(routing.plan_cross_entropy(LossOptions(), (True, True, False), "triton", False, False),
                          routing.FIT_FAST)
    compact = routing.settle(fast_auto(), routing.FIT_COMPACT)

    def chunk(d, cast, opts=LossOptions(), plan=fast):
        return routing.size_cross_entropy(plan, opts, shard, d, torch.bfloat16, cast).sizes.chunk

    assert chunk(2048, False) == 4096  # P = dW = 0.98 GiB
    assert chunk(2048, True) == 2048  # P + the bf16 copy (0.49 GiB) = dW
    assert chunk(4096, False) == 8192  # P = dW = 1.96 GiB
    assert chunk(5120, False) == 8320  # the 2 GiB cap (in multiples of 128 tokens)
    assert chunk(4096, True) == 4096
    assert chunk(4096, False, plan=compact) == 4096  # the 16-bit dW's size: 0.98 GiB
    assert chunk(5120, False, plan=compact) == 4096  # the 1 GiB cap
    assert chunk(1024, False, plan=compact) == 1024  # a small head: its 16-bit dW (0.25 GiB)
    assert chunk(2048, True, LossOptions(memory_budget=0.25)) == chunk(2048, False, LossOptions(memory_budget=0.25))
    tight = parallel.VocabShard(None, 0, 1, 0, 4000, 4000)  # a small head: the 0.25 GiB floor
    assert routing.size_cross_entropy(fast, LossOptions(), tight, 512, torch.bfloat16, True).sizes.chunk == \
        routing.size_cross_entropy(fast, LossOptions(), tight, 512, torch.bfloat16, False).sizes.chunk


def fast_auto(sharded=False):
    return routing.plan_cross_entropy(LossOptions(), (True, True, False), "triton", sharded, False)


def test_how_the_fast_route_finishes_is_the_plans():
    """In one process the fast route writes dX in the hidden's dtype (fp32 for float16, and for ``vpce.library``,
    which scales the held gradients itself); under a group dX is summed in fp32. The compact route (from free
    memory, or a numeric budget) frees ``P`` in forward; the fast route keeps the last ``P`` for backward."""
    one = parallel.VocabShard(None, 0, 1, 0, 1000, 1000)
    two = parallel.VocabShard("group", 0, 2, 0, 500, 1000)
    fast, compact = routing.settle(fast_auto(), routing.FIT_FAST), routing.settle(fast_auto(), routing.FIT_COMPACT)
    lean = routing.plan_cross_entropy(LossOptions(memory_budget="lean"), (True, True, False), "triton", False, False)

    def finish(plan, shard=one, dtype=torch.bfloat16, opts=LossOptions(), **kw):
        p = routing.size_cross_entropy(plan, opts, shard, 64, dtype, **kw)
        return p.compact, p.keep_p, p.dx_in_forward

    assert finish(fast) == (False, True, True)
    assert finish(compact) == (True, False, True)
    assert finish(fast, opts=LossOptions(memory_budget=0.5)) == (True, False, True)
    assert finish(fast, dtype=torch.float32) == (False, True, True)
    assert finish(fast, dtype=torch.float16) == (False, True, False)
    assert finish(fast, held_fp32=True) == (False, True, False)
    assert finish(routing.settle(fast_auto(True), routing.FIT_FAST), two) == (False, True, False)
    assert finish(routing.settle(fast_auto(True), routing.FIT_COMPACT), two) == (True, False, False)
    assert finish(lean)[2] is False
    torch_plan = routing.settle(routing.plan_cross_entropy(LossOptions(), (True, True, False), "torch", False, False),
                                routing.FIT_FAST)
    assert finish(torch_plan)[2] is False


def test_auto_is_left_to_memory_only_on_the_triton_fast_route():
    auto, lean, fast = (LossOptions(memory_budget=b) for b in ("auto", "lean", "fast"))
    needs = (True, True, False)
    assert routing.plan_cross_entropy(auto, needs, "triton", False, False).route == "auto"
    assert routing.plan_cross_entropy(auto, needs, "torch", False, False).route == "fast"
    assert routing.plan_cross_entropy(fast, needs, "triton", False, False).route == "fast"
    assert routing.plan_cross_entropy(lean, needs, "triton", False, False).route == "lean"
    no_grad = routing.plan_cross_entropy(auto, (False,) * 3, "triton", False, False)
    assert no_grad.route == "forward"
    sharded = routing.plan_cross_entropy(auto, needs, "triton", True, False)
    assert routing.settle(sharded, routing.FIT_FAST).dx_reduce == "forward"  # the fast route sums dX in forward
    folded = auto.folded  # the options' logits travel with the plan through every settling
    assert routing.settle(sharded, routing.FIT_LEAN) == routing.Plan("triton", "lean", "region", False, folded=folded)
    assert routing.settle(sharded, routing.FIT_WHOLE) == routing.Plan("triton", "fast", "forward", False, whole=True,
                                                                      folded=folded)
    assert routing.settle(sharded, routing.FIT_COMPACT) == routing.Plan("triton", "fast", "forward", False,
                                                                        compact=True, folded=folded)
    capped = LossOptions(softcap=30.0, logit_scale=0.5)
    assert routing.settle(routing.plan_cross_entropy(capped, needs, "triton", False, False),
                          routing.FIT_FAST).folded == capped.folded
    from vpce.options import LogProbLossOptions

    tempered = LogProbLossOptions(loss_fn=lambda lp, ent: lp, softcap=5.0, temperature=0.7)
    for scope in ("token", "batch"):  # the fast route and the two-pass form carry the loss's logits alike
        o = dataclasses.replace(tempered, scope=scope)
        assert routing.plan_log_prob_loss(o, needs, "triton", False, False).folded == tempered.folded
    # on the CPU (the interpreter) there is no device memory to weigh: the fast route, nothing for the group
    plan, fits = routing.settle_by_memory(sharded, torch.zeros(4, 8), 16, needs, auto, world=2)
    assert plan.route == "fast" and fits is None


def _agree_main(rank, world, fits):
    import torch.distributed as dist

    facts = parallel.CallFacts(entry="ce", fields=(("route", "auto"),), rows=8, vocab_start=8 * rank,
                               vocab_size=8 * world, fast_fits=fits[rank])
    got = parallel.agree(dist.group.WORLD, facts, torch.device("cpu"), read=True).fast_fits
    # a call right after that leaves nothing to memory: the fingerprint keeps its size, and no verdict comes back
    again = parallel.agree(dist.group.WORLD, dataclasses.replace(facts, fast_fits=None), torch.device("cpu"),
                           read=True).fast_fits
    return got, again


@pytest.mark.parametrize("fits", [(2, 2, 2), (2, 1, 2), (1, 0, 2), (0, 0, 0)],
                         ids=["all-whole", "one-chunked", "one-does-not", "none-fit"])
def test_the_group_takes_what_fits_on_every_rank(fits):
    for rank, (got, again) in enumerate(run_ranks(_agree_main, 3, fits)):
        assert got == min(fits), f"rank {rank}: {got} for {fits}"
        assert again is None


@pytest.mark.parametrize("case", ["whole", "too-long", "frozen", "deterministic", "whole-does-not-fit", "compact",
                                  "none-fit", "short", "not-ce"])
def test_auto_takes_what_fits_the_fastest_first(monkeypatch, case):
    """One chunk of every token where its ``P`` is at most the default ``P`` plus the fp32 dW accumulator (the
    Llama-3-8B head at N=16384: two default chunks), dW is needed, it fits in free memory, and the chunking need not
    be deterministic; then the cross-entropy's fast route sizes ``P`` for every token. Where the fast route does not
    fit, the compact one (1 GiB ``P`` chunks, freed in forward) where it does; else the lean route."""
    d, rows = 4096, 128256
    default = 8192  # P = the fp32 dW accumulator's size
    tokens = {"too-long": 2 * default + 128, "short": default}.get(case, 2 * default)
    # in one process: fast 1.96 + 1.96 GiB, compact 1.96 + 0.98 GiB
    budget = {"whole-does-not-fit": 5 * 2**30, "compact": 3.5 * 2**30, "none-fit": 2**30}.get(case, 80 * 2**30)
    monkeypatch.setattr(routing, "_fits", lambda need, device: need <= budget)
    if case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    needs = (True, case != "frozen", False)
    hidden = torch.empty(tokens, d, dtype=torch.bfloat16)
    fit = routing._fit(hidden, tokens, rows, needs, LossOptions(), False, case != "not-ce", single=True)
    want = {"whole": routing.FIT_WHOLE, "compact": routing.FIT_COMPACT, "none-fit": routing.FIT_LEAN}
    assert fit == want.get(case, routing.FIT_FAST), (case, fit)
    plan = routing.settle(routing.plan_cross_entropy(LossOptions(), needs, "triton", False, False), fit)
    shard = parallel.VocabShard(None, 0, 1, 0, rows, rows)
    chunk = routing.size_cross_entropy(plan, LossOptions(), shard, d, torch.bfloat16).sizes.chunk
    want_chunk = {"whole": routing.WHOLE_CHUNK, "compact": 4096}.get(case, default)
    assert chunk == want_chunk or case == "none-fit", (case, chunk)


@pytest.mark.parametrize("scope", ["token", "sequence"])
def test_the_fused_forms_plan_takes_one_chunk_where_it_fits(scope):
    """``linear_log_prob_loss`` (GRPO, GSPO, DPO) sizes its fast route as the cross-entropy's: ``P`` of every token
    where ``"auto"`` found room for it (``Plan.whole``), whole rows of the sequence scope included; the default
    chunk otherwise."""
    from vpce.options import LogProbLossOptions

    d, rows = 4096, 128256
    o = LogProbLossOptions(loss_fn=lambda lp, ent: lp, scope=scope, row=2048)
    plan = routing.plan_log_prob_loss(o, (True, True, False), "triton", False, False)
    shard = parallel.VocabShard(None, 0, 1, 0, rows, rows)
    whole = routing.size_log_prob_loss(routing.settle(plan, routing.FIT_WHOLE), o, shard, d, torch.bfloat16)
    fast = routing.size_log_prob_loss(routing.settle(plan, routing.FIT_FAST), o, shard, d, torch.bfloat16)
    assert whole.whole and whole.sizes.chunk >= routing.WHOLE_CHUNK - 2048, whole.sizes
    assert whole.sizes.chunk % (2048 if scope == "sequence" else 1) == 0
    assert not fast.whole and fast.sizes.chunk == 8192, fast.sizes


def _gpu_scenario():
    """Run in a fresh process (a clean caching allocator: its reserved-but-unused memory counts as free)."""
    # one process: the compact fast route holds the fp32 dW accumulator (1.9 GiB) and a 1 GiB P chunk (three of
    # them); the lean route (vocab-major, N < V) a 0.2 GiB block and fp32 dX (0.19 GiB)
    n, d, v = 12288, 4096, 128000
    p = make_problem(n, d, v, dtype=torch.bfloat16, ignore_frac=0.1, seed=5)
    h, w, t = p.hidden.cuda(), p.weight.cuda(), p.target.cuda()
    from vpce.routing import fast_route_bytes

    need = fast_route_bytes(n, d, v, torch.bfloat16, (True, True, False), LossOptions(), compact=True, single=True)

    def step(budget):
        hh, ww = leaf(h), leaf(w)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        vpce.linear_cross_entropy(hh, ww, t, memory_budget=budget).backward()
        torch.cuda.synchronize()
        return hh.grad, ww.grad, torch.cuda.max_memory_allocated() - base

    ref_dx, ref_dw, lean_peak = step("lean")
    _, _, fast_peak = step("fast")
    assert lean_peak < need < fast_peak + 2**28, (lean_peak, need, fast_peak)
    torch.cuda.empty_cache()
    # leave room for the lean route, not for the fast one (with the route's headroom)
    room = int(0.95 * need / routing.FAST_HEADROOM)
    assert room > 1.15 * lean_peak, (room, lean_peak)
    free = torch.cuda.mem_get_info()[0] + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
    blocker = torch.empty(free - room, dtype=torch.uint8, device="cuda")
    dx, dw, peak = step("auto")
    del blocker
    assert peak < need, f"auto took {peak / 2**30:.2f} GiB: the fast route ({need / 2**30:.2f} GiB) did not fit"
    assert rel_err(dx, ref_dx) == 0 and rel_err(dw, ref_dw) == 0  # the same (lean, deterministic) computation
    torch.cuda.empty_cache()
    _, _, peak = step("auto")  # with the memory back, the fast route
    assert peak >= need - 2**27, f"auto took {peak / 2**30:.2f} GiB with room for the fast route"


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_auto_takes_the_lean_route_where_the_fast_one_does_not_fit():
    here = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here), str(here.parent), str(here.parent.parent),
                                                       os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-c", "import test_memory_route as t; t._gpu_scenario()"], cwd=here,
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
def test_gpu_auto_runs_one_chunk_where_it_fits(monkeypatch):
    """On a GPU with room, ``"auto"`` runs the fast route in one chunk where the default would take two (here
    0.25 GiB ``P`` chunks of 8320 tokens, 9000 tokens), with the loss and gradients of the chunked run within a
    rounding; under deterministic algorithms it keeps the default chunks."""
    from vpce.backends.triton import softmax as triton_backend

    chunks = []
    real = triton_backend.chunk_loop
    monkeypatch.setattr(triton_backend, "chunk_loop",
                        lambda hidden, w, b, chunk, *a, **k: chunks.append(chunk) or real(hidden, w, b, chunk, *a, **k))
    p = make_problem(9000, 512, 16001, dtype=torch.bfloat16, ignore_frac=0.1, seed=3)
    h, w, t = p.hidden.cuda(), p.weight.cuda(), p.target.cuda()

    def step(budget):
        hh, ww = leaf(h), leaf(w)
        loss = vpce.linear_cross_entropy(hh, ww, t, memory_budget=budget)
        loss.backward()
        return loss.detach(), hh.grad, ww.grad

    whole, chunked = step("auto"), step("fast")
    assert chunks == [9000, 8320], chunks
    # GRPO's fused form takes the same one chunk (``linear_log_prob_loss``)
    adv = torch.linspace(-1.0, 1.0, 9, device="cuda")

    def grpo(budget):
        hh, ww = leaf(h.view(9, 1000, -1)), leaf(w)
        out = vpce.linear_grpo_loss(hh, ww, t.view(9, 1000), adv, memory_budget=budget)
        out.loss.backward()
        return out.loss.detach(), hh.grad, ww.grad

    g_whole, g_chunked = grpo("auto"), grpo("fast")
    assert chunks[2:] == [9000, 8320], chunks
    assert rel_err(g_whole[0], g_chunked[0]) < 1e-6
    assert rel_err(g_whole[1], g_chunked[1]) < 2 ** -7 and rel_err(g_whole[2], g_chunked[2]) < 2 ** -7
    del chunks[2:]
    assert rel_err(whole[0], chunked[0]) < 1e-6
    assert rel_err(whole[1], chunked[1]) < 2 ** -7 and rel_err(whole[2], chunked[2]) < 2 ** -7  # within a rounding
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        step("auto")
    finally:
        torch.use_deterministic_algorithms(False)
    assert chunks[2] == 8320, chunks


def test_one_dw_gemm_under_a_group_where_the_extra_finishes_dw():
    """Under a group the fast route keeps every token's gradient in one ``P`` and computes dW in one GEMM only with
    ``memory_budget="auto"``, where the hopper extra finishes dW (no fp32 accumulator), dW is not added into
    ``main_grad``, there is more than one chunk, and that ``P`` is at most the default ``P`` plus the fp32 dW
    accumulator: the Llama-3-8B head at tp=2, N=16384 (two chunks of 8192 tokens)."""
    d, rows, world = 4096, 128256, 2
    shard = parallel.VocabShard(None, 0, world, 0, rows // world, rows)

    def takes(tokens=16384, opts=LossOptions(), hopper=True, defer=True, sharded=True, whole=False):
        plan = routing.settle(routing.plan_cross_entropy(opts, (True, True, False), "triton", sharded, False),
                              routing.FIT_WHOLE if whole else routing.FIT_FAST)
        plan = routing.size_cross_entropy(plan, opts, shard, d, torch.bfloat16)
        return routing.one_weight_grad_gemm(plan, opts, tokens, d, torch.bfloat16, hopper, defer)

    assert routing.size_cross_entropy(routing.settle(routing.plan_cross_entropy(
        LossOptions(), (True, True, False), "triton", True, False), routing.FIT_FAST), LossOptions(), shard, d,
        torch.bfloat16).sizes.chunk == 8192
    assert takes()
    assert not takes(tokens=16384 + 128)  # P would exceed the default's + the accumulator
    assert not takes(tokens=8192)  # one chunk already
    assert not takes(hopper=False)  # cuBLAS would need the fp32 dW buffer beside the larger P
    assert not takes(defer=False)  # dW into main_grad (or not needed)
    assert not takes(sharded=False)  # one process: one chunk only where free memory allows (``_fit``)
    assert not takes(whole=True)  # the group agreed on one chunk
    assert not takes(opts=LossOptions(memory_budget="fast"))  # the documented default chunks
    assert not takes(opts=LossOptions(memory_budget=0.5))


def _one_dw_gemm_main(rank, world, takes, sp, n=232, d=104, loss_kind="cross_entropy"):
    """Rank ``r`` keeps every token's gradient in one ``P`` where ``takes[r]``: the hopper extra's readiness stood
    in, since this CPU has no sm_90 GPU (an fp32 dW is then finished by cuBLAS's GEMM, as on a GPU). Every dW GEMM's
    token count is recorded, and every collective (kind and size) in order. 128-token chunks, each split in two
    for its exchanges. ``loss_kind``: the cross-entropy with label smoothing, or ``linear_log_prob_loss`` (a
    policy-gradient term per token), whose fast route finishes as the cross-entropy's."""
    import dataclasses as dc

    import torch.distributed as dist

    from vpce.backends import grads
    from vpce.backends.triton import engine, softmax

    routing.SIZING = dc.replace(routing.SIZING, fast_p_gib=1e-9, min_p_gib=1e-9)  # P chunks of 128 tokens
    softmax.ROW_ALIGN = 32  # sub-chunks of 64 (the interpreter's row blocks)
    gemms, collectives = [], []
    for module in (engine, grads):  # forward's dW GEMMs, and backward's of a deferred last chunk
        real = module.add_product
        module.add_product = lambda acc, a, b, real=real: gemms.append(a.shape[1]) or real(acc, a, b)
    real_gather, real_all_reduce, real_reduce = parallel.all_gather_tensor, dist.all_reduce, dist.reduce
    parallel.all_gather_tensor = lambda out, x, **kw: collectives.append(("gather", *x.shape)) or \
        real_gather(out, x, **kw)
    dist.all_reduce = lambda t, *a, **kw: collectives.append(("all_reduce", *t.shape)) or real_all_reduce(t, *a, **kw)
    dist.reduce = lambda t, *a, **kw: collectives.append(("reduce", *t.shape, kw.get("dst"))) or \
        real_reduce(t, *a, **kw)
    if takes[rank]:
        routing.extra_facts = lambda hidden, weight: routing.Extra(gemms=True)
    sizes = [64, 48][:world]  # valid rows a multiple of 8 (P's rows 16-byte aligned for the GEMM)
    # chunks [128 = 64 + 64, 104]; P of 232 tokens: (232 - 128) * 4 bytes = 4 d (n=300, d=200: three chunks)
    vsize = sum(sizes) - 8
    p = make_problem(n, d, sum(sizes), dtype=torch.float32, vocab_size=vsize, bias=True, ignore_frac=0.2,
                     seed=11)
    lo = sum(sizes[:rank])
    w, b = leaf(p.weight[lo:lo + sizes[rank]]), leaf(p.bias[lo:lo + sizes[rank]])
    tok = slice(rank * n // world, (rank + 1) * n // world)
    h = leaf(p.hidden[tok] if sp else p.hidden)
    mine = slice(lo, lo + sizes[rank])
    if loss_kind == "log_prob_loss":
        adv = torch.randn(n, generator=torch.Generator().manual_seed(5))
        loss = vpce.linear_log_prob_loss(h, w, p.target, lambda lp, ent, adv: -lp * adv, b, inputs={"adv": adv},
                                         group=dist.group.WORLD, vocab_size=vsize, sequence_parallel=sp,
                                         backend="triton")
        (loss * 0.75).backward()
        hr, wr, br = (x.double().requires_grad_() for x in (p.hidden, p.weight[:vsize], p.bias[:vsize]))
        keep = p.target != -100
        lq = (hr @ wr.t() + br).log_softmax(-1)
        want = -(torch.where(keep, lq.gather(1, p.target.clamp(min=0)[:, None])[:, 0], 0) * adv.double()).sum()
        (want * 0.75).backward()
        pad = lambda g: torch.cat([g, g.new_zeros(sum(sizes) - vsize, *g.shape[1:])])  # noqa: E731
        errs = (rel_err(loss, want), rel_err(h.grad, hr.grad[tok] if sp else hr.grad),
                rel_err(w.grad, pad(wr.grad)[mine]), rel_err(b.grad, pad(br.grad)[mine]))
        return gemms, errs, collectives
    loss = vpce.linear_cross_entropy(h, w, p.target, b, group=dist.group.WORLD, vocab_size=vsize,
                                     sequence_parallel=sp, label_smoothing=0.1, backend="triton")
    (loss * 0.75).backward()
    ref = reference(p.hidden, p.weight, p.target, p.bias, vocab_size=vsize, label_smoothing=0.1)
    errs = (rel_err(loss, ref.loss), rel_err(h.grad, 0.75 * (ref.dhidden[tok] if sp else ref.dhidden)),
            rel_err(w.grad, 0.75 * ref.dweight[mine]), rel_err(b.grad, 0.75 * ref.dbias[mine]))
    return gemms, errs, collectives


@cpu_triton
@pytest.mark.parametrize("takes,sp,n,d", [((True, True), False, 232, 104), ((True, False), False, 232, 104),
                                         ((False, True), True, 232, 104), ((True, False), False, 300, 200),
                                         ((False, True), True, 300, 200)],
                         ids=["both", "rank0-only", "rank1-only-sp", "rank0-only-3-chunks", "rank1-only-sp-3-chunks"])
@pytest.mark.parametrize("loss_kind", ["cross_entropy", "log_prob_loss"])
def test_one_dw_gemm_changes_no_collective(takes, sp, n, d, loss_kind):
    """A rank that keeps every token's gradient in one ``P`` issues the same exchanges and dX sums, of the same
    sizes in the same order, as one that does not (the choice is each rank's own, from its own extra): ranks that
    differ finish together, within the timeout, each exact against float64; the one that takes it runs one dW
    GEMM over every token. The same for ``linear_log_prob_loss``'s fast route."""
    per_rank = run_ranks(_one_dw_gemm_main, 2, takes, sp, n, d, loss_kind, timeout=TIMEOUT)
    counts = [min(128, n - s) for s in range(0, n, 128)]
    for rank, (gemms, errs, _) in enumerate(per_rank):
        assert gemms == ([n] if takes[rank] else counts), (rank, gemms)
        assert max(errs) < 2e-5, (rank, errs)
    assert per_rank[0][2] == per_rank[1][2], (per_rank[0][2], per_rank[1][2])
    # per chunk: its statistics exchanges (4 packed rows with label smoothing, else 3; two halves of a 128-token
    # chunk), then its dX sum (its pieces, one per owning rank, under sequence parallelism)
    packed = 4 if loss_kind == "cross_entropy" else 3
    want = [e for c in counts for e in ([("gather", c // 2)] * 2 if c >= 128 else [("gather", c)]) + [("sum", c)]]
    got = [("gather", shape[1]) if kind == "gather" else ("sum", shape[0]) for kind, *shape in per_rank[0][2]
           if kind != "gather" or shape[0] == packed]  # not the agreement, nor the sequence-parallel hidden states
    assert _sums_merged(got) == want, (got, want)


def _sums_merged(pairs: list) -> list:
    """``(kind, rows)`` pairs with adjacent sums merged (their rows added)."""
    out = []
    for kind, rows in pairs:
        if out and out[-1][0] == kind == "sum":
            out[-1] = (kind, out[-1][1] + rows)
        else:
            out.append((kind, rows))
    return out


def _finish(tokens=16384, compact=False, sharded=False, main_grad=False, quack=True, epilogue=True,
            needs=(True, True, False), route="fast", dtype=torch.bfloat16, opts=LossOptions(), bias=False,
            stats_only=True, rows=128256):
    """``routing.finish_fast`` on the Llama-3-8B head (one process, or rank 0 of two), the plan as the API sizes it;
    ``quack``, ``epilogue``: the ``hopper`` extra's facts (``routing.Extra``)."""
    shard = parallel.VocabShard("group", 0, 2, 0, rows // 2, rows) if sharded else \
        parallel.VocabShard(None, 0, 1, 0, rows, rows)
    plan = routing.plan_cross_entropy(opts, needs, "triton", sharded, False)
    plan = routing.settle(plan, routing.FIT_COMPACT if compact else routing.FIT_FAST)
    if route != "fast":
        plan = dataclasses.replace(plan, route=route)
    plan = routing.size_cross_entropy(plan, opts, shard, 4096, dtype)
    return routing.finish_fast(plan, opts, tokens, 4096, dtype, needs, shard.valid_rows, sharded, main_grad,
                               routing.Extra(quack, epilogue), bias, stats_only)


def test_the_fast_routes_finish_is_decided_once_in_the_plan():
    """How the gradients are handed back, one decision per call (``routing.Finish``): the last dW GEMM waits for
    backward where the hopper extra takes it and ``P`` may stay (the fast route, not the compact one, or one
    chunk); dX's GEMM too with one chunk in one process; the mean's ``1/count`` goes into ``P`` where dX is written
    in forward; never into ``main_grad``, never without the extra, never on the speculative route."""
    fast = _finish()  # two chunks of 8192 tokens
    assert (fast.defer_dw, fast.defer_dx, fast.fold_mean, fast.one_dw, fast.epilogue) == (True, False, True, False,
                                                                                          True)
    one = _finish(tokens=8192)
    assert (one.defer_dw, one.defer_dx, one.fold_mean) == (True, True, False)
    compact = _finish(compact=True)  # chunks of 4096 tokens, each P freed in forward
    assert (compact.defer_dw, compact.defer_dx, compact.fold_mean) == (False, False, True)
    assert _finish(tokens=4096, compact=True).defer_dw  # one chunk: no accumulator to keep P beside
    no_quack = _finish(quack=False, epilogue=False)
    assert no_quack == routing.Finish(fold_mean=True)
    assert not _finish(main_grad=True).defer_dw and not _finish(main_grad=True).defer_dx
    assert not _finish(needs=(False, True, False)).defer_dx  # frozen hidden: no dX
    assert _finish(route="speculative") == routing.Finish(epilogue=True)  # its backward adds to the accumulator
    assert _finish(opts=LossOptions(reduction="sum")).fold_mean is False
    group = _finish(sharded=True)  # tp=2: the whole P and one dW GEMM under "auto" with the extra
    assert (group.one_dw, group.defer_dw, group.defer_dx, group.fold_mean) == (True, True, False, False)
    assert not _finish(sharded=True, quack=False).one_dw
    # quack reads P only where its rows are 16-byte aligned (TMA): V_local a multiple of 8 in bf16
    assert not _finish(rows=128257).defer_dw and _finish(rows=128264).defer_dw
    # the statistics in the epilogue: the extra's fact, no bias, P's rows aligned, no statistic the loss needs first
    # (``linear_log_prob_loss`` with the entropy), a logit scale only beside a soft cap, under a group no argmax
    # test (its maxima are over the ranks; the entropy comes from the gradient pass there)
    assert not _finish(epilogue=False).epilogue
    assert not _finish(bias=True).epilogue and _finish(bias=True).defer_dw
    assert not _finish(rows=128252).epilogue
    assert not _finish(stats_only=False).epilogue
    assert not _finish(opts=LossOptions(logit_scale=0.5)).epilogue
    assert _finish(opts=LossOptions(logit_scale=0.5, softcap=30.0)).epilogue
    assert _finish(opts=LossOptions(metrics=("entropy",))).epilogue
    assert _finish(opts=LossOptions(metrics=("entropy",)), sharded=True).epilogue
    assert _finish(opts=LossOptions(metrics=("token_accuracy",))).epilogue
    assert not _finish(opts=LossOptions(metrics=("entropy", "token_accuracy")), sharded=True).epilogue


@cpu_triton
def test_the_hopper_extra_is_asked_once_per_call_and_only_on_a_fast_route(monkeypatch):
    """``routing.plan_finish`` asks the extra's facts (``routing.extra_facts``) once per fast-route call and
    never for a route that forms no gradient in forward (nor for a rank whose shard holds only padding)."""
    asked = []
    monkeypatch.setattr(routing, "extra_facts", lambda h, w: asked.append(tuple(w.shape)) or routing.Extra())
    p = make_problem(40, 16, 96, dtype=torch.float32, ignore_frac=0.2, seed=2)
    for budget, want in (("auto", [(96, 16)]), ("lean", [])):
        asked.clear()
        h, w = leaf(p.hidden), leaf(p.weight)
        vpce.linear_cross_entropy(h, w, p.target, memory_budget=budget, backend="triton").backward()
        assert asked == want, (budget, asked)
    asked.clear()
    with torch.no_grad():
        vpce.linear_cross_entropy(p.hidden, p.weight, p.target, backend="triton")
    assert asked == [], asked


def test_the_compiled_graphs_plan_is_the_routings():
    """Inside a compiled graph (``vpce.library``'s ops) the plan comes from ``vpce.routing`` too: ``"auto"`` is the
    fast route in default chunks whatever the free memory (never one chunk, never the compact form), the held
    gradients stay fp32 (the op scales them: no dX in the hidden's dtype), and a numeric budget keeps its compact
    chunks; the distillation's plan is the one outside."""
    from vpce.options import DistillOptions

    rows, d = 128256, 4096
    shard = parallel.VocabShard(None, 0, 1, 0, rows, rows)
    needs = (True, True, False)
    auto = routing.plan_compiled_cross_entropy(LossOptions(), needs, "triton", shard, d, torch.bfloat16, False)
    assert (auto.route, auto.whole, auto.compact, auto.dx_in_forward) == ("fast", False, False, False)
    outside = routing.size_cross_entropy(routing.settle(routing.plan_cross_entropy(LossOptions(), needs, "triton",
                                                                                   False, False), routing.FIT_FAST),
                                         LossOptions(), shard, d, torch.bfloat16)
    assert auto.sizes == outside.sizes and outside.dx_in_forward
    numeric = routing.plan_compiled_cross_entropy(LossOptions(memory_budget=0.5), needs, "triton", shard, d,
                                                  torch.bfloat16, False)
    assert numeric.compact and numeric.sizes.chunk == round(0.5 * 2**30 / (rows * 2)) // 128 * 128
    lean = routing.plan_compiled_cross_entropy(LossOptions(memory_budget="lean"), needs, "triton", shard, d,
                                               torch.bfloat16, False)
    assert lean.route == "lean"
    o = DistillOptions(reduction="none")
    got = routing.plan_compiled_distillation(o, needs, "triton", shard, d, torch.bfloat16)
    assert got == routing.size_distillation(routing.plan_distillation("none", False, needs, "triton", False, False),
                                            o, shard, d, torch.bfloat16)
    assert got.route == "lean"


@pytest.mark.parametrize("case", ["token", "sequence", "batch", "lean", "torch", "no-grad", "fixed"])
def test_the_log_prob_losss_route_is_the_plans(case):
    """``linear_log_prob_loss``: the fast route (left to memory under ``"auto"``) on the Triton backend for scopes
    ``"token"`` and ``"sequence"``, else the two-pass form (the lean route), decided in ``vpce.routing``."""
    from vpce.options import LogProbLossOptions

    opts = LogProbLossOptions(loss_fn=lambda logp, ent: logp, scope="batch" if case == "batch" else
                              "sequence" if case == "sequence" else "token",
                              memory_budget={"lean": "lean", "fixed": 0.5}.get(case, "auto"))
    needs = (False, False, False) if case == "no-grad" else (True, True, False)
    plan = routing.plan_log_prob_loss(opts, needs, "torch" if case == "torch" else "triton", False, False)
    want = {"token": "auto", "sequence": "auto", "fixed": "fast", "no-grad": "forward"}.get(case, "lean")
    assert plan.route == want, (case, plan)


def test_whether_to_speculate_is_asked_once_in_the_plan():
    """``reduction="none"`` and ``linear_log_probs``: the plan asks the call site's history
    (``vpce.speculation.decide``) and carries its record (``Plan.history``); a site's first call takes the lean
    route, one after a uniform backward the speculative route; ``memory_budget="lean"``, a group and the torch
    backend never ask."""
    from vpce import speculation

    needs = (True, True, False)
    none, lean = LossOptions(reduction="none"), LossOptions(reduction="none", memory_budget="lean")
    speculation.reset()
    try:
        site = routing.Site("ce", torch.zeros(8, 4), ("options",))
        first = routing.plan_cross_entropy(none, needs, "triton", False, False, site)
        assert first.route == "lean" and first.history is not None
        first.history.report(torch.ones((), dtype=torch.bool))  # a uniform backward (read at once on a CPU)
        second = routing.plan_cross_entropy(none, needs, "triton", False, False, site)
        assert second.route == "speculative" and second.history is first.history
        assert routing.plan_cross_entropy(lean, needs, "triton", False, False, site).history is None
        sharded = routing.plan_cross_entropy(none, needs, "triton", True, False, site)
        assert sharded.route == "lean" and sharded.history is None
        assert routing.plan_cross_entropy(none, needs, "torch", False, False, site).history is None
        assert routing.plan_cross_entropy(LossOptions(), needs, "triton", False, False, site).history is None
        lp_site = routing.Site("logprob", torch.zeros(8, 4), ("options",))
        lp = routing.plan_log_probs(needs, "triton", False, False, lp_site)
        assert lp.route == "lean" and lp.history is not None
        assert routing.plan_log_probs(needs, "triton", False, False, None).history is None
    finally:
        speculation.reset()
