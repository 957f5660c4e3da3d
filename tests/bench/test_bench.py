"""Smoke test of the benchmark product: ``python -m vpce.bench`` on CPU with tiny shapes.

The numbers are meaningless on CPU; what is checked is that the product runs end to end, prints its tables (and
says that CPU times mean nothing), writes a JSON with every requested row measured (finite time, memory and errors
against float64) and a PNG per shape, reports rows it cannot run instead of dropping them, runs the loss-option
and log-prob rows on the torch backend, and refuses the GPU-sized default shapes on a CPU. The peers' rows that
run on a CPU (torch's ``F.linear_cross_entropy``) are checked against float64; quack's rows are ``missing`` on a
CPU, and a stand-in module checks how they call quack and that its known ``ValueError`` is a ``failed`` row. The
frozen-weight rows are divided by the two-GEMM floor and report no ``dW`` error.
"""

import dataclasses
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[2]


PNG = b"\x89PNG\r\n\x1a\n"
CPU_NOTE = "say nothing about GPU kernels"


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
    assert "| torch " in proc.stdout and "| vpce-torch " in proc.stdout  # rows named by their --methods key
    assert max(map(len, proc.stdout.splitlines())) <= 120, "a line of the report is wider than 120 columns"
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


@pytest.mark.parametrize("extra", [(), ("--sweep", "N"), ("--tp",), ("--distill",)])
def test_cpu_refuses_gpu_sized_defaults(tmp_path, extra):
    """Without --quick and without --shapes, a CPU run stops at once with a one-line hint, and measures nothing."""
    proc = _bench("--device", "cpu", "--out", str(tmp_path), *extra, timeout=60)
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--quick" in lines[0] and "GPU-sized" in lines[0], proc.stderr
    assert not list(tmp_path.iterdir()), "a refused run wrote files"


