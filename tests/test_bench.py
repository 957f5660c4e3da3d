"""Smoke test of the benchmark product: ``python -m vpce.bench`` on CPU with tiny shapes.

The numbers are meaningless on CPU; what is checked is that the product runs end to end, prints its tables,
writes a JSON with every requested row measured (finite time, memory and errors against float64), and reports
rows it cannot run instead of dropping them.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    cmd = [sys.executable, "-m", "vpce.bench", "--device", "cpu", "--quick",
           "--methods", "torch,vpce-torch,floor,vpce-triton", "--out", str(out)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc, json.loads((out / "bench.json").read_text())


def test_table_printed(quick_run):
    proc, doc = quick_run
    header = "| method"
    assert proc.stdout.count(header) >= 2 * len(doc["shapes"]), proc.stdout  # fwd+bwd and no-grad, per shape
    for col in ("ms", "x floor", "extra GiB", "loss err", "dX err", "dW err", "status"):
        assert col in proc.stdout, f"column {col!r} missing from:\n{proc.stdout}"
    assert "torch eager" in proc.stdout and "vpce torch" in proc.stdout
    assert "vpce torch" in proc.stderr, f"no progress lines on stderr:\n{proc.stderr}"


def test_json_header(quick_run):
    _, doc = quick_run
    assert doc["schema"] == "vpce.bench/1"
    assert doc["device"]["type"] == "cpu" and doc["dtype"] == "bf16"
    assert doc["versions"]["torch"] and doc["versions"]["vpce"]
    assert "--quick" in doc["command"] and doc["date"]
    assert len(doc["shapes"]) >= 2
    for s in doc["shapes"]:
        assert s["floor"] and math.isfinite(s["floor"]["total_ms"]) and s["floor"]["total_ms"] > 0, s
        assert math.isfinite(s["ref_loss"]), s


def _finite(v):
    return isinstance(v, (int, float)) and math.isfinite(v)


def test_rows_measured(quick_run):
    _, doc = quick_run
    for s in doc["shapes"]:
        rows = {(r["method"], r["mode"]): r for r in doc["rows"] if r["shape"] == s["name"]}
        assert set(rows) == {("floor", "floor"), ("torch", "fwd+bwd"), ("vpce-torch", "fwd+bwd"),
                             ("torch", "no-grad"), ("vpce-torch", "no-grad"), ("vpce-triton", "fwd+bwd"),
                             ("vpce-triton", "no-grad")}, sorted(rows)
        for key in (("torch", "fwd+bwd"), ("vpce-torch", "fwd+bwd")):
            r = rows[key]
            assert r["status"] == "ok", r
            for k in ("ms", "x_floor", "extra_gib", "loss_err", "dx_err", "dw_err"):
                assert _finite(r[k]), f"{key} {k}={r[k]!r}"
            assert r["ms"] > 0 and r["extra_gib"] > 0, r
            # bf16 inputs: torch's own error is ~2e-3; anything near 1 would mean a broken reference or row
            assert r["loss_err"] < 1e-3 and r["dx_err"] < 2e-2 and r["dw_err"] < 2e-2, r
        for key in (("torch", "no-grad"), ("vpce-torch", "no-grad")):
            r = rows[key]
            assert r["status"] == "ok" and _finite(r["ms"]) and _finite(r["loss_err"]), r
            assert r["floor_ms"] == s["floor"]["logits_ms"], r
        # a row that cannot run here is reported, not dropped
        assert rows[("vpce-triton", "fwd+bwd")]["status"].startswith("missing:"), rows[("vpce-triton", "fwd+bwd")]
