"""``python -m vpce.bench --tp`` under torchrun: the vocab-parallel rows, side by side, measured on every rank.

The vocab is sharded over every process of the launch (``tp`` = the world size; one process works too):

    torchrun --standalone --nproc-per-node K -m vpce.bench --tp [--sp] [--shapes ...] [--methods ...]

Each rank uses NCCL on ``cuda:LOCAL_RANK``, or gloo on the CPU (``--device cpu``), with the collective environment
of ``launch_env.set_collective_env`` (NVLink multicast off; NCCL on a high-priority stream unless the caller set
``TORCH_NCCL_HIGH_PRIORITY``). Per shape:

1. **Inputs.** The same full problem as the single-GPU benchmark (``harness.make_problem``, drawn from ``(seed, N,
   D, V)``, so the problem does not depend on ``tp``). It is drawn on every rank, and ``x`` and the targets are
   then broadcast from rank 0, so the replicated inputs are bitwise identical on every rank. Rank ``r`` keeps
   rows ``[start_r, start_r + rows_r)`` of ``w``, ``rows_r = V // tp + (r < V % tp)``: equal shards when ``tp``
   divides ``V``, and off by one row otherwise (rows that need equal shards are then ``missing``). The hidden
   input of a row is all of ``x`` (hidden replicated) or, with ``--sp``, the rank's ``N/tp`` slice of the tokens
   (Megatron's sequence parallelism); the targets are always full.
2. **Float64 reference** (``vpce.reference.chunked_reference``), per rank on its shard, in token chunks: the
   shard's float64 logits, their max all-reduced, then the sum of exponentials and the target logit all-reduced
   together; the global ``lse``; ``g = (softmax - onehot) / N``; this shard's part of ``dX`` (``g @ w_shard``)
   all-reduced in float64; ``dW`` of the shard accumulated in float64. That is the full-vocab float64 loss and
   gradients of the same problem, so ``ref_loss`` is the same at every ``tp``.
3. **Per-rank floor**: the three GEMMs of exact fwd+bwd on this rank's shard, ``N x D x V/tp`` (``runner.
   measure_floor``), with no communication. For reference the shape record also has ``comm``: the time of the
   collective that every row's step must contain, alone: the ``[N, D]`` ``dX`` all-reduce (hidden replicated), or
   the hidden all-gather plus the ``dX`` reduce-scatter (``--sp``), in the run's dtype.
4. **Rows** (``vpce.bench.methods``; ``--methods all`` means every row with a vocab-parallel form): built, one
   step checked against the reference, then timed and its peak memory taken, on every rank (the phases of
   ``runner.fwd_bwd_phases``). Each row's status is agreed between ranks after every phase
   (``all_gather_object``): a row that is missing or that fails on any rank is reported by every rank, with that
   rank's reason, and skipped by all, so that the ranks' collectives stay in step. A failure inside a step on
   some ranks only cannot be recovered this way (the others wait inside a collective): the process-group
   ``--timeout`` then ends the run, and the JSON keeps every shape finished before.
5. **Time.** As the single-GPU benchmark (``harness.measure``), and every rank runs the same steps: the warmup
   estimate is all-reduced (max) before the number of timed steps is chosen, and that all-reduce starts the timed
   steps together. A rank's ``ms`` is the median of its own steps (CUDA events on its device); the table shows,
   for each row, the **maximum over ranks** of these per-rank medians, and its multiple of the maximum over ranks
   of the per-rank floor. The per-rank numbers are in the per-rank table and the JSON.
6. **Memory**: one more step under ``vpce.memory.PeakMemory`` on each rank: the peak of allocated bytes above
   what was live before it, its ``dX`` (or slice) and ``dW`` shard included; the table shows the maximum over
   ranks.
7. **Errors**: ``loss err`` is the largest over ranks (each rank's loss against the reference); ``dX err`` is
   ``||dX - ref|| / ||ref||`` of the complete ``dX``: the largest over ranks when each rank holds all of it
   (hidden replicated), the slices' errors combined under ``--sp``; ``dW err`` is that of the whole weight
   gradient, the shards' errors combined. The per-rank rows have each rank's own errors (its ``dX`` or slice, its
   shard). ``loss_spread`` is the largest difference between two ranks' losses (0: every rank returned the same
   loss).

Distillation (``--tp --distill``): the teacher's ``xt`` is broadcast with ``x`` and each rank keeps the same rows of
``wt`` as of ``w``; with ``--sp`` each row gets the rank's slice of both hidden states. The per-rank floor adds the
teacher's logits GEMM on the shard; ``comm`` under ``--sp`` adds the teacher's hidden all-gather. The float64
reference of each divergence (``vpce.reference.chunked_reference_distillation``) all-gathers both heads' float64
logits of each token chunk, so that every rank forms the divergence over the whole vocab, and all-reduces ``dX``.
Only vpce's rows have a vocab-parallel form (plain torch and liger-kernel are ``missing``). Output:
``--out/bench-distill-tp<K>[-sp].json`` (``schema: "vpce.bench.tp.distill/1"``, the fields of ``vpce.bench``'s
distillation JSON); ``python -m vpce.bench.plots_tp`` reads only cross-entropy runs.

Output, on rank 0: progress on stderr, per shape a table of the maximum over ranks and a per-rank table on
stdout, and ``--out/bench-tp<K>.json`` (``bench-tp<K>-sp.json`` with ``--sp``), rewritten after every shape; at
the end ``--out/bench-tp<K>[-sp]-<shape>.png`` per named shape (the maxima over ranks; needs matplotlib).
``python -m vpce.bench.plots_tp FILE.json ...`` draws time and memory against ``tp`` from several such files.

JSON (``schema: "vpce.bench.tp/1"``)::

    {schema, date, command, commit, tp, world, backend, layout: "replicated" | "sequence-parallel", device (rank
     0's), devices: [{rank, local_rank, host, type, name, ...} per rank], versions, python, dtype, settings,
     timing: "...", methods,
     shapes: [{name, n, d, v, sweeps, layout, rows_per_rank, tokens_per_rank, flops_fwd_bwd_per_rank, grads_gib,
               ref_loss, ref_seconds, floor: {logits_ms, dx_ms, dw_ms, total_ms, frozen_ms, rank} | null,
               floor_ranks: [...], comm: {what, ms, ms_ranks} | null, status}],
     rows: [{shape, n, d, v, tp, rank: int | "max", layout, method, label, mode: "floor" | "fwd+bwd", status,
             ms, ms_min, reps, floor_gemms: "logits+dX+dW", floor_ms, x_floor, extra_gib, loss, loss_err, dx_err,
             dw_err, v_local, n_local, note, [loss_spread], [traceback]}]}

``rank: "max"`` rows aggregate the ranks as the table does; the others are each rank's own measurement.
"""

