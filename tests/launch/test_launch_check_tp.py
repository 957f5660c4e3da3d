"""``launch/check_tp.py`` under torchrun on CPU (gloo, the torch backend): 2 ranks, both budgets and layouts,
uneven padded shards; it must pass, and a tolerance of zero must make it fail (the check can fail)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CHECK = Path(__file__).resolve().parents[2] / "launch" / "check_tp.py"


def _run(*extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(CHECK),
           "--n-per-rank", "96", "--hidden", "40", "--vocab", "700", *extra]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU/gloo form; GPUs run tests/parallel/test_multi_gpu.py")
def test_check_tp_passes_on_gloo():
    out = _run()
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("world=2")]
    assert len(lines) == 8, out.stdout  # 2 budgets x 2 layouts x 2 ranks
    assert all("FAIL" not in ln for ln in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU/gloo form")
def test_check_tp_can_fail():
    out = _run("--budgets", "auto", "--layouts", "replicated", "--tol-scale", "0")
    assert out.returncode == 1, out.stdout + out.stderr
    assert "FAIL" in out.stdout


def test_more_ranks_than_gpus_is_named(monkeypatch):
    """Every launcher takes its GPU from ``local_cuda_device``: a rank whose LOCAL_RANK has no GPU stops with a
    message that says so and how to run on the CPU, not CUDA's "invalid device ordinal"."""
    from vpce.bench import launch_env

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    with pytest.raises(SystemExit, match=r"LOCAL_RANK=1, but this process sees 1 CUDA device\(s\).*CUDA_VISIBLE_DEVICES="):
        launch_env.local_cuda_device()
    for script in ("demo.py", "train_step.py", "check_tp.py", "profile_tp.py"):
        source = (Path(__file__).resolve().parents[2] / "launch" / script).read_text()
        assert "local_cuda_device()" in source and 'int(os.environ["LOCAL_RANK"])' not in source, script
