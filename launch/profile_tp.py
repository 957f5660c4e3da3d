"""Where a tensor-parallel vpce step spends its time: the step timed, then profiled kernel by kernel.

    torchrun --standalone --nproc-per-node 4 launch/profile_tp.py [--shape 16384x4096x128256] [--sp] [--out DIR]
        [--distill forward_kl|reverse_kl|jsd [--teacher-dim 8192]]

Each rank holds ``W``'s rows ``V/tp`` (NCCL, one GPU per rank, hidden replicated; ``--sp`` for sequence
parallelism) and runs ``vpce.linear_cross_entropy`` as shipped (with ``--distill``:
``vpce.linear_distillation_loss`` of that divergence against a teacher head ``[V, --teacher-dim]``, sharded and
laid out the same way), with the collective environment of
``vpce.bench.launch_env`` (NVLink multicast off; NCCL on a high-priority stream, as the benchmark runs it). Rank 0
prints the median step time (CUDA events; the maximum over ranks, and each rank's). Then ``--profile-steps`` steps
run under ``torch.profiler``: GPU time per kernel, and how much NCCL kernel time no other kernel overlaps
(``exposed``); ``--out`` gets every rank's Chrome trace. One process works too (``--nproc-per-node 1``, or plain
``python launch/profile_tp.py``: tp=1, one GPU). Tuning notes, not a benchmark: the numbers that count come from
``python -m vpce.bench --tp``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import vpce  # noqa: E402
from vpce.bench.launch_env import init_process_group, local_cuda_device  # noqa: E402


def _timed_ms(step, reps: int) -> list[float]:
    """One warm-up step, then ``reps`` steps back to back, each bracketed by CUDA events."""
    step()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        step()
        b.record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) for a, b in events]


def _exposed(intervals_comm, intervals_other) -> float:
    """Length of the union of ``intervals_comm`` not covered by the union of ``intervals_other`` (us)."""
    def union(iv):
        out = []
        for s, e in sorted(iv):
            if out and s <= out[-1][1]:
                out[-1][1] = max(out[-1][1], e)
            else:
                out.append([s, e])
        return out
    other = union(intervals_other)
    exposed = 0.0
    for s, e in union(intervals_comm):
        covered = sum(max(0.0, min(e, oe) - max(s, os_)) for os_, oe in other)
        exposed += (e - s) - covered
    return exposed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="16384x4096x128256", help="NxDxV of the whole head")
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--reps", type=int, default=30, help="timed steps")
    ap.add_argument("--out", type=Path, default=None, help="each rank's Chrome trace goes here")
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--distill", choices=("forward_kl", "reverse_kl", "jsd"), default=None,
                    help="profile linear_distillation_loss of this divergence instead of the cross-entropy")
    ap.add_argument("--teacher-dim", type=int, default=8192, help="with --distill: the teacher's hidden size")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("expected CUDA GPUs (one per process), got none: this script profiles GPU kernels")
    n, d, v = (int(t) for t in args.shape.split("x"))
    init_process_group("nccl", device_id=local_cuda_device())
    rank, tp = dist.get_rank(), dist.get_world_size()
    vpce.build_hopper_kernels()  # the extra's kernels from the first step on (where there is the extra)

    rows = v // tp
    v = rows * tp  # equal shards: the vocab rounded down to a multiple of tp
    torch.manual_seed(0)
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, v, (n,), device="cuda")
    dist.broadcast(x, 0)
    dist.broadcast(y, 0)
    w = (torch.randn(rows, d, device="cuda") / d**0.5).to(torch.bfloat16).requires_grad_()
    xs = (x[rank * n // tp:(rank + 1) * n // tp] if args.sp else x).clone().requires_grad_()

    if args.distill:
        dt = args.teacher_dim
        xt = torch.randn(n, dt, device="cuda", dtype=torch.bfloat16)
        dist.broadcast(xt, 0)
        wt = (torch.randn(rows, dt, device="cuda") / dt**0.5).to(torch.bfloat16)
        xts = xt[rank * n // tp:(rank + 1) * n // tp].clone() if args.sp else xt

    # the layout passed, as the bench passes it: the agreement is then decided on the device, with no host sync
    layout = dict(group=dist.group.WORLD, vocab_start=rank * rows, vocab_size=v, sequence_parallel=args.sp)

    def step():
        xs.grad = w.grad = None
        if args.distill:
            loss = vpce.linear_distillation_loss(xs, w, xts, wt, y, divergence=args.distill, **layout)
        else:
            loss = vpce.linear_cross_entropy(xs, w, y, **layout)
        loss.backward()

    median = statistics.median(_timed_ms(step, args.reps))
    every = [None] * tp
    dist.all_gather_object(every, median)
    if rank == 0:
        what = f"distill {args.distill} D_T={args.teacher_dim} " if args.distill else ""
        print(f"{what}tp={tp} N={n} D={d} V={v} sp={args.sp}: median step {max(every):.3f} ms over {args.reps} steps, "
              f"max over ranks ({' '.join(f'{t:.3f}' for t in every)})")

    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    steps = args.profile_steps
    with torch.profiler.profile(activities=acts) as prof:
        for i in range(steps):
            with torch.profiler.record_function(f"vpce-step-{i}"):
                step()
        torch.cuda.synchronize()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        name = f"trace{'-' + args.distill if args.distill else ''}-tp{tp}{'-sp' if args.sp else ''}-rank{rank}.json"
        prof.export_chrome_trace(str(args.out / name))
    if rank == 0:
        cuda = torch.autograd.DeviceType.CUDA
        events = [e for e in prof.key_averages() if e.device_type == cuda]
        total = sum(e.self_device_time_total for e in events) / steps / 1e3
        print(f"GPU ms per step by kernel ({steps} steps / {steps}; all kernels {total:.3f} ms, overlaps counted twice):")
        for e in sorted(events, key=lambda e: -e.self_device_time_total)[:24]:
            print(f"  {e.self_device_time_total / steps / 1e3:8.3f} ms  x{e.count // steps:<4d} {e.key[:90]}")
        try:
            gpu_kernels = [e for e in prof.events() if e.device_type == cuda]
            comm = [(e.time_range.start, e.time_range.end) for e in gpu_kernels if "nccl" in e.name.lower()]
            other = [(e.time_range.start, e.time_range.end) for e in gpu_kernels if "nccl" not in e.name.lower()]
            print(f"NCCL kernels: {sum(e - s for s, e in comm) / steps / 1e3:.3f} ms per step, of which not "
                  f"overlapped by other kernels: {_exposed(comm, other) / steps / 1e3:.3f} ms; other kernels: "
                  f"{sum(e - s for s, e in other) / steps / 1e3:.3f} ms per step")
        except Exception as exc:  # noqa: BLE001 - the interval view is a bonus
            print(f"(no kernel intervals: {exc!r})")
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
