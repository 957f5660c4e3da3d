"""What every multi-process launch needs: the collective environment, set before the process group starts, and
a free port for a group that torchrun did not set up.

Used by ``python -m vpce.bench --tp``, every script in ``launch/`` and the test suite's process spawner.
"""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

__all__ = ["MULTICAST_OFF", "COLLECTIVE_ENV", "RECORDED_ENV_KEYS", "set_collective_env", "free_port",
           "init_process_group", "local_cuda_device"]

#: NVLink multicast off in NCCL, torch symmetric memory and NVSHMEM: a program that uses it can take a shared
#: host's GPUs out of service. Always set, whatever the caller's environment says.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

#: Set unless the caller set them. NCCL kernels on a high-priority stream get SMs while a GEMM's grid is still
#: being scheduled, so that a collective issued to overlap a GEMM (vpce's dX reduction) really runs under it; every
#: row and every script then runs with the same setting.
COLLECTIVE_ENV = {"TORCH_NCCL_HIGH_PRIORITY": "1"}

#: Variables whose values a benchmark's JSON records (``settings.env``).
RECORDED_ENV_KEYS = (*MULTICAST_OFF, *COLLECTIVE_ENV, "NCCL_ALGO", "NCCL_PROTO", "NCCL_MAX_NCHANNELS",
                     "CUDA_DEVICE_MAX_CONNECTIONS")


def set_collective_env() -> None:
    """Set ``MULTICAST_OFF`` (always) and ``COLLECTIVE_ENV`` (where unset) in ``os.environ``; call it before the
    process group starts (NCCL reads them when it creates its communicators)."""
    os.environ.update(MULTICAST_OFF)
    for key, value in COLLECTIVE_ENV.items():
        os.environ.setdefault(key, value)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a ``tcp://`` rendezvous on this host)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(backend: str, **kwargs) -> None:
    """``set_collective_env()``, then ``torch.distributed.init_process_group(backend, **kwargs)``: from torchrun's
    environment, or without torchrun (plain ``python``) a group of this one process on a free local port."""
    set_collective_env()
    if "WORLD_SIZE" not in os.environ:
        kwargs.update(init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    dist.init_process_group(backend, **kwargs)


def local_cuda_device() -> torch.device:
    """``cuda:LOCAL_RANK`` (0 without torchrun), made current; a rank with no GPU of its own fails with a clear
    error, not CUDA's "invalid device ordinal" (more processes on a node than it has GPUs)."""
    local = int(os.environ.get("LOCAL_RANK", 0))
    count = torch.cuda.device_count()
    if local >= count:
        raise SystemExit(f"LOCAL_RANK={local}, but this process sees {count} CUDA device(s): run at most {count} "
                         f"process(es) per node, one GPU each, or hide the GPUs (CUDA_VISIBLE_DEVICES=) to run on "
                         f"the CPU with gloo")
    device = torch.device("cuda", local)
    torch.cuda.set_device(device)
    return device