from __future__ import annotations

import dataclasses
import os
import platform
import socket
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import parallel
from .harness import (GiB, Env, Problem, Settings, Shape, err_from_sq, free_memory, make_problem, measure,
                      ready_extra)
from .launch_env import RECORDED_ENV_KEYS, init_process_group
from .meta import DTYPES, INPUTS, device_info, distill_settings, git_commit, now_utc, package_versions, timings_caveat
from .methods import FLOOR, METHODS
from .peers import megatron_tp_group, shutdown_megatron
from .plots import plot_shapes
from .report import Progress, format_tp_shape, write_json
from .runner import (References, first_reference, floor_label, floor_phase, fwd_bwd_phases, new_row, public, reason,
                     run_phases)

__all__ = ["main_tp", "run_shape_tp", "shard_rows"]


def shard_rows(v: int, tp: int) -> list[int]:
    """Rows of each rank's contiguous vocab shard: equal when ``tp`` divides ``v``, else off by one."""
    return [v // tp + (r < v % tp) for r in range(tp)]


# -- process group ------------------------------------------------------------------------------------------------

def _init_group(args, dtype: torch.dtype) -> tuple[Env, bool]:
    """This rank's ``Env`` on the launch's process group (torchrun's environment, or one process); (env, whether
    this process created the group)."""
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", device.index or 0)))
        torch.cuda.set_device(device)
    owned = False
    if not dist.is_initialized():  # torchrun's group; without torchrun, a group of this one process
        kwargs = dict(device_id=device) if device.type == "cuda" else {}
        init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=args.timeout),
                           **kwargs)
        owned = True
    group = dist.group.WORLD
    env = Env(device=device, dtype=dtype, group=group, tp=dist.get_world_size(group),
              rank=dist.get_rank(group), sequence_parallel=args.sp)
    ready_extra(env)
    return env, owned


