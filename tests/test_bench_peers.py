"""The benchmark's newer peers on CPU: fla-core's FLCE (``fla``), liger-kernel's FLCE through its CuTe DSL dispatch
(``liger-cute``), liger-kernel's per-token NLL + entropy with vpce-logprob-loss's loss (``liger-logprob-loss``) and
with verl's (``liger-verl``).

Each row is registered with its requirements and is ``missing`` with a reason where it cannot run. Where a peer has
a CPU path and is installed (fla-core under ``TRITON_INTERPRET=1``; liger-kernel's scaled cross-entropy fallback),
its row runs in ``--quick`` mode and is checked: fla's against float64, the RL rows against vpce's rows of the same
loss. A stand-in for liger-kernel's scaled cross-entropy, written from its documented outputs (per-token NLL in
fp32 and entropy, ignored tokens 0), checks without liger-kernel that the RL row computes vpce-logprob-loss's loss
and gradients, and a stand-in dispatcher that ``liger-cute`` asks for the CuTe DSL implementation by name. Under
``--tp`` on gloo, vpce-logprob-loss runs (replicated and ``--sp``) with the single-process loss, and the two peers'
vocab-parallel forms are ``missing`` (liger-kernel's needs CUDA; fla-core's gathers shapes gloo refuses).
"""

import importlib.util
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from distributed import run_commands

REPO = Path(__file__).resolve().parents[1]
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


class _ScaledCE:
    """Stand-in for liger-kernel 0.8.5's ``LigerFusedLinearScaledCrossEntropyFunction``, from its documented
    outputs: the per-token NLL in fp32 and the entropy in the input dtype of ``softmax(x @ w.T / temperature)``,
    both 0 on tokens whose target is ``ignore_index``."""

    calls = []

    @staticmethod
    def apply(x, w, y, temperature=1.0, ignore_index=-100, m_tiles_per_cluster=1, return_entropy=False):
        _ScaledCE.calls.append((temperature, ignore_index, m_tiles_per_cluster, return_entropy))
        logp = torch.log_softmax(F.linear(x, w).float() / temperature, -1)
        keep = y != ignore_index
        nll = -logp.gather(1, y.clamp(min=0)[:, None]).squeeze(1)
        ent = -(logp.exp() * logp).sum(-1)
        return torch.where(keep, nll, 0.0).float(), torch.where(keep, ent, 0.0).to(x.dtype)


def _stand_in_liger_ops(monkeypatch):
    ops = types.ModuleType("liger_kernel.ops")
    ops.LigerFusedLinearScaledCrossEntropyFunction = _ScaledCE
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.ops", ops)
    _ScaledCE.calls.clear()


def _loss_and_grads(fn, x, w, y):
    x, w = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = fn(x, w, y)
    loss.backward()
    return loss.detach(), x.grad, w.grad


@pytest.mark.parametrize("liger_row, vpce_row", [("liger-logprob-loss", "vpce-logprob-loss"),
                                                 ("liger-verl", "vpce-verl")])
def test_liger_rl_rows_compute_the_loss_of_vpce_rows(monkeypatch, liger_row, vpce_row):
    """Through the stand-in, in float64 on two 2048-token rows of per-sequence advantages: the liger row's loss, dX
    and dW are those of vpce's row of the same loss (to fp32 rounding), and it asks liger-kernel for NLL and
    entropy as verl does (temperature 1, ignore index -100, one tile per cluster)."""
    if liger_row == "liger-verl":
        pytest.importorskip("verl.trainer.ppo.core_algos")
    from vpce.bench.harness import Env
    from vpce.bench.methods import METHODS

    _stand_in_liger_ops(monkeypatch)
    env = Env(device=torch.device("cpu"), dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    n, d, v = 4096, 24, 97
    x = torch.randn(n, d, generator=gen, dtype=torch.float64)
    w = torch.randn(v, d, generator=gen, dtype=torch.float64) / d**0.5
    y = torch.randint(0, v, (n,), generator=gen)
    y[::5] = -100
    METHODS[liger_row].require(env)
    got = _loss_and_grads(METHODS[liger_row].build(env), x, w, y)
    want = _loss_and_grads(METHODS[vpce_row].build(env), x, w, y)
    assert _ScaledCE.calls and set(_ScaledCE.calls) == {(1.0, -100, 1, True)}, _ScaledCE.calls
    assert abs(float(want[0])) > 1e-3, want[0]
    for name, a, b in zip(("loss", "dX", "dW"), got, want):
        err = float((a - b).norm() / b.norm())
        # liger-kernel's NLL is fp32 whatever the input dtype: its rounding (2.3e-8 seen), not float64's
        assert err < 1e-6, f"{liger_row} vs {vpce_row}: {name} relative error {err:.2e}"


def test_liger_cute_asks_for_the_cutedsl_implementation(monkeypatch):
    """With a stand-in dispatcher: the row is ``missing`` with liger-kernel's own reason when the CuTe DSL FLCE
    cannot run on the device, and otherwise calls ``fused_linear_cross_entropy(x, w, y, impl="nvidia-cutedsl")``
    and takes its loss (the first output)."""
    from vpce.bench.harness import Env
    from vpce.bench.peers import Unavailable, liger_cute

    asked, why = [], []

    def resolve_impl(op, requested=None, device=None):
        asked.append((op, requested, device))
        if why:
            raise RuntimeError(why[0])

    def fused_linear_cross_entropy(x, w, y, *, impl=None):
        asked.append(impl)
        return F.cross_entropy(F.linear(x, w).float(), y), None, None, None

    backends = types.ModuleType("liger_kernel.backends")
    backends.resolve_impl = resolve_impl
    functional = types.ModuleType("liger_kernel.functional")
    functional.fused_linear_cross_entropy = fused_linear_cross_entropy
    monkeypatch.setitem(sys.modules, "liger_kernel", types.ModuleType("liger_kernel"))
    monkeypatch.setitem(sys.modules, "liger_kernel.backends", backends)
    monkeypatch.setitem(sys.modules, "liger_kernel.functional", functional)
    env = Env(device=torch.device("cpu"), dtype=torch.float32)
    why.append("Implementation 'nvidia-cutedsl' for op 'fused_linear_cross_entropy' is not available: compute "
               "capability 8.0 < 9.0")
    with pytest.raises(Unavailable, match=r"^liger-kernel's CuTe DSL FLCE is not available \(Implementation "
                                          r"'nvidia-cutedsl' .* 8\.0 < 9\.0\)$"):
        liger_cute(env)
    assert asked == [("fused_linear_cross_entropy", "nvidia-cutedsl", None)], asked
    why.clear()
    asked.clear()
    loss = liger_cute(env)
    x, w, y = torch.randn(8, 4), torch.randn(16, 4), torch.randint(0, 16, (8,))
    assert float(loss(x, w, y)) == float(F.cross_entropy(F.linear(x, w), y))
    assert asked == [("fused_linear_cross_entropy", "nvidia-cutedsl", None), "nvidia-cutedsl"], asked
    assert "CuTe DSL" in loss.note


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
