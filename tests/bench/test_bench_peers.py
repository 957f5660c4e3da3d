"""The benchmark's newer peers on CPU: fla-core's FLCE (``fla``), liger-kernel's FLCE through its CuTe DSL dispatch
(``liger-cute``), liger-kernel's per-token NLL + entropy with vpce-logprob-loss's loss (``liger-logprob-loss``) and
with verl's (``liger-verl``).

Each row is registered with its requirements and is ``missing`` with a reason where it cannot run. Where a peer has
a CPU path and is installed (fla-core under ``TRITON_INTERPRET=1``; liger-kernel's scaled cross-entropy fallback),
its row runs in ``--quick`` mode and is checked: fla's against float64, the RL rows against vpce's rows of the same
loss (``make test`` installs both peers, without their requirements). Under ``--tp`` on gloo, vpce-logprob-loss runs (replicated and ``--sp``) with the single-process loss, and the two peers'
vocab-parallel forms are ``missing`` (liger-kernel's needs CUDA; fla-core's gathers shapes gloo refuses).
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_commands

REPO = Path(__file__).resolve().parents[2]
NEW_ROWS = ("fla", "liger-cute", "liger-logprob-loss", "liger-verl")


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def _env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1", **extra)


def test_rows_registered():
    """The rows, what they need and what ``--tp`` and ``--quick`` make of them."""
    from vpce.bench.methods import METHODS, QUICK, default_methods

    fla, cute, rl, verl = (METHODS[n] for n in NEW_ROWS)
    assert fla.requires == ("fla",) and fla.package == "fla-core" and fla.plain
    assert fla.needs_cuda and fla.triton_interpret and fla.tp and fla.even_shards
    assert cute.requires == ("liger_kernel", "cutlass") and cute.needs_cuda and not cute.tp and cute.plain
    assert "CuTe DSL" in cute.label and "nvidia-cutedsl" in cute.label
    assert rl.requires == ("liger_kernel",) and rl.tp and rl.even_shards and not rl.plain and not rl.needs_cuda
    assert "vpce-logprob-loss" in rl.label
    assert verl.requires == ("liger_kernel", "verl") and not verl.tp and not verl.plain
    assert METHODS["vpce-logprob-loss"].tp
    tp_rows = default_methods(tp=True)
    assert {"fla", "liger-logprob-loss", "vpce-logprob-loss"} <= set(tp_rows), tp_rows
    assert not {"liger-cute", "liger-verl"} & set(tp_rows), tp_rows
    assert set(NEW_ROWS) <= set(default_methods(tp=False))
    assert {"fla", "liger-cute"} <= set(QUICK)


def test_rows_missing_without_their_packages(monkeypatch):
    """Before a row is built: the distribution it lacks, named; fla on a CPU without the Triton interpreter, and
    liger-cute on any CPU, need a CUDA device."""
    from vpce.bench import methods
    from vpce.bench.harness import Env
    from vpce.bench.peers import Unavailable

    cpu = Env(device=torch.device("cpu"), dtype=torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(methods, "_installed", lambda module: module not in ("fla", "liger_kernel", "cutlass"))
    with pytest.raises(Unavailable, match=r"^fla-core not importable \(no module 'fla'\)$"):
        methods.METHODS["fla"].require(cpu)
    for name in ("liger-logprob-loss", "liger-verl"):
        with pytest.raises(Unavailable, match=r"^liger-kernel not importable"):
            methods.METHODS[name].require(cpu)
    monkeypatch.setattr(methods, "_installed", lambda module: module != "cutlass")
    methods.METHODS["fla"].require(cpu)  # the interpreter runs its Triton kernels
    assert methods.runs_here("fla", cpu) and not methods.runs_here("liger-cute", cpu)
    with pytest.raises(Unavailable, match=r"^needs a CUDA device \(running on cpu\)$"):
        methods.METHODS["liger-cute"].require(cpu)
    cuda = Env(device=torch.device("cuda"), dtype=torch.bfloat16)
    with pytest.raises(Unavailable, match=r"^nvidia-cutlass-dsl not importable \(no module 'cutlass'\)$"):
        methods.METHODS["liger-cute"].require(cuda)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(Unavailable, match=r"^needs a CUDA device \(running on cpu; or TRITON_INTERPRET=1 for its "
                                          r"Triton kernels\)$"):
        methods.METHODS["fla"].require(cpu)
    assert not methods.runs_here("fla", cpu)


@pytest.fixture(scope="module")
def cpu_rows(tmp_path_factory):
    """The new rows and vpce's rows of the same losses, ``--quick`` on CPU (the Triton interpreter on)."""
    out = tmp_path_factory.mktemp("peers")
    names = ["floor", "torch", *NEW_ROWS, "vpce-logprob-loss", "vpce-verl"]
    proc = subprocess.run([sys.executable, "-m", "vpce.bench", "--device", "cpu", "--quick", "--shapes", "tiny",
                           "--methods", ",".join(names), "--reps", "1", "--rep-time", "0", "--skip-no-grad", "--out",
                           str(out)], cwd=REPO, env=_env(TRITON_INTERPRET="1"), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
    doc = json.loads((out / "bench.json").read_text())
    return doc, {r["method"]: r for r in doc["rows"]}


def test_quick_rows_on_cpu(cpu_rows):
    """Installed, fla runs in the Triton interpreter and is as exact as torch eager against float64; liger-kernel's
    RL rows run its torch fallback and compute the losses of vpce's rows. Not installed: ``missing``, named."""
    doc, rows = cpu_rows
    assert set(rows) == {"floor", "torch", *NEW_ROWS, "vpce-logprob-loss", "vpce-verl"}, sorted(rows)
    assert rows["liger-cute"]["status"] == "missing: needs a CUDA device (running on cpu)", rows["liger-cute"]
    fla = rows["fla"]
    if _installed("fla"):
        assert fla["status"] == "ok" and doc["versions"]["fla-core"] == "0.6.0", (fla, doc["versions"])
        assert fla["loss_err"] < 1e-3 and fla["dx_err"] < 2e-2 and fla["dw_err"] < 2e-2, fla
        assert fla["dx_err"] <= 3 * rows["torch"]["dx_err"] and fla["dw_err"] <= 3 * rows["torch"]["dw_err"], fla
    else:
        assert fla["status"].startswith("missing: fla-core not importable"), fla
    for liger_row, vpce_row in (("liger-logprob-loss", "vpce-logprob-loss"), ("liger-verl", "vpce-verl")):
        r, v = rows[liger_row], rows[vpce_row]
        if not _installed("liger_kernel") or (liger_row == "liger-verl" and not _installed("verl")):
            assert r["status"].startswith("missing: ") and "not importable" in r["status"], r
            continue
        assert r["status"] == "ok" and v["status"] == "ok", (r, v)
        # bf16 inputs; the peers' logits are bf16 GEMM outputs, vpce's fp32-accumulated: 1.7e-5 apart seen
        assert r["loss"] == pytest.approx(v["loss"], rel=1e-3) and abs(r["loss"]) > 1e-3, (r, v)


# -- --tp on gloo ---------------------------------------------------------------------------------------------------

TP_METHODS = ["floor", "fla", "liger-logprob-loss", "vpce-logprob-loss"]
TP_TIMEOUT = 240  # seconds for the two runs together (four ranks on two cores); a hung collective fails first
# through the runs' own --timeout 60


@pytest.fixture(scope="module")
def tp_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("peers-tp")
    cmds = {key: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                  "vpce.bench", "--tp", "--device", "cpu", "--quick", "--shapes", "tiny", "--methods",
                  ",".join(TP_METHODS), "--reps", "1", "--rep-time", "0", "--timeout", "60", "--out", str(out / key),
                  *extra] for key, extra in (("replicated", ()), ("sp", ("--sp",)))}
    run_commands(cmds, cwd=REPO, env=_env(TRITON_INTERPRET="1"), timeout=TP_TIMEOUT)
    return {key: json.loads((out / key / ("bench-tp2-sp.json" if key == "sp" else "bench-tp2.json")).read_text())
            for key in cmds}


