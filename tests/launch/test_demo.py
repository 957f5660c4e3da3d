"""Smoke test of ``make demo`` (launch/demo.py): a few steps under torchrun, 1 and 2 processes, vs the baseline.

Every run is a subprocess with a timeout, so a hung collective fails the test instead of hanging CI.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

DEMO = Path(__file__).resolve().parents[2] / "launch" / "demo.py"
STEPS = 20
TIMEOUT_S = 120


def _import_demo():
    spec = importlib.util.spec_from_file_location("launch_demo", DEMO)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


demo = _import_demo()


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(DEMO),
           "--steps", str(STEPS), "--log-every", "5", *args]
    # the CPU and gloo run, as on CI, also on a machine with GPUs (fewer of them than ranks, maybe)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})


def tail(run: subprocess.CompletedProcess) -> str:
    return f"exit {run.returncode}\n--- stdout\n{run.stdout[-3000:]}\n--- stderr\n{run.stderr[-3000:]}"


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("demo") / "baseline.json"
    run = torchrun(1, "--baseline-out", str(path))
    assert run.returncode == 0, tail(run)
    return path


@pytest.mark.parametrize("nproc", [1, 2])
def test_sharded_matches_baseline(baseline, nproc, tmp_path):
    report_path = tmp_path / "report.json"
    run = torchrun(nproc, "--compare", str(baseline), "--report", str(report_path))
    assert run.returncode == 0, tail(run)
    report = json.loads(report_path.read_text())
    want = json.loads(baseline.read_text())["losses"]
    got = report["losses"]
    assert report["world"] == nproc and len(got) == len(want) == STEPS
    diffs = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    worst = max(range(STEPS), key=diffs.__getitem__)
    assert diffs[worst] <= demo.REL_TOL, (f"step {worst + 1}: vpce {got[worst]} vs baseline {want[worst]}, "
                                          f"rel diff {diffs[worst]:.2e} > {demo.REL_TOL:.0e}")
    assert got[-1] < got[0] - 1.0, f"the model did not train: loss {got[0]} -> {got[-1]}"
    peaks = report["peak_bytes"]
    assert max(peaks["vpce_per_rank"]) < peaks["baseline"]["unfused"], peaks
    assert "OK" in run.stdout.splitlines()[-1], tail(run)
    assert f"report (both loss curves, per-step rel diffs, peak memory): {report_path}" in run.stdout, tail(run)


def test_disagreement_fails(baseline, tmp_path):
    """One baseline loss nudged by 10x the tolerance makes the demo report FAIL and exit non-zero."""
    tampered = json.loads(baseline.read_text())
    tampered["losses"][STEPS // 2] *= 1 + 10 * demo.REL_TOL
    path = tmp_path / "tampered.json"
    path.write_text(json.dumps(tampered))
    run = torchrun(2, "--compare", str(path))
    assert run.returncode != 0, tail(run)
    assert f"at step {STEPS // 2 + 1} " in run.stdout and "FAIL" in run.stdout, tail(run)


def test_tokenizer_is_lossless_with_byte_fallback():
    tok = demo.WordTokenizer(demo.load_corpus())
    text = "The keeper's Zqxv-ray café, in 1876!\n\n  Tabs\tand  spaces.\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert any(i < 256 for i in ids) and any(i >= 256 for i in ids), "expected word ids and byte-fallback ids"
    assert 2000 <= len(tok) <= 5000, len(tok)