def _tiny_cpu_rows(tmp_path, names) -> dict:
    """The rows ``names`` (and the floor) on the tiny shape on a CPU, one rep: ``{method: row}`` of bench.json."""
    proc = _bench("--device", "cpu", "--quick", "--shapes", "tiny", "--methods", ",".join(["floor", *names]),
                  "--out", str(tmp_path), "--reps", "1", "--rep-time", "0")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    return {r["method"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}


def test_loss_option_rows_run_on_cpu(tmp_path):
    """The loss-option and log-prob rows use the backend that fits the device: torch on a CPU."""
    names = ["vpce-smooth", "vpce-zloss", "vpce-softcap", "vpce-weights", "vpce-all", "vpce-dft", "vpce-logprobs",
             "vpce-logprobs-entropy", "vpce-logprobs-top1", "vpce-metrics", "vpce-trl-sft"]
    rows = _tiny_cpu_rows(tmp_path, names)
    for name in names:
        r = rows[name]
        assert r["status"] == "ok" and r["label"].startswith(("vpce torch ", "vpce.integrations.trl")), r
        assert _finite(r["ms"]) and _finite(r["loss"]) and _finite(r["extra_gib"]), r
    for name in ("vpce-logprobs", "vpce-logprobs-top1", "vpce-metrics", "vpce-trl-sft"):  # plain loss: checked
        plain = rows[name]
        assert plain["loss_err"] < 1e-5 and plain["dx_err"] < 2e-2 and plain["dw_err"] < 2e-2, plain


def test_trl_rows_run_on_cpu(tmp_path):
    """TRL's fused LM head (its torch path on a CPU): the plain mean loss, checked against float64, and frozen."""
    pytest.importorskip("trl.kernels.chunked_logprob")
    names = ["trl", "trl-sft", "trl-sft-frozen"]
    rows = _tiny_cpu_rows(tmp_path, names)
    for name in names:
        r = rows[name]
        assert r["status"] == "ok" and r["label"].startswith("TRL fused LM head"), r
        assert r["loss_err"] < 1e-4 and r["dx_err"] < 2e-2, r  # (TRL's own rounding: 1.8e-5 here)
        assert name.endswith("frozen") or r["dw_err"] < 2e-2, r


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


TORCH_LCE_ROWS = ["torch-lce", "torch-lce-chunked", "torch-lce-accurate", "torch-lce-balanced", "torch-lce-ar1"]
FROZEN_ROWS = ["torch-frozen", "vpce-torch-frozen", "vpce-triton-frozen", "quack-frozen"]


@pytest.fixture(scope="module")
def rows_run(tmp_path_factory):
    """torch's F.linear_cross_entropy rows, quack's rows and the frozen-weight rows on CPU, one tiny shape."""
    out = tmp_path_factory.mktemp("rows")
    names = ["floor", "torch", *TORCH_LCE_ROWS, "quack", "quack-base", *FROZEN_ROWS]
    proc = _bench("--device", "cpu", "--quick", "--shapes", "tiny", "--methods", ",".join(names), "--out", str(out),
                  "--reps", "1", "--rep-time", "0", "--skip-no-grad")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    doc = json.loads((out / "bench.json").read_text())
    (shape,) = doc["shapes"]
    return proc, shape, {r["method"]: r for r in doc["rows"]}


def test_torch_linear_cross_entropy_rows(rows_run):
    """On torch >= 2.13 every F.linear_cross_entropy row runs on CPU; its loss comes back in bf16, so it matches
    float64 to bf16's rounding (2**-8 relative), and its gradients as closely as torch eager's. Older torch: missing."""
    _, shape, rows = rows_run
    for name in TORCH_LCE_ROWS:
        r = rows[name]
        if not hasattr(F, "linear_cross_entropy"):
            assert r["status"].startswith("missing:") and "linear_cross_entropy" in r["status"], r
            continue
        assert r["status"] == "ok" and r["label"].startswith("torch F.linear_cross_entropy"), r
        assert abs(r["loss"] - shape["ref_loss"]) <= 2**-8 * abs(shape["ref_loss"]), (r["loss"], shape["ref_loss"])
        assert r["dx_err"] < 2e-2 and r["dw_err"] < 2e-2, r
        assert _finite(r["ms"]) and _finite(r["extra_gib"]) and r["floor_gemms"] == "logits+dX+dW", r


def test_quack_rows_missing_on_cpu(rows_run):
    _, _, rows = rows_run
    for name in ("quack", "quack-base", "quack-frozen", "vpce-triton-frozen"):
        assert rows[name]["status"] == "missing: needs a CUDA device (running on cpu)", rows[name]


@pytest.mark.skipif(importlib.util.find_spec("quack") is not None, reason="quack-kernels is installed")
def test_quack_absent_is_unavailable():
    from vpce.bench.harness import Env
    from vpce.bench.peers import Unavailable, quack

    env = Env(device=torch.device("cpu"), dtype=torch.bfloat16)
    for scaled_exp in (True, False):
        with pytest.raises(Unavailable, match="quack-kernels not importable"):
            quack(env, scaled_exp=scaled_exp)


def test_frozen_rows_use_the_two_gemm_floor(rows_run):
    """A frozen row is divided by logits + dX (measured with the floor), a fwd+bwd row by all three GEMMs; the
    frozen row has no dW error, and torch eager's dX is the same with the weight frozen or not."""
    proc, shape, rows = rows_run
    floor = shape["floor"]
    assert floor["frozen_ms"] == pytest.approx(floor["logits_ms"] + floor["dx_ms"], rel=1e-12), floor
    assert floor["frozen_ms"] < floor["total_ms"], floor
    for name in ("torch-frozen", "vpce-torch-frozen"):
        r = rows[name]
        assert r["status"] == "ok" and r["mode"] == "frozen" and r["label"].endswith(" frozen W"), r
        assert r["floor_gemms"] == "logits+dX" and r["floor_ms"] == floor["frozen_ms"], r
        assert r["x_floor"] == pytest.approx(r["ms"] / floor["frozen_ms"], rel=1e-12), r
        assert r["dw_err"] is None and r["dx_err"] < 2e-2 and r["loss_err"] < 1e-3, r
    plain = rows["torch"]
    assert plain["mode"] == "fwd+bwd" and plain["floor_gemms"] == "logits+dX+dW", plain
    assert plain["floor_ms"] == floor["total_ms"] and plain["dw_err"] < 2e-2, plain
    assert rows["torch-frozen"]["dx_err"] == pytest.approx(plain["dx_err"], rel=1e-9), (rows["torch-frozen"], plain)
    table = proc.stdout.split("frozen lm_head")[1]
    assert "| method" in table and "x 2 GEMMs" in table and "| torch-frozen " in table, proc.stdout
    assert "dW err" not in table.split("\n\n")[0], table


def test_quack_rows_call_quack_and_its_failure_is_a_row(monkeypatch):
    """With a stand-in ``quack.linear_cross_entropy`` (on CPU): the rows call ``chunked_linear_cross_entropy(x, w,
    y, chunk_size=4096)`` and with ``use_scaled_exp=False``; the scaled-exp path's ValueError at chunk_size == D
    is a ``failed`` row with its traceback, and the rows after it still run."""
    from vpce.bench.harness import Env, Settings, Shape
    from vpce.bench.methods import METHODS
    from vpce.bench.report import Progress
    from vpce.bench.runner import run_shape

    calls = []

    def chunked_linear_cross_entropy(x, w, y, *, chunk_size, use_scaled_exp=None):
        calls.append((chunk_size, use_scaled_exp))
        if use_scaled_exp is None and chunk_size == x.shape[1]:
            raise ValueError("operand 'v': m == n makes row/col inference ambiguous")
        return F.cross_entropy(F.linear(x, w).float(), y)

    module = types.ModuleType("quack.linear_cross_entropy")
    module.chunked_linear_cross_entropy = chunked_linear_cross_entropy
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.linear_cross_entropy", module)
    names = ["quack", "quack-base", "quack-base-frozen"]
    for name in names:
        monkeypatch.setitem(METHODS, name, dataclasses.replace(METHODS[name], needs_cuda=False))
    env = Env(device=torch.device("cpu"), dtype=torch.bfloat16)
    settings = Settings(warmup=1, min_reps=1, max_reps=1, rep_time_s=0.0)
    record, rows = run_shape(Shape(name="d4096", n=16, d=4096, v=64), env, ["floor", *names], settings,
                             Progress(enabled=False))
    rows = {r["method"]: r for r in rows}
    failed = rows["quack"]
    assert failed["status"] == "failed: ValueError: operand 'v': m == n makes row/col inference ambiguous", failed
    assert "ValueError" in failed["traceback"] and failed["ms"] is None, failed
    assert calls[0] == (4096, None) and set(calls[1:]) == {(4096, False)}, calls
    for name in ("quack-base", "quack-base-frozen"):
        r = rows[name]
        assert r["status"] == "ok" and r["loss_err"] < 1e-3 and r["dx_err"] < 2e-2, r
    assert rows["quack-base"]["dw_err"] < 2e-2 and rows["quack-base-frozen"]["dw_err"] is None, rows
    assert rows["quack-base-frozen"]["floor_ms"] == record["floor"]["frozen_ms"], (rows, record)


@pytest.mark.parametrize("name,budget", [("vpce-triton-main-grad", "auto"), ("vpce-triton-lean-main-grad", "lean")])
def test_main_grad_row_and_chunked_floor(monkeypatch, name, budget):
    """The rows with ``accumulate_main_grad``, fast and lean (on CPU: the torch backend in their place): the harness
    gives the weight a zeroed fp32 ``main_grad`` before the first step, checks that as dW (as exact as the plain
    row's) and finds no ``w.grad``. A floor over token chunks (forced here: 3 chunks of 16 tokens, the last one
    short) says so in its label and record, and its rows are divided by it."""
    import functools

    from vpce.bench import runner
    from vpce.bench.harness import Env, Settings, Shape
    from vpce.bench.methods import METHODS, _vpce
    from vpce.bench.report import Progress

    monkeypatch.setitem(METHODS, name, dataclasses.replace(
        METHODS[name], needs_cuda=False,
        build=functools.partial(_vpce, backend="torch", memory_budget=budget, accumulate_main_grad=True)))
    monkeypatch.setattr(runner, "_floor_chunks", lambda n, v, env: 3)
    env = Env(device=torch.device("cpu"), dtype=torch.float32)
    settings = Settings(warmup=1, min_reps=1, max_reps=1, rep_time_s=0.0)
    record, rows = runner.run_shape(Shape(name="tiny", n=16, d=32, v=96), env, ["floor", "vpce-torch", name],
                                    settings, Progress(enabled=False))
    rows = {r["method"]: r for r in rows if r["mode"] != "no-grad"}
    r, plain = rows[name], rows["vpce-torch"]
    assert r["status"] == "ok" and plain["status"] == "ok", (r, plain)
    assert r["dw_err"] < 1e-5 and r["dx_err"] < 1e-5 and r["loss_err"] < 1e-6, r
    assert r["dw_err"] == pytest.approx(plain["dw_err"], rel=0.5, abs=1e-7), (r, plain)
    floor = record["floor"]
    assert floor["chunks"] == 3 and rows["floor"]["label"] == "floor: 3 GEMMs (over 3 token chunks)", rows["floor"]
    assert r["floor_ms"] == floor["total_ms"] > 0, (r, floor)


def test_profile_on_cpu(tmp_path):
    """``--profile`` on a CPU profiles CPU ops: a table per phase and per op for each row, the GEMMs where they
    belong (torch eager: logits, dX and dW; frozen: no dW), a row that cannot run said as missing."""
    proc = _bench("--device", "cpu", "--quick", "--shapes", "tiny", "--profile", "--methods",
                  "floor,torch,torch-frozen,vpce-torch,vpce-triton", "--profile-steps", "2", "--reps", "1",
                  "--rep-time", "0", "--out", str(tmp_path))
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    for label in ("torch eager", "torch eager frozen W", "vpce torch"):
        section = proc.stdout.split(f"## profile: {label}, tiny")[1].split("## profile")[0]
        assert "| phase" in section and "% of step" in section and "| op " in section, section
        assert "GEMMs (cuBLAS / CUTLASS)" in section and "(in no op:" in section, section
    assert "## profile: vpce triton, tiny" in proc.stdout and "missing: needs a CUDA device" in proc.stdout
    doc = json.loads((tmp_path / "profile.json").read_text())
    assert doc["schema"] == "vpce.bench.profile/1" and doc["steps"] == 2, doc.keys()
    rows = {r["method"]: r for r in doc["profiles"]}
    assert set(rows) == {"torch", "torch-frozen", "vpce-torch", "vpce-triton"}, sorted(rows)
    assert rows["vpce-triton"]["status"].startswith("missing:"), rows["vpce-triton"]
    for name in ("torch", "torch-frozen", "vpce-torch"):
        r = rows[name]
        assert r["status"] == "ok" and r["measured"] == "cpu ops (self time)", r["status"]
        assert _finite(r["step_ms"]) and r["profiled_step_ms"] > 0 and r["kernels"], r
        phase_ms = sum(p["ms"] for p in r["phases"])
        assert phase_ms == pytest.approx(r["kernels_ms"], rel=1e-9), (phase_ms, r["kernels_ms"])
        assert 0 < r["kernels_ms"] <= r["profiled_step_ms"] * 1.01, r  # self times: nested ops counted once
    gemms = {name: {k["name"]: k["calls"] for k in rows[name]["kernels"] if k["phase"].startswith("GEMMs")}
             for name in ("torch", "torch-frozen")}
    assert gemms == {"torch": {"aten::mm": 3}, "torch-frozen": {"aten::mm": 2}}, gemms


def test_profile_phases():
    """The phase table names vpce's kernels, cuBLAS's and NCCL's by their profiler names, and every Triton kernel
    of the package has a phase (a new kernel must be added to ``PHASES``)."""
    import re

    from vpce.bench.profile import OTHER, phase_of

    expected = {
        "_logits_tiles_kernel": "logits tiles (fused GEMM + softmax stats)",
        "_stored_logits_kernel": "stored logits -> stats / grad",
        "_target_logits_kernel": "stored logits -> stats / grad",
        "_target_out_of_lse_kernel": "stored logits -> stats / grad",
        "_distill_grad_kernel": "distillation passes",
        "_scale_cast_kernel": "casts / copies",
        "Memcpy DtoD (Device -> Device)": "casts / copies",
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)": "collectives",
        "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_warpgroupsize2x1x1": "GEMMs (cuBLAS / CUTLASS)",
        "nvjet_tst_256x128_64x4_1x2_h_bz_coopA_NTN": "GEMMs (cuBLAS / CUTLASS)",
        "_reduce_tiles_kernel": "reductions / combine",
        "_combine_rank_stats_kernel": "reductions / combine",
        "_grad_metrics_kernel": "reductions / combine",
        "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float>>": "reductions / combine",
        "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": "elementwise / fills",
        "aten::addmm_": "GEMMs (cuBLAS / CUTLASS)",
        "aten::mm": "GEMMs (cuBLAS / CUTLASS)",
        "aten::exp_": "elementwise / fills",
        "aten::copy_": "casts / copies",
        "cudaStreamSynchronize": OTHER,
    }
    got = {name: phase_of(name) for name in expected}
    assert got == expected, {k: (got[k], v) for k, v in expected.items() if got[k] != v}
    kernels = sorted({k for f in (REPO / "vpce").rglob("*.py")
                      for k in re.findall(r"^def (\w+_kernel)\(", f.read_text(), re.MULTILINE)})
    assert "_logits_tiles_kernel" in kernels and len(kernels) >= 5, kernels
    assert all(phase_of(k) != OTHER for k in kernels), {k: phase_of(k) for k in kernels}