def _all_gather_object(obj, env: Env) -> list:
    out = [None] * env.tp
    dist.all_gather_object(out, obj, group=env.group)
    return out


def _agree(status: str, env: Env) -> str:
    """The row's status on every rank: "ok" only if it is "ok" on all; else the first bad rank's status."""
    every = _all_gather_object(status, env)
    bad = [(r, s) for r, s in enumerate(every) if s != "ok"]
    if not bad:
        return "ok"
    if len(bad) == env.tp and len(set(every)) == 1:
        return every[0]
    rank, text = bad[0]
    kind, _, why = text.partition(": ")
    return f"{kind}: on rank {rank}: {why}"


def _agree_max(value: float, env: Env) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=env.group)
    return float(t.item())


def _layout(env: Env) -> str:
    return "sequence-parallel" if env.sequence_parallel else "replicated"


# -- one shape ----------------------------------------------------------------------------------------------------

def _shard_problem(shape: Shape, env: Env, settings: Settings, split: list[int]) -> Problem:
    """The full ``x`` and targets (bitwise equal on every rank) and this rank's rows of ``w``; for distillation
    also the full ``xt`` (broadcast too) and this rank's rows of ``wt``."""
    full = make_problem(shape, env, settings)
    src = dist.get_global_rank(env.group, 0)
    for t in (full.x, full.y) + ((full.xt,) if shape.distill else ()):
        dist.broadcast(t, src=src, group=env.group)
    rows = slice(sum(split[:env.rank]), sum(split[:env.rank + 1]))
    w = full.w[rows].clone()
    wt = full.wt[rows].clone() if shape.distill else None
    return Problem(x=full.x, w=w, y=full.y, xt=full.xt, wt=wt)


