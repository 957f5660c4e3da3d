"""Without CUDA, Triton kernels run through Triton's CPU interpreter (set before any kernel module is imported), and
the test process runs torch on one thread, as every rank and launched process of the suite already does
(``distributed.run_ranks``, ``launch/``, the torchrun tests). The tests' operations are small; where other jobs
keep the cores busy, torch's second thread spin-waits for one, which made tests/backends/test_torch_backend.py several
times slower on a shared 2-core machine."""

import dataclasses
import os
import pathlib
import sys

import pytest
import torch

# The tests are grouped in folders that mirror the package (api/, backends/, parallel/, ...); the shared helpers
# (compare.py, distributed.py, problems.py, ...) sit here, and a few tests import another test module's problems by
# name. Every folder goes on sys.path once, before any test module is imported, so that those imports resolve from
# any folder, and the ranks that multiprocessing starts (which inherit sys.path) find the same modules.
_HERE = pathlib.Path(__file__).resolve().parent
for _folder in [_HERE, *sorted(p for p in _HERE.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)


@pytest.fixture(autouse=True, scope="session")
def hopper_kernels():
    """On an sm_90 GPU with the hopper extra, its kernels built before the first test (``vpce.build_hopper_kernels``:
    a process's first calls would otherwise run without them while they build), so that the GPU tests check the
    route that uses them from their first call."""
    if torch.cuda.is_available():
        from distributed import ready_hopper_kernels

        ready_hopper_kernels()


@pytest.fixture
def sizing(monkeypatch):
    """Other chunk and block sizes for one test: ``sizing(lean_token_block=48, fast_p_gib=1e-9, ...)`` replaces
    those fields of ``vpce.routing.SIZING`` (``vpce.routing.Sizing``), which every call's plan is sized from."""
    from vpce import routing

    def replace(**fields):
        monkeypatch.setattr(routing, "SIZING", dataclasses.replace(routing.SIZING, **fields))
    return replace