def test_profile_defaults_to_vpce_on_the_device_backend(tmp_path, capsys):
    from vpce.bench.cli import main

    assert main(["--device", "cpu", "--quick", "--shapes", "tiny", "--profile", "--profile-steps", "1", "--reps", "1",
                 "--rep-time", "0", "--quiet", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "profile.json").read_text())
    assert doc["methods"] == ["vpce-torch"] and doc["profiles"][0]["status"] == "ok", doc["profiles"]
    assert "## profile: vpce torch, tiny" in capsys.readouterr().out


@pytest.mark.parametrize("argv, what", [(["--tp"], "--profile: expected without --tp"),
                                        (["--methods", "floor"], "got only the floor"),
                                        (["--profile-steps", "0"], "--profile-steps: expected a positive number")])
def test_profile_argument_errors(argv, what, capsys):
    from vpce.bench.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--quick", "--profile", *argv])
    assert e.value.code == 2 and what in capsys.readouterr().err


# -- --distill: vpce.linear_distillation_loss against plain torch and liger-kernel ---------------------------------

DISTILL_ROWS = ["floor", "torch-fkl", "liger-fkl", "vpce-fkl", "vpce-fkl-lean", "torch-jsd", "liger-jsd", "vpce-jsd",
                "vpce-jsd-lean", "torch-rkl", "liger-rkl", "vpce-rkl"]
