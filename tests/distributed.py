"""Spawn ``world`` real processes joined by a process group (gloo on CPU, NCCL on GPUs); a hang fails the test
instead of CI."""

from __future__ import annotations

import os
import queue
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vpce.bench.launch_env import free_port, set_collective_env


def _entry(fn, rank, world, port, out, args, backend):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    set_collective_env()  # never NVLink multicast (it can take a shared host's GPUs down)
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=90))
        out.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world: int, *args, timeout: float = 240.0, backend: str = "gloo") -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks (gloo, or NCCL with one GPU per rank); return each
    rank's result, rank order.

    ``fn`` must be a module-level function. Any rank's exception fails with that rank's traceback; ranks
    still running after ``timeout`` seconds are killed and the call fails.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, out, args, backend), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    try:
        for _ in range(world):
            rank, ok, value = out.get(timeout=timeout)
            if not ok:
                raise AssertionError(f"rank {rank} of {world} failed:\n{value}")
            results[rank] = value
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(world)) - set(results))} of {world} did not finish within "
                             f"{timeout:.0f} s (hung collective?)") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [results[r] for r in range(world)]