def _measure_comm(shape: Shape, env: Env, settings: Settings) -> dict | None:
    """The collective every row's step contains, alone: dX all-reduce, or hidden all-gather + dX reduce-scatter
    (with ``--sp`` under ``--distill``, the teacher's hidden all-gather too)."""
    if env.tp == 1:
        return None
    g = torch.zeros(shape.n, shape.d, dtype=env.dtype, device=env.device)  # zeros: repeated sums stay finite
    dtype = str(env.dtype)[6:]
    if env.sequence_parallel:
        part = torch.zeros(shape.n // env.tp, shape.d, dtype=env.dtype, device=env.device)
        full = torch.empty_like(g)
        teacher = None
        if shape.distill:
            t_full = torch.empty(shape.n, shape.d_teacher, dtype=env.dtype, device=env.device)
            teacher = (t_full, torch.zeros(shape.n // env.tp, shape.d_teacher, dtype=env.dtype, device=env.device))

        def fn():
            parallel.all_gather_tensor(full, part, group=env.group)
            if teacher is not None:
                parallel.all_gather_tensor(*teacher, group=env.group)
            parallel.reduce_scatter_tensor(part, g, group=env.group)
        what = f"hidden all-gather + dX reduce-scatter, [{shape.n}, {shape.d}] {dtype}"
        if shape.distill:
            what += f"; teacher hidden all-gather, [{shape.n}, {shape.d_teacher}] {dtype}"
    else:
        def fn():
            dist.all_reduce(g, group=env.group)
        what = f"dX all-reduce, [{shape.n}, {shape.d}] {dtype}"
    fn()
    ms = measure(fn, env.device, settings, lambda e: _agree_max(e, env)).median
    every = _all_gather_object(ms, env)
    return dict(what=what, ms=max(every), ms_ranks=every)


def _aggregate(per_rank: list[dict], env: Env) -> dict:
    """The table's row: maxima over ranks of time, floor and memory; the whole dX and dW errors."""
    agg = {k: v for k, v in public(per_rank[0]).items() if k != "traceback"}
    agg["rank"] = "max"
    tracebacks = [(r["rank"], r["traceback"]) for r in per_rank if r.get("traceback")]
    if tracebacks:
        agg["traceback"] = "".join(f"-- rank {rank} --\n{tb}" for rank, tb in tracebacks)

    def most(key):
        vals = [r[key] for r in per_rank]
        return None if any(v is None for v in vals) else max(vals)

    for key in ("ms", "ms_min", "floor_ms", "extra_gib", "loss_err", "v_local"):
        agg[key] = most(key)
    agg["x_floor"] = agg["ms"] / agg["floor_ms"] if agg["ms"] is not None and agg["floor_ms"] else None
    if agg["mode"] == "floor":
        agg["x_floor"] = 1.0 if agg["ms"] is not None else None
        return agg
    losses = [r["loss"] for r in per_rank]
    agg["loss_spread"] = None if None in losses else max(losses) - min(losses)

    def combined(key):
        sq = [r.get(key) for r in per_rank]
        if any(s is None for s in sq):
            return None
        return err_from_sq((sum(s[0] for s in sq), sum(s[1] for s in sq)))

    agg["dx_err"] = combined("_dx_sq") if env.sequence_parallel else most("dx_err")
    agg["dw_err"] = combined("_dw_sq")
    return agg


def run_shape_tp(shape: Shape, env: Env, names: list[str], settings: Settings, progress: Progress,
                 inject: tuple[str, int] | None = None) -> tuple[dict, list[dict], list[dict]]:
    """Every selected row of ``shape`` on every rank; returns (shape record, aggregate rows, per-rank rows), the
    same on every rank."""
    split = shard_rows(shape.v, env.tp)
    env = dataclasses.replace(env, vocab_start=sum(split[:env.rank]), vocab_size=shape.v)
    n_local = shape.n // env.tp if env.sequence_parallel else shape.n
    elem = torch.finfo(env.dtype).bits // 8
    record = dict(name=shape.name, n=shape.n, d=shape.d, v=shape.v, sweeps=list(shape.sweeps), layout=_layout(env),
                  rows_per_rank=split, tokens_per_rank=n_local,
                  flops_fwd_bwd_per_rank=6 * shape.n * shape.d * max(split),
                  grads_gib=(n_local * shape.d + max(split) * shape.d) * elem / GiB, ref_loss=None, ref_seconds=None,
                  floor=None, floor_ranks=None, comm=None, status="ok")
    if shape.distill:
        record.update(d_teacher=shape.d_teacher, ref_losses={},
                      flops_fwd_bwd_per_rank=record["flops_fwd_bwd_per_rank"] + 2 * shape.n * shape.d_teacher *
                      max(split))
        del record["ref_loss"]
    methods = [METHODS[n] for n in names if n != FLOOR]
    rows = [new_row(shape, env, FLOOR, floor_label(shape, " on the shard"), "floor")] if FLOOR in names else []
    rows += [new_row(shape, env, m.name, m.row_label(env), "fwd+bwd") for m in methods]
    for row in rows:
        row.update(layout=_layout(env), v_local=split[env.rank], n_local=n_local, note=None)
    progress.shape(shape, env, len(rows))
    progress.note(f"tp={env.tp}, hidden {_layout(env)}; vocab rows per rank {split}; hidden tokens per rank {n_local}")

    skip = None
    if shape.v < env.tp:
        skip = f"missing: needs V >= tp (V={shape.v}, tp={env.tp})"
    elif env.sequence_parallel and shape.n % env.tp:
        skip = f"missing: sequence parallel needs N divisible by tp (N={shape.n}, tp={env.tp})"
    if skip:
        record["status"] = skip
        for row in rows:
            row["status"] = skip
        per_rank = [_all_gather_object(r, env) for r in rows]
        return record, [_aggregate(p, env) for p in per_rank], [public(r) for p in per_rank for r in p]

    t0 = time.perf_counter()
    prob = _shard_problem(shape, env, settings, split)
    mine = slice(env.rank * n_local, (env.rank + 1) * n_local)
    refs = References(prob, settings, progress, group=env.group, vocab_start=sum(split[:env.rank]),
                      max_rows=max(split), shard_rows=split)
    ref = first_reference(shape, refs, record, env, progress, t0)
    x_in, extra, ref_dx = prob.x, prob.extra, None
    if env.sequence_parallel:  # this rank's slice of the tokens (the teacher's too), and of dX
        x_in, extra = prob.x[mine], ((prob.xt[mine], prob.wt) if shape.distill else ())
        ref_dx = lambda dx: dx[mine]  # noqa: E731

    try:
        record["comm"] = _measure_comm(shape, env, settings)
    except Exception as e:  # informational only
        record["comm"] = dict(what=f"failed: {reason(e)}", ms=None, ms_ranks=None)
    free_memory(env.device)

    def agree(status):
        return _agree(status, env)

    def agree_time(estimate):
        return _agree_max(estimate, env)

    aggs, everyone = [], []
    floor_ms = None
    for row in rows:
        progress.start(row)
        if row["mode"] == "floor":
            run_phases(row, [floor_phase(row, shape, prob, env, settings, agree_time)], agree)
            floor_ms = row["ms"] if row["status"] == "ok" else None
        else:
            m = METHODS[row["method"]]
            phases = fwd_bwd_phases(row, m, env, settings, prob, refs if shape.distill else ref, floor_ms=floor_ms,
                                    x_in=x_in, ref_dx=ref_dx, extra=extra, shard_rows=split, agree_time=agree_time)
            if inject is not None and inject[0] == m.name:  # on every rank: the same phases, so agree lines up
                phases.insert(1, _injected_failure(inject, env.rank))
            run_phases(row, phases, agree)
        free_memory(env.device)
        per_rank = _all_gather_object(row, env)
        if row["mode"] == "floor" and row["status"] == "ok":
            floors = [dict(r["_floor"], rank=r["rank"]) for r in per_rank]
            record["floor_ranks"] = floors
            record["floor"] = max(floors, key=lambda f: f["total_ms"])
        agg = _aggregate(per_rank, env)
        aggs.append(agg)
        everyone.extend(public(r) for r in per_rank)
        progress.finish(agg)

    if shape.distill:
        record["ref_losses"], record["ref_seconds"] = refs.losses, refs.seconds
    del prob, ref, refs, x_in, extra
    free_memory(env.device)
    return record, aggs, everyone


def _injected_failure(inject: tuple[str, int], rank: int):
    """A phase that raises on rank ``inject[1]`` only (``--inject-failure``): for testing that a failure on one
    rank ends the row on all."""
    def injected():
        if rank == inject[1]:
            raise RuntimeError(f"injected failure (--inject-failure {inject[0]}@{rank})")
    return injected


# -- the run ------------------------------------------------------------------------------------------------------

def _parse_inject(text: str | None, parser) -> tuple[str, int] | None:
    if text is None:
        return None
    name, _, rank = text.rpartition("@")
    if name not in METHODS or not rank.isdigit():
        parser.error(f"--inject-failure: expected METHOD@RANK with METHOD one of {sorted(METHODS)}, got {text!r}")
    return name, int(rank)


def _launch_command(command: str) -> str:
    """``command`` ("python -m vpce.bench ...") as launched: under torchrun, its node and process counts."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        return command
    nodes = int(os.environ["WORLD_SIZE"]) // int(os.environ["LOCAL_WORLD_SIZE"])
    launcher = f"torchrun --nnodes {nodes} --nproc-per-node {os.environ['LOCAL_WORLD_SIZE']}"
    return launcher + command.removeprefix("python")


def main_tp(args, parser, shapes: list[Shape], settings: Settings, command: str, warnings: list[str] = ()) -> int:
    """Run ``--tp``: every rank measures; rank 0 prints ``warnings`` (on stderr), the tables and writes the JSON."""
    inject = _parse_inject(args.inject_failure, parser)
    env, owned = _init_group(args, DTYPES[args.dtype])
    lead = env.rank == 0
    progress = Progress(enabled=lead and not args.quiet)
    info = dict(rank=env.rank, local_rank=int(os.environ.get("LOCAL_RANK", 0)), host=socket.gethostname(),
                **device_info(env.device))
    devices = _all_gather_object(info, env)
    if any(METHODS[n].package == "megatron-core" for n in args.methods if n in METHODS):
        try:  # now, on every rank together: building a row later then needs no collective
            megatron_tp_group(env)
        except Exception:  # noqa: BLE001 - the megatron rows say why when they are built
            pass
    doc = dict(
        schema="vpce.bench.tp.distill/1" if args.distill else "vpce.bench.tp/1",
        date=now_utc(),
        command=_launch_command(command),
        commit=git_commit(),
        tp=env.tp,
        world=dist.get_world_size(),
        backend=str(dist.get_backend(env.group)),
        layout=_layout(env),
        device=devices[0],
        devices=devices,
        versions=package_versions(),
        python=platform.python_version(),
        dtype=args.dtype,
        settings=dict(dataclasses.asdict(settings), tf32=torch.backends.cuda.matmul.allow_tf32,
                      inputs=INPUTS + "; x and targets broadcast from rank 0; rank r holds w rows "
                                      "[sum(rows_per_rank[:r]), +rows_per_rank[r])",
                      timeout_s=args.timeout,
                      env={k: os.environ[k] for k in RECORDED_ENV_KEYS if k in os.environ}),
        timing="a rank's ms is the median of its own timed steps (every rank runs the same steps); rows with "
               "rank 'max' take the maximum over ranks of ms, floor_ms and extra_gib",
        **distill_settings(args),
        methods=args.methods,
        shapes=[],
        rows=[],
    )
    stem = f"bench{'-distill' if args.distill else ''}-tp{env.tp}{'-sp' if env.sequence_parallel else ''}"
    out_json = args.out / f"{stem}.json"
    hosts = sorted({d["host"] for d in devices})
    names = sorted({d["name"] for d in devices})
    where = f"{env.tp} x {' / '.join(names)}" + (f" on {len(hosts)} hosts" if len(hosts) > 1 else "")
    caveat = timings_caveat(env.device)
    if lead:
        for line in warnings:
            progress.warn(line)
        if caveat:
            print(caveat + "\n", flush=True)  # with the tables too, so that a copied table keeps it
    finished = False
    try:
        for shape in shapes:
            record, aggs, per_rank = run_shape_tp(shape, env, args.methods, settings, progress, inject)
            doc["shapes"].append(record)
            doc["rows"].extend(aggs + per_rank)
            if lead:
                print(format_tp_shape(record, aggs, per_rank, doc, where), flush=True)
                write_json(out_json, doc)  # after every shape: a crash later keeps what was measured
        finished = True
    finally:
        shutdown_megatron()
        if owned:
            parallel.end_process_group(finished)
    if lead:
        aggregate = dict(doc, rows=[r for r in doc["rows"] if r["rank"] == "max"])
        files, note = plot_shapes(aggregate, args.out, stem)
        for f in files:
            progress.note(f"wrote {f}")
        if note:
            progress.note(note)
        progress.note(f"wrote {out_json}")
    return 0