DIVERGENCE_OF = {"fkl": ("forward_kl", None, "forward KL"), "jsd": ("jsd", 0.5, "JSD beta=0.5"),
                 "rkl": ("reverse_kl", None, "reverse KL")}


@pytest.mark.parametrize("divergence,beta", [("forward_kl", None), ("reverse_kl", None), ("jsd", 0.5), ("jsd", 0.2)])
def test_chunked_distillation_reference_is_the_dense_one(divergence, beta):
    """The benchmark's float64 reference (``vpce.reference.chunked_reference_distillation``, chunks of 5 tokens
    here) equals the dense oracle ``reference_distillation``: loss, dX and dW (stored in fp32)."""
    from vpce.reference import chunked_reference_distillation, reference_distillation, rel_err

    gen = torch.Generator().manual_seed(1)
    n, d, dt, v = 23, 11, 17, 61
    x, w = torch.randn(n, d, generator=gen).double(), (torch.randn(v, d, generator=gen) * 2 / d**0.5).double()
    xt, wt = torch.randn(n, dt, generator=gen).double(), (torch.randn(v, dt, generator=gen) * 2 / dt**0.5).double()
    got = chunked_reference_distillation(x, w, xt, wt, divergence=divergence, beta=beta, chunk_gib=5 * 8 * v / 2**30)
    want = reference_distillation(x, w, xt, wt, divergence=divergence, beta=beta)
    assert got.loss.dtype == torch.float64 and rel_err(got.loss, want.loss) < 1e-14, (got.loss, want.loss)
    assert rel_err(got.dhidden, want.dhidden) < 1e-7 and rel_err(got.dweight, want.dweight) < 1e-7


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory):
    """``--quick --distill`` on CPU, every distillation row (the default), one odd shape (V=2003, teacher D_T=96)."""
    out = tmp_path_factory.mktemp("distill")
    proc = _bench("--device", "cpu", "--quick", "--distill", "--shapes", "tiny-odd", "--reps", "1", "--rep-time", "0",
                  "--out", str(out))
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    doc = json.loads((out / "bench-distill.json").read_text())
    (shape,) = doc["shapes"]
    return proc, doc, shape, {r["method"]: r for r in doc["rows"]}


