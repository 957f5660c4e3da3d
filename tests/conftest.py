"""Without CUDA, Triton kernels run through Triton's CPU interpreter (set before any kernel module is imported), and
the test process runs torch on one thread, as every rank and launched process of the suite already does
(``distributed.run_ranks``, ``launch/``, the torchrun tests). The tests' operations are small; where other jobs
keep the cores busy, torch's second thread spin-waits for one: on a shared 2-core machine tests/test_torch_backend.py
took 60-190 s on two threads and 11 s on one (4 s on two with the machine to itself)."""

import dataclasses
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)


@pytest.fixture
def sizing(monkeypatch):
    """Other chunk and block sizes for one test: ``sizing(lean_token_block=48, fast_p_gib=1e-9, ...)`` replaces
    those fields of ``vpce.routing.SIZING`` (``vpce.routing.Sizing``), which every call's plan is sized from."""
    from vpce import routing

    def replace(**fields):
        monkeypatch.setattr(routing, "SIZING", dataclasses.replace(routing.SIZING, **fields))
    return replace
