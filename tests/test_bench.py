"""Smoke test of the benchmark product: ``python -m vpce.bench`` on CPU with tiny shapes.

The numbers are meaningless on CPU; what is checked is that the product runs end to end, prints its tables (and
says that CPU times mean nothing), writes a JSON with every requested row measured (finite time, memory and errors
against float64) and a PNG per shape, reports rows it cannot run instead of dropping them, runs the loss-option
and log-prob rows on the torch backend, and refuses the GPU-sized default shapes on a CPU.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


PNG = b"\x89PNG\r\n\x1a\n"
CPU_NOTE = "times are not meaningful"


def _bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "vpce.bench", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def quick_out(tmp_path_factory):
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="module")
def quick_run(quick_out):
    proc = _bench("--device", "cpu", "--quick", "--methods", "torch,vpce-torch,floor,vpce-triton", "--out",
                  str(quick_out))
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return proc, json.loads((quick_out / "bench.json").read_text())


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


def test_cpu_run_says_times_mean_nothing(quick_run):
    proc, _ = quick_run
    assert CPU_NOTE in proc.stderr, proc.stderr
    assert CPU_NOTE in proc.stdout.split("| method")[0], proc.stdout  # above the first table


def test_quick_writes_a_plot_per_shape(quick_run, quick_out):
    pytest.importorskip("matplotlib")
    proc, doc = quick_run
    for s in doc["shapes"]:
        path = quick_out / f"bench-{s['name']}.png"
        assert path.exists(), f"{path} not written; stderr:\n{proc.stderr}"
        head = path.read_bytes()[:8]
        assert head == PNG and path.stat().st_size > 10_000, (path, head, path.stat().st_size)


@pytest.mark.parametrize("extra", [(), ("--sweep", "N"), ("--tp",)])
def test_cpu_refuses_gpu_sized_defaults(tmp_path, extra):
    """Without --quick and without --shapes, a CPU run stops at once with a one-line hint, and measures nothing."""
    proc = _bench("--device", "cpu", "--out", str(tmp_path), *extra, timeout=60)
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--quick" in lines[0] and "GPU-sized" in lines[0], proc.stderr
    assert not list(tmp_path.iterdir()), "a refused run wrote files"


def test_loss_option_rows_run_on_cpu(tmp_path):
    """The loss-option and log-prob rows use the backend that fits the device: torch on a CPU."""
    names = ["vpce-smooth", "vpce-zloss", "vpce-softcap", "vpce-weights", "vpce-all", "vpce-dft", "vpce-logprobs",
             "vpce-logprobs-entropy", "vpce-logprobs-top1", "vpce-metrics"]
    proc = _bench("--device", "cpu", "--quick", "--shapes", "tiny", "--methods", ",".join(["floor", *names]),
                  "--out", str(tmp_path), "--reps", "1", "--rep-time", "0")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    rows = {r["method"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    for name in names:
        r = rows[name]
        assert r["status"] == "ok" and r["label"].startswith("vpce torch "), r
        assert _finite(r["ms"]) and _finite(r["loss"]) and _finite(r["extra_gib"]), r
    for name in ("vpce-logprobs", "vpce-metrics"):  # the plain loss (metrics aside): checked against float64
        plain = rows[name]
        assert plain["loss_err"] < 1e-5 and plain["dx_err"] < 2e-2 and plain["dw_err"] < 2e-2, plain


def test_sweep_plot_keeps_the_points_where_the_floor_ran():
    """A sweep whose floor failed at its largest N (out of memory) still draws every other point's multiple."""
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from vpce.bench.plots import plot_series

    rows = [dict(ms=1.0 * n, x_floor=None if n == 8 else 1.1, extra_gib=0.5) for n in (2, 4, 8)]
    fig, panels = plt.subplots(1, 3)
    plot_series(panels, [2, 4, 8], rows, "vpce-triton", "vpce triton")
    (line,) = panels[1].get_lines()
    assert list(line.get_xdata()) == [2, 4] and list(line.get_ydata()) == [1.1, 1.1]
    assert len(panels[2].get_lines()[0].get_xdata()) == 3
    plt.close(fig)