def test_distill_header_floor_and_reference(distill_run):
    """The JSON says it is a distillation run and what its rows compute; the floor is the teacher's logits GEMM plus
    the student's three, measured in the run; each divergence's float64 loss is the dense oracle's
    (``vpce.reference.reference_distillation``) on the same inputs."""
    from vpce.bench.harness import Env, Settings, Shape, make_problem
    from vpce.reference import reference_distillation

    proc, doc, shape, _ = distill_run
    assert doc["schema"] == "vpce.bench.distill/1" and doc["task"] == "distillation", doc.keys()
    assert doc["methods"] == DISTILL_ROWS and doc["distill"]["teacher_dim"] == 96, doc["distill"]
    assert shape["d_teacher"] == 96 and (shape["n"], shape["d"], shape["v"]) == (200, 72, 2003), shape
    floor = shape["floor"]
    parts = ("teacher_logits_ms", "logits_ms", "dx_ms", "dw_ms")
    assert all(_finite(floor[k]) and floor[k] > 0 for k in parts), floor
    assert floor["total_ms"] == pytest.approx(sum(floor[k] for k in parts), rel=1e-12) and "frozen_ms" not in floor
    assert shape["flops_fwd_bwd"] == 2 * 200 * 2003 * (96 + 3 * 72), shape
    env = Env(device=torch.device("cpu"), dtype=torch.bfloat16)
    prob = make_problem(Shape(name="tiny-odd", n=200, d=72, v=2003, d_teacher=96), env, Settings())
    assert list(shape["ref_losses"]) == [label for _, _, label in DIVERGENCE_OF.values()], shape["ref_losses"]
    for divergence, beta, label in DIVERGENCE_OF.values():
        want = float(reference_distillation(prob.x, prob.w, prob.xt, prob.wt, divergence=divergence, beta=beta).loss)
        # float64 in the bench's own process: its BLAS may split the sums differently (another thread count;
        # 4.9e-12 relative seen in CI)
        assert shape["ref_losses"][label] == pytest.approx(want, rel=1e-10), (label, shape["ref_losses"], want)
    # float64 math on the bf16 logits F.linear writes: the loss error every row starting from them inherits
    assert list(shape["gemm_logits_loss_errs"]) == list(shape["ref_losses"]), shape["gemm_logits_loss_errs"]
    for divergence, beta, label in DIVERGENCE_OF.values():
        s = torch.log_softmax(torch.nn.functional.linear(prob.x, prob.w).double(), -1)
        u = torch.log_softmax(torch.nn.functional.linear(prob.xt, prob.wt).double(), -1)
        q, p = u.exp(), s.exp()
        if divergence == "forward_kl":
            per = (q * (u - s)).sum(-1)
        elif divergence == "reverse_kl":
            per = (p * (s - u)).sum(-1)
        else:
            m = torch.log(beta * q + (1 - beta) * p)
            per = beta * (q * (u - m)).sum(-1) + (1 - beta) * (p * (s - m)).sum(-1)
        ref = shape["ref_losses"][label]
        want = abs(float(per.mean()) - ref) / abs(ref)
        got = shape["gemm_logits_loss_errs"][label]
        assert 0 < got < 1e-2 and got == pytest.approx(want, rel=1e-6, abs=1e-12), (label, got, want)
    flat = proc.stdout.replace("\n  ", " ")  # header lines are wrapped at 120 columns, continued with 2 spaces
    assert "## tiny-odd distillation: N=200 D=72 teacher D_T=96 V=2003" in flat, proc.stdout
    assert "= teacher logits " in flat and "float64 losses: forward KL " in flat, proc.stdout
    assert "; loss error of float64 math on the GEMM's logits: forward KL " in flat, proc.stdout
    assert CPU_NOTE in proc.stdout.split("| method")[0], proc.stdout


def test_distill_rows(distill_run):
    """Nothing dropped; every row is divided by the distillation floor; vpce's rows (torch backend on a CPU) and
    plain torch's are checked against the float64 reference of their own divergence, vpce's loss within 1e-5 and
    its gradients no worse than plain torch's; liger-kernel's rows are ``missing`` on a CPU."""
    proc, _, shape, rows = distill_run
    assert list(rows) == DISTILL_ROWS, list(rows)
    total = shape["floor"]["total_ms"]
    assert rows["floor"]["status"] == "ok" and rows["floor"]["label"] == "floor: teacher logits + 3 GEMMs"
    for name, r in rows.items():
        assert r["floor_gemms"] == "teacher logits+logits+dX+dW" and r["d_teacher"] == 96, r
        if name == "floor":
            continue
        divergence, beta, label = DIVERGENCE_OF[name.split("-")[1]]
        assert (r["divergence"], r["beta"]) == (divergence, beta) and label in r["label"], r
        if name.startswith("liger-"):
            assert r["status"] == "missing: needs a CUDA device (running on cpu)" and r["ms"] is None, r
            continue
        assert r["status"] == "ok", r
        for k in ("ms", "x_floor", "extra_gib", "loss", "loss_err", "dx_err", "dw_err"):
            assert _finite(r[k]), f"{name} {k}={r[k]!r}"
        assert r["floor_ms"] == total and r["x_floor"] == pytest.approx(r["ms"] / total, rel=1e-12), r
        assert r["ref_loss"] == shape["ref_losses"][label] and r["extra_gib"] > 0, r
        # bf16 inputs: plain torch's errors are ~1e-3 (its logits rounded to bf16); near 1 would be a broken row
        assert r["loss_err"] < 1e-3 and r["dx_err"] < 2e-2 and r["dw_err"] < 2e-2, r
    for name in ("vpce-fkl", "vpce-fkl-lean", "vpce-jsd", "vpce-jsd-lean", "vpce-rkl"):
        r, plain = rows[name], rows[f"torch-{name.split('-')[1]}"]
        assert r["label"].startswith("vpce torch "), r
        assert r["loss_err"] < 1e-5, r
        for k in ("dx_err", "dw_err"):
            assert r[k] <= 1.5 * plain[k], (name, k, r[k], plain[k])
    assert "| vpce-jsd-lean " in proc.stdout and "| torch-rkl " in proc.stdout


