"""``launch/gpu_suite.sh`` (the whole suite on a GPU machine): on a machine without CUDA it says so and exits 2
instead of running the suite on the CPU under a GPU suite's name."""

import os
import subprocess
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "gpu_suite.sh"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU refusal")
def test_gpu_suite_refuses_a_machine_without_cuda(tmp_path):
    env = dict(os.environ, OUT_DIR=str(tmp_path))
    run = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])
    assert "no CUDA device here" in run.stderr


def test_gpu_suite_parses():
    run = subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