@pytest.mark.parametrize("key", ["replicated", "sp"])
def test_tp_rows_on_gloo(tp_runs, key):
    """vpce-logprob-loss runs vocab-parallel on every rank with the loss of one process on the whole vocab (the
    same under --sp, where its hidden states are each rank's slice of the tokens); liger-kernel's TP function and
    fla-core's process_group path are ``missing`` with their reasons, on every rank alike."""
    from vpce.bench.harness import Env, Settings, Shape, make_problem
    from vpce.bench.methods import METHODS

    doc = tp_runs[key]
    rows = {(r["method"], r["rank"]): r for r in doc["rows"]}
    assert set(rows) == {(m, k) for m in TP_METHODS for k in (0, 1, "max")}, sorted(rows, key=str)
    env = Env(device=torch.device("cpu"), dtype=torch.bfloat16)
    (shape,) = doc["shapes"]
    prob = make_problem(Shape(name="tiny", n=shape["n"], d=shape["d"], v=shape["v"]), env, Settings())
    with torch.no_grad():
        one = float(METHODS["vpce-logprob-loss"].build(env)(prob.x, prob.w, prob.y))
    for rank in (0, 1, "max"):
        r = rows[("vpce-logprob-loss", rank)]
        assert r["status"] == "ok" and r["loss"] == pytest.approx(one, rel=1e-5), (r, one)
        liger = rows[("liger-logprob-loss", rank)]["status"]
        if _installed("liger_kernel"):
            assert liger == "missing: liger-kernel's tensor-parallel function needs CUDA tensors (running on cpu)"
        else:
            assert liger.startswith("missing: liger-kernel not importable"), liger
        fla = rows[("fla", rank)]["status"]
        want = "all_gather_into_tensor, whose shapes gloo refuses" if _installed("fla") else "fla-core not importable"
        assert fla.startswith("missing: ") and want in fla, fla