def test_distill_rows_missing_package_and_liger_convention(monkeypatch):
    """liger-kernel not installed: its rows are ``missing: liger-kernel not importable``. With a stand-in
    ``LigerFusedLinearJSD`` written from liger-kernel's documented definition (``X = log Q`` the student, ``Y = log P``
    the teacher, ``M = beta P + (1 - beta) Q``, ``beta P Y + (1 - beta) Q X - M log M``; ``jsd_beta`` 0 and 1 its
    forward and reverse KL; the sum over the labelled tokens' over their count), the rows call it with keywords and
    the mapped ``jsd_beta``, and match the float64 reference of vpce's divergence."""
    from vpce.bench.harness import Env, Settings, Shape
    from vpce.bench.methods import METHODS
    from vpce.bench.report import Progress
    from vpce.bench.runner import run_shape

    names = ["liger-fkl", "liger-jsd", "liger-rkl"]
    for name in names:
        monkeypatch.setitem(METHODS, name, dataclasses.replace(METHODS[name], needs_cuda=False))
    env = Env(device=torch.device("cpu"), dtype=torch.float32)
    settings = Settings(warmup=1, min_reps=1, max_reps=1, rep_time_s=0.0)
    shape = Shape(name="small", n=48, d=16, v=131, d_teacher=24)
    if importlib.util.find_spec("liger_kernel") is None:
        _, rows = run_shape(shape, env, ["floor", *names], settings, Progress(enabled=False))
        for r in rows[1:]:
            assert r["status"].startswith("missing: liger-kernel not importable"), r

    calls = []

    class LigerFusedLinearJSD(torch.nn.Module):
        def __init__(self, jsd_beta=0.5, ignore_index=-100, temperature=1.0):
            super().__init__()
            self.beta, self.ignore_index, self.temperature = jsd_beta, ignore_index, temperature

        def forward(self, student_input, student_weight, teacher_input, teacher_weight, shift_labels):
            calls.append((self.beta, self.temperature))
            X = torch.log_softmax((student_input @ student_weight.t()).float() / self.temperature, -1)
            Y = torch.log_softmax((teacher_input @ teacher_weight.t()).float().detach() / self.temperature, -1)
            Q, P = X.exp(), Y.exp()
            if self.beta == 0:
                loss = P * (Y - X)
            elif self.beta == 1:
                loss = Q * (X - Y)
            else:
                M = self.beta * P + (1 - self.beta) * Q
                loss = self.beta * P * Y + (1 - self.beta) * Q * X - M * M.log()
            keep = shift_labels != self.ignore_index
            return (loss.sum(-1) * keep).sum() / keep.sum()

    module = types.ModuleType("liger_kernel.transformers.fused_linear_jsd")
    module.LigerFusedLinearJSD = LigerFusedLinearJSD
    for parent in ("liger_kernel", "liger_kernel.transformers"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setitem(sys.modules, "liger_kernel.transformers.fused_linear_jsd", module)
    record, rows = run_shape(shape, env, ["floor", *names], settings, Progress(enabled=False))
    assert sorted(set(calls)) == [(0.0, 1.0), (0.5, 1.0), (1.0, 1.0)], calls
    for r in rows[1:]:
        assert r["status"] == "ok", r
        assert r["loss_err"] < 1e-5 and r["dx_err"] < 1e-4 and r["dw_err"] < 1e-4, r
    assert [r["ref_loss"] for r in rows[1:]] == list(record["ref_losses"].values()), (rows, record)


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed")
def test_liger_jsd_absent_is_unavailable():
    from vpce.bench.harness import Env
    from vpce.bench.peers import Unavailable, liger_jsd

    with pytest.raises(Unavailable, match="liger-kernel not importable"):
        liger_jsd(Env(device=torch.device("cpu"), dtype=torch.bfloat16), jsd_beta=0.5)


@pytest.mark.parametrize("argv, what", [
    (["--teacher-dim", "64"], "--teacher-dim: expected together with --distill"),
    (["--methods", "vpce-fkl"], "--methods: vpce-fkl: distillation rows, expected with --distill"),
    (["--distill", "--methods", "floor,vpce-torch"], "--methods: with --distill expected distillation rows"),
    (["--distill", "--sweep", "N"], "--sweep: expected without --distill"),
    (["--distill", "--teacher-dim", "0"], "--teacher-dim: expected a positive number")])
def test_distill_argument_errors(argv, what, capsys):
    from vpce.bench.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--quick", *argv])
    assert e.value.code == 2 and what in capsys.readouterr().err


def test_distill_profile_on_cpu(tmp_path, capsys):
    """``--profile --distill`` profiles vpce's forward KL and JSD steps on the distillation's inputs."""
    from vpce.bench.cli import main

    assert main(["--device", "cpu", "--quick", "--distill", "--shapes", "tiny", "--profile", "--profile-steps", "1",
                 "--reps", "1", "--rep-time", "0", "--quiet", "--out", str(tmp_path)]) == 0
    doc = json.loads((tmp_path / "profile.json").read_text())
    assert doc["methods"] == ["vpce-fkl", "vpce-jsd"], doc["methods"]
    assert all(p["status"] == "ok" and p["d_teacher"] == 96 and p["kernels"] for p in doc["profiles"]), doc["profiles"]
    assert "## profile: vpce torch JSD beta=0.5, tiny (N=256 D=64 D_T=96 V=1024)" in capsys.readouterr().out


def test_a_stalled_row_times_out_and_the_run_goes_on(monkeypatch):
    """--row-timeout: a row that stalls (a fake method whose step sleeps 120 s) is abandoned as ``failed: timeout``
    after the limit (5 s: room for the other rows on a loaded 2-core machine), the rows after it are measured, and
    the run takes about the limit, not the stall."""
    import time

    from vpce.bench.harness import Env, Settings, Shape
    from vpce.bench.methods import METHODS, Method
    from vpce.bench.report import Progress, format_shape
    from vpce.bench.runner import run_shape

    def slow(env):
        def fn(x, w, y):
            time.sleep(120)
            return F.cross_entropy(F.linear(x, w).float(), y)
        return fn
    monkeypatch.setitem(METHODS, "slow", Method(name="slow", label="sleeps 120 s", build=slow))
    env = Env(device=torch.device("cpu"), dtype=torch.float32)
    settings = Settings(warmup=1, min_reps=1, max_reps=1, rep_time_s=0.0, row_timeout_s=5.0)
    start = time.perf_counter()
    record, rows = run_shape(Shape(name="small", n=32, d=16, v=64), env, ["floor", "slow", "torch"], settings,
                             Progress(enabled=False), no_grad=False)
    took = time.perf_counter() - start
    by = {r["method"]: r for r in rows}
    assert by["slow"]["status"] == "failed: timeout after 5 s (in first_step)", by["slow"]
    assert by["slow"]["ms"] is None and by["slow"]["timeout_s"] == 5.0
    assert by["torch"]["status"] == "ok" and by["torch"]["after_timeout"] == "slow", by["torch"]
    assert "stalled" not in record
    assert took < 60, f"the run took {took:.1f} s: it waited for the stalled row"
    table = format_shape(record, rows, "fp32", "cpu")
    assert "| slow " in table and "failed: timeout" in table and "- failed: timeout after 5 s (in first_step): slow" \
        in table, table


def test_a_device_left_stalled_ends_the_run_with_the_rows_reported(monkeypatch):
    """After a timeout the device must answer a tiny op; when it does not (a kernel still holds the GPU), every
    remaining row is ``failed: not run: ...`` instead of queueing behind it (simulated on CPU)."""
    from vpce.bench import runner
    from vpce.bench.harness import Env, Settings, Shape
    from vpce.bench.methods import METHODS, Method
    from vpce.bench.report import Progress

    def slow(env):
        def fn(x, w, y):
            import time
            time.sleep(120)
        return fn
    monkeypatch.setitem(METHODS, "slow", Method(name="slow", label="sleeps 120 s", build=slow))
    monkeypatch.setattr(runner, "_device_responds", lambda env, timeout_s: False)
    env = Env(device=torch.device("cpu"), dtype=torch.float32)
    settings = Settings(warmup=1, min_reps=1, max_reps=1, rep_time_s=0.0, row_timeout_s=5.0)
    record, rows = runner.run_shape(Shape(name="small", n=32, d=16, v=64), env, ["floor", "slow", "torch"],
                                    settings, Progress(enabled=False), no_grad=False)
    by = {r["method"]: r for r in rows}
    assert by["slow"]["status"].startswith("failed: timeout"), by["slow"]
    assert by["torch"]["status"].startswith("failed: not run: cpu did not run a tiny op"), by["torch"]
    assert record["stalled"].startswith("cpu did not run a tiny op"), record


def test_a_device_error_after_a_timeout_ends_the_run_with_the_rows_reported(monkeypatch):
    """A row abandoned by its time limit may leave the device unusable without stalling it (quack's first step
    was capturing a CUDA graph, and the next synchronize raised): the run does not crash, the remaining rows are
    ``failed: not run: ...`` and the record says why. Without an abandoned row the same error propagates."""
    from vpce.bench import runner
    from vpce.bench.harness import Env, Settings, Shape
    from vpce.bench.methods import METHODS, Method
    from vpce.bench.report import Progress

    def slow(env):
        def fn(x, w, y):
            import time
            time.sleep(120)
        return fn

    # the error while this test's abandoned row's thread is alive (at once with ``always``); a name of its own,
    # since the other time-limit tests leave their sleeping threads behind
    def capturing(device):
        import threading
        if always or any(t.name == "vpce-bench row capturing" for t in threading.enumerate()):
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nmore")
    monkeypatch.setitem(METHODS, "capturing", Method(name="capturing", label="sleeps 120 s", build=slow))
    env = Env(device=torch.device("cpu"), dtype=torch.float32)
    settings = Settings(warmup=1, min_reps=1, max_reps=1, rep_time_s=0.0, row_timeout_s=5.0)
    shape = Shape(name="small", n=32, d=16, v=64)
    monkeypatch.setattr(runner, "free_memory", capturing)
    always = True
    with pytest.raises(RuntimeError, match="stream is capturing"):
        runner.run_shape(shape, env, ["floor", "torch"], settings, Progress(enabled=False), no_grad=False)
    always = False
    record, rows = runner.run_shape(shape, env, ["floor", "capturing", "torch", "floor"], settings,
                                    Progress(enabled=False), no_grad=False)
    by = {r["method"]: r for r in rows}
    want = ("cpu failed after capturing timed out: RuntimeError: CUDA error: operation not permitted when stream is "
            "capturing")
    assert by["capturing"]["status"].startswith("failed: timeout"), by["capturing"]
    assert by["torch"]["status"] == f"failed: not run: {want}", by["torch"]
    assert record["stalled"] == want, record


def test_quick_default_runs_what_is_installed_and_fits_120_columns(tmp_path):
    """--quick without --methods: only rows that run here (nothing ``missing``), every line within 120 columns,
    and the rows left out named once on stderr."""
    proc = _bench("--device", "cpu", "--quick", "--shapes", "tiny", "--skip-no-grad", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads((tmp_path / "bench.json").read_text())
    from vpce.bench.methods import QUICK
    assert doc["methods"] and set(doc["methods"]) <= set(QUICK), doc["methods"]
    assert all(r["status"] == "ok" for r in doc["rows"]), [(r["method"], r["status"]) for r in doc["rows"]]
    assert "vpce-torch" in doc["methods"] and "vpce-triton" not in doc["methods"]
    assert "note: --quick leaves out rows not installed or not for cpu: " in proc.stderr
    wide = [line for line in proc.stdout.splitlines() if len(line) > 120]
    assert not wide, wide


def test_torch_without_linear_cross_entropy_leaves_its_rows_out_of_quick(monkeypatch):
    """torch < 2.13 has no ``F.linear_cross_entropy``: its rows do not run here, so ``--quick`` leaves them out
    (found on the GPU image's torch 2.11, where --quick listed a row that came back ``missing``)."""
    import torch.nn.functional as F

    from vpce.bench import methods
    from vpce.bench.harness import Env

    monkeypatch.delattr(F, "linear_cross_entropy", raising=False)
    env = Env(device=torch.device("cpu"), dtype=torch.float32)
    assert not methods.runs_here("torch-lce", env) and methods.runs_here("torch", env)
    assert "torch-lce" in methods.quick_methods(env)[1]


def test_missing_optional_dependency_is_missing_for_every_row(monkeypatch):
    """A row whose module is not installed is ``missing`` before it is built: vpce's own TRL row as TRL's."""
    from vpce.bench import methods
    from vpce.bench.harness import Env
    from vpce.bench.peers import Unavailable

    monkeypatch.setattr(methods, "_installed", lambda module: module != "trl")
    env = Env(device=torch.device("cpu"), dtype=torch.float32)
    for name in ("trl", "trl-sft", "vpce-trl-sft", "vpce-trl-sft-frozen", "trl-sft-frozen"):
        with pytest.raises(Unavailable, match="trl not importable"):
            methods.METHODS[name].require(env)
    assert not methods.runs_here("vpce-trl-sft", env) and methods.runs_here("vpce-torch", env)


@pytest.mark.parametrize("settle, agreed, settled", [(0.0, 0.125, 0), (0.5, 0.125, 4), (0.5, 0.2, 3)])
def test_settle_runs_untimed_calls_from_the_agreed_estimate(settle, agreed, settled):
    """``--settle`` (``Settings.settle_s``): ``ceil(settle / estimate)`` untimed calls between the warm-up and the
    timed calls, the estimate the one every rank agrees on (under ``--tp`` each call holds collectives: a count
    from a rank's own estimate could differ between ranks)."""
    from vpce.bench.harness import Settings, measure

    calls = []
    timing = measure(lambda: calls.append(1), torch.device("cpu"),
                     Settings(warmup=2, min_reps=3, max_reps=3, rep_time_s=0.0, settle_s=settle),
                     agree=lambda est: agreed)
    assert len(timing.samples) == 3
    assert len(calls) == 2 + settled + 3, (len(calls), settled)


def test_settle_argument_is_recorded(quick_run):
    _, doc = quick_run
    assert doc["settings"]["settle_s"] == 0.0


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_settle_must_be_seconds_at_least_zero(value, capsys):
    from vpce.bench.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--device", "cpu", "--quick", "--settle", value])
    assert e.value.code == 2 and "--settle: expected seconds >= 0" in capsys.readouterr().err


def test_a_base_exception_fails_its_row_and_an_abandoned_tuner_leaves_no_pool_on(monkeypatch):
    """A row whose step raises a ``BaseException`` that is not an interrupt (quack's ``CompilePending`` is one) is
    ``failed: ...``, never "ok" with nothing measured, and the run goes on. After a row is abandoned by its time
    limit, quack's ``suppress_pool`` is entered once for the rest of the process: a quack autotuner abandoned
    mid-tune leaves its compile pool on for every thread (simulated: a fake ``quack.cache.async_compile``)."""
    import sys
    import time
    import types

    from vpce.bench import runner
    from vpce.bench.harness import Env, Settings, Shape
    from vpce.bench.methods import METHODS, Method
    from vpce.bench.report import Progress

    class Pending(BaseException):
        pass

    entered = []

    class suppress_pool:
        def __enter__(self):
            entered.append(self)

        def __exit__(self, *exc):
            entered.remove(self)

    fake = types.ModuleType("quack.cache.async_compile")
    fake.suppress_pool = suppress_pool
    for name, mod in (("quack", types.ModuleType("quack")), ("quack.cache", types.ModuleType("quack.cache")),
                      ("quack.cache.async_compile", fake)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(runner, "_IN_PROCESS", [])

    def pending(env):
        def fn(x, w, y):
            raise Pending("kernel compile pending in pool")
        return fn

    def slow(env):
        def fn(x, w, y):
            time.sleep(120)
        return fn
    monkeypatch.setitem(METHODS, "pending", Method(name="pending", label="raises a BaseException", build=pending))
    monkeypatch.setitem(METHODS, "tuning", Method(name="tuning", label="sleeps 120 s", build=slow))
    env = Env(device=torch.device("cpu"), dtype=torch.float32)
    settings = Settings(warmup=1, min_reps=1, max_reps=1, rep_time_s=0.0, row_timeout_s=5.0)
    shape = Shape(name="small", n=32, d=16, v=64)
    record, rows = runner.run_shape(shape, env, ["floor", "pending", "torch"], settings, Progress(enabled=False),
                                    no_grad=False)
    by = {r["method"]: r for r in rows}
    assert by["pending"]["status"] == "failed: Pending: kernel compile pending in pool", by["pending"]
    assert by["torch"]["status"] == "ok" and not entered, (by["torch"], entered)
    record, rows = runner.run_shape(shape, env, ["floor", "tuning", "torch", "pending"], settings,
                                    Progress(enabled=False), no_grad=False)
    by = {r["method"]: r for r in rows}
    assert by["tuning"]["status"].startswith("failed: timeout") and by["torch"]["status"] == "ok", rows
    assert len(entered) == 1 and runner._IN_PROCESS == entered, entered
    runner._compile_in_process()  # once per process
    assert len(entered) == 1

    def interrupted():
        raise KeyboardInterrupt
    with pytest.raises(KeyboardInterrupt):  # an interrupt still ends the run
        runner.run_phases(runner.new_row(shape, env, "x", "x", "fwd+bwd"), [interrupted])
