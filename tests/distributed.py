"""Start ``world`` real processes joined by a process group (gloo on CPU, NCCL on GPUs); a hang fails the test
instead of CI.

The ranks are fresh processes forked by multiprocessing's forkserver, not ``spawn``ed interpreters: a spawned rank
imports torch (and, for some tests, megatron-core: 8-13 s of CPU each) from scratch, which cost 3-15 s per group
on a 2-core CI machine, most of the multi-process tests' time. The forkserver is a clean process started once per
test session; it imports only the heavy packages that the test process itself has already imported (torch, numpy,
triton, vpce, megatron-core: ``_preload``), and never runs test code, so each rank still starts with no state from
any earlier test or rank (each gets its own port, process group and module state). Its environment is the test
process's at its start: the ranks get MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE from ``_entry``.
"""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import time
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vpce.bench.launch_env import free_port, set_collective_env

#: For the Triton backend on CPU (gloo) ranks: they run through the interpreter, which ``conftest`` turns on only
#: without CUDA; with CUDA the NCCL tests cover the same paths.
cpu_triton = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="the Triton backend on CPU ranks needs TRITON_INTERPRET=1 (with CUDA the NCCL "
                                       "tests cover it)")


def ready_hopper_kernels():
    """On an sm_90 GPU with the hopper extra, its kernels ready before the first call (``vpce.build_hopper_kernels``,
    which the test process has run into the shared cache): the GPU tests check the route that uses them."""
    import vpce

    for dtype in (torch.bfloat16, torch.float16):
        vpce.build_hopper_kernels(dtype=dtype)


def _entry(fn, rank, world, port, out, args, backend, preloaded):
    for name, where in preloaded.items():  # the forkserver's imports must be the test process's own modules
        got = getattr(sys.modules.get(name), "__file__", where)
        if got != where:
            out.put((rank, False, f"the forkserver imported {name} from {got}, the test process from {where}: run "
                                  f"pytest from the repository root"))
            return
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    set_collective_env()  # never NVLink multicast (it can take a shared host's GPUs down)
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
            ready_hopper_kernels()
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=90))
        out.put((rank, True, fn(rank, world, *args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        out.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# Heavy imports the forkserver makes once, each only where the test process has imported it itself (so a rank
# sees no module the test process lacks); an ImportError there is ignored by multiprocessing.
_PRELOAD = ("numpy", "torch", "torch.distributed", "torch.distributed.tensor", "triton", "vpce", "vpce.kernels",
            "vpce.reference", "megatron.core", "megatron.core.tensor_parallel", "megatron.core.parallel_state")


def _context(cpu_only: bool = False) -> tuple:
    """The forkserver context, and where each module it preloads lives in this process (``_entry`` checks that the
    rank's copy is the same file: the forkserver resolves imports from the working directory and site-packages).

    ``cpu_only`` on a machine with CUDA: freshly ``spawn``ed interpreters that start with ``CUDA_VISIBLE_DEVICES=""``,
    so the ranks see a machine without CUDA, as on CI (a forked rank would inherit whatever the forkserver's imports
    learned about the devices)."""
    if cpu_only and torch.cuda.is_available():
        return mp.get_context("spawn"), {}
    ctx = mp.get_context("forkserver")
    preload = [m for m in _PRELOAD if m in sys.modules]
    ctx.set_forkserver_preload(preload)  # no effect once the server runs
    return ctx, {m: getattr(sys.modules[m], "__file__", None) for m in preload}


def run_ranks(fn, world: int, *args, timeout: float = 240.0, backend: str = "gloo", cpu_only: bool = False) -> list:
    """Run ``fn(rank, world, *args)`` on ``world`` ranks (gloo, or NCCL with one GPU per rank); return each
    rank's result, rank order.

    ``fn`` must be a module-level function (pickled by name). Any rank's exception fails with that rank's
    traceback; ranks still running after ``timeout`` seconds are killed and the call fails. ``cpu_only``: the
    ranks see no CUDA device even where the machine has one (gloo only; see ``_context``).
    """
    if cpu_only and backend != "gloo":
        raise ValueError(f"run_ranks: cpu_only needs backend='gloo', got {backend!r}")
    ctx, preloaded = _context(cpu_only)
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world, port, out, args, backend, preloaded), daemon=True)
             for r in range(world)]
    hidden = cpu_only and torch.cuda.is_available()
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden:  # a spawned interpreter starts with the parent's environment as it is at start()
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        for p in procs:
            p.start()
    finally:
        if hidden:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES")
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved
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


def run_commands(cmds: dict[str, list[str]], *, cwd, env: dict, timeout: float) -> dict[str, tuple[str, str]]:
    """Run every command of ``cmds`` at once (torchrun launches, say), each in its own process; return
    ``{key: (stdout, stderr)}`` once all have exited 0. A non-zero exit fails with that command's output; commands
    still running ``timeout`` seconds after the start (a hung collective) are killed and the call fails."""
    t0 = time.perf_counter()
    procs = {k: subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k, c in cmds.items()}
    results = {}
    try:
        for key, proc in procs.items():
            stdout, stderr = proc.communicate(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
            assert proc.returncode == 0, f"{key}: exit {proc.returncode}\nstdout:\n{stdout}\nstderr:\n{stderr[-6000:]}"
            results[key] = stdout, stderr
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{sorted(set(cmds) - set(results))} did not finish within {timeout:.0f} s "
                             f"(hung collective?)") from None
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return results
