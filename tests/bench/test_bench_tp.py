"""Smoke test of the tensor-parallel benchmark: ``torchrun --nproc-per-node 2 -m vpce.bench --tp`` on CPU (gloo).

Three runs at once, in subprocesses with a timeout: 2 ranks with the hidden states replicated, 2 ranks sequence
parallel (``--sp``) with a failure injected into one row on rank 1, and one process without torchrun. The
numbers are meaningless on CPU; what is checked is that every requested row comes back for every rank (measured
with finite time, memory and small errors, or reported ``missing``/``failed`` with a reason, never dropped),
that the run goes on after a row fails on one rank only, that the sharded float64 reference is the single-process
one, and that ``python -m vpce.bench.plots_tp`` reads the files.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from distributed import run_commands
from vpce.bench.harness import Env, Settings, Shape, make_problem
from vpce.reference import chunked_reference

REPO = Path(__file__).resolve().parents[2]
METHODS = ["floor", "megatron", "liger-tp", "chunked-tp", "loss-parallel", "vpce-triton", "vpce-torch"]
SHAPES = {"tiny": (256, 64, 1024), "tiny-odd": (200, 72, 2003)}  # V=2003: uneven shards at tp=2
EVEN_ONLY = {"megatron", "chunked-tp", "loss-parallel"}  # need V divisible by tp
NEEDS_CUDA = {"liger-tp", "vpce-triton"}
INJECTED = ("loss-parallel", 1)  # in the --sp run: this row raises on rank 1 only
# seconds for the three runs together: five processes on CI's two cores take 40-80 s alone and more under load; a
# hung collective still fails, first through the runs' own --timeout 60 (the collectives' timeout), then here
TIMEOUT = 240


def _command(out: Path, *extra: str, torchrun: bool = True) -> list[str]:
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if torchrun \
        else [sys.executable]
    return launch + ["-m", "vpce.bench", "--tp", "--device", "cpu", "--quick", "--methods", ",".join(METHODS),
                     "--out", str(out), "--timeout", "60", *extra]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench-tp")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    # ``--settle``: untimed calls, as many on every rank (from the agreed estimate; a count of a rank's own would
    # hang the vocab-parallel rows' collectives)
    cmds = {"replicated": _command(out / "replicated", "--settle", "0.05"),
            "sp": _command(out / "sp", "--sp", "--inject-failure", "@".join(map(str, INJECTED))),
            "one": _command(out / "one", "--shapes", "tiny", torchrun=False)}
    results = run_commands(cmds, cwd=REPO, env=env, timeout=TIMEOUT)
    files = {"replicated": out / "replicated" / "bench-tp2.json", "sp": out / "sp" / "bench-tp2-sp.json",
             "one": out / "one" / "bench-tp1.json"}
    return {k: (results[k][0], results[k][1], json.loads(files[k].read_text()), files[k]) for k in cmds}


def _finite(v):
    return isinstance(v, (int, float)) and math.isfinite(v)


@pytest.mark.parametrize("key", ["replicated", "sp"])
def test_header_and_tables(runs, key):
    stdout, _, doc, _ = runs[key]
    assert doc["schema"] == "vpce.bench.tp/1" and doc["tp"] == 2 and doc["world"] == 2
    assert doc["backend"] == "gloo" and doc["dtype"] == "bf16"
    assert doc["layout"] == ("sequence-parallel" if key == "sp" else "replicated")
    assert [d["rank"] for d in doc["devices"]] == [0, 1] and all(d["type"] == "cpu" and d["name"]
                                                                 for d in doc["devices"])
    assert doc["versions"]["torch"] and doc["versions"]["vpce"] and doc["command"].startswith("torchrun")
    assert [s["name"] for s in doc["shapes"]] == list(SHAPES)
    for col in ("ms", "x floor", "extra GiB", "loss err", "dX err", "dW err", "status", "r0 ms", "r1 GiB"):
        assert col in stdout, f"column {col!r} missing from:\n{stdout}"
    assert stdout.count("| vpce-torch ") == 2 * len(SHAPES), stdout  # the table and the per-rank table
    assert doc["settings"]["settle_s"] == (0.05 if key == "replicated" else 0.0), doc["settings"]


@pytest.mark.parametrize("key", ["replicated", "sp", "one"])
def test_reference_is_the_single_process_one(runs, key):
    """The float64 reference, computed on the shards with reduced statistics, is that of the whole problem."""
    _, _, doc, _ = runs[key]
    env = Env(device=torch.device("cpu"), dtype=torch.bfloat16)
    for s in doc["shapes"]:
        n, d, v = SHAPES[s["name"]]
        prob = make_problem(Shape(name=s["name"], n=n, d=d, v=v), env, Settings())
        ref = float(chunked_reference(prob.x, prob.w, prob.y).loss)
        assert abs(s["ref_loss"] - ref) <= 1e-12 * abs(ref), (s["name"], s["ref_loss"], ref)
        assert sum(s["rows_per_rank"]) == v and len(s["rows_per_rank"]) == doc["tp"]


@pytest.mark.parametrize("key", ["replicated", "sp", "one"])
def test_every_row_for_every_rank(runs, key):
    """Nothing dropped: each requested row comes back once per rank and once as the maximum over ranks."""
    _, _, doc, _ = runs[key]
    ranks = list(range(doc["tp"])) + ["max"]
    for s in doc["shapes"]:
        got = sorted((r["method"], str(r["rank"])) for r in doc["rows"] if r["shape"] == s["name"])
        assert got == sorted((m, str(k)) for m in METHODS for k in ranks), got


def _rows(doc, shape, method):
    rows = {r["rank"]: r for r in doc["rows"] if r["shape"] == shape and r["method"] == method}
    return rows["max"], [rows[k] for k in range(doc["tp"])]


@pytest.mark.parametrize("key", ["replicated", "sp", "one"])
def test_measured_rows(runs, key):
    _, _, doc, _ = runs[key]
    for s in doc["shapes"]:
        uneven = len(set(s["rows_per_rank"])) > 1
        assert s["floor"] and len(s["floor_ranks"]) == doc["tp"], s
        assert (s["comm"] is None) == (doc["tp"] == 1) and (s["comm"] is None or _finite(s["comm"]["ms"])), s
        floor, floor_ranks = _rows(doc, s["name"], "floor")
        assert floor["status"] == "ok" and all(_finite(r["ms"]) and r["ms"] > 0 for r in floor_ranks), floor
        measured = {"vpce-torch"} | (set() if uneven else EVEN_ONLY)
        if key == "sp":
            measured.discard(INJECTED[0])
        for m in measured:
            agg, per_rank = _rows(doc, s["name"], m)
            where = f"{key} {s['name']} {m}"
            assert agg["status"] == "ok" and all(r["status"] == "ok" for r in per_rank), (where, agg["status"])
            for r in per_rank + [agg]:
                for k in ("ms", "x_floor", "extra_gib", "loss", "loss_err", "dx_err", "dw_err"):
                    assert _finite(r[k]), f"{where} rank {r['rank']}: {k}={r[k]!r}"
                assert r["ms"] > 0 and r["extra_gib"] > 0 and r["reps"] >= 3, (where, r)
                # bf16: errors vs float64 are ~2e-3 for dX and dW; near 1 would mean a broken row or reference
                assert r["loss_err"] < 1e-3 and r["dx_err"] < 2e-2 and r["dw_err"] < 2e-2, (where, r)
            assert agg["ms"] == max(r["ms"] for r in per_rank), where
            assert agg["extra_gib"] == max(r["extra_gib"] for r in per_rank), where
            assert agg["x_floor"] == pytest.approx(agg["ms"] / floor["ms"]), where
            assert agg["loss_spread"] <= 1e-6 * abs(agg["loss"]), f"{where}: ranks returned different losses"
            if m == "vpce-torch":  # vpce's own bar: loss within 1e-5 of float64 (logits never rounded to bf16)
                assert agg["loss_err"] < 1e-5, (where, agg["loss_err"])


@pytest.mark.parametrize("key", ["replicated", "sp", "one"])
def test_missing_rows_say_why(runs, key):
    _, _, doc, _ = runs[key]
    for s in doc["shapes"]:
        uneven = len(set(s["rows_per_rank"])) > 1
        for m in NEEDS_CUDA | (EVEN_ONLY if uneven else set()):
            agg, per_rank = _rows(doc, s["name"], m)
            for r in per_rank + [agg]:
                assert r["status"].startswith("missing: "), (key, s["name"], m, r["status"])
                assert ("CUDA" in r["status"]) if m in NEEDS_CUDA else ("equal vocab shards" in r["status"]), r
                assert r["ms"] is None and r["loss_err"] is None, r


def test_failure_on_one_rank_is_reported_by_all(runs):
    """A row that raises on rank 1 only is ``failed`` on every rank, names rank 1, and the run goes on."""
    stdout, _, doc, _ = runs["sp"]
    method, rank = INJECTED
    agg, per_rank = _rows(doc, "tiny", method)
    for r in per_rank + [agg]:
        assert r["status"].startswith(f"failed: on rank {rank}: RuntimeError: injected failure"), r["status"]
        assert r["ms"] is None, r
    assert "injected failure" in per_rank[rank]["traceback"] and "traceback" in agg
    assert "injected failure" in stdout
    later = METHODS[METHODS.index(method) + 1:]
    assert any(_rows(doc, "tiny", m)[0]["status"] == "ok" for m in later), "the run stopped after the failure"


def test_plots_tp(runs, tmp_path):
    """plots_tp groups runs by shape, layout and tp: a copy of the tp=2 run relabelled tp=1 joins its group."""
    _, _, doc, path = runs["replicated"]
    fake = dict(doc, tp=1)
    (tmp_path / "tp1.json").write_text(json.dumps(fake))
    files = [str(tmp_path / "tp1.json"), str(path), str(runs["sp"][3])]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "vpce.bench.plots_tp", *files, "--out", str(tmp_path)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "| tp=1 " in proc.stdout and "| tp=2 " in proc.stdout and "hidden sequence-parallel" in proc.stdout
    assert "at every tp (the same problem)" in proc.stdout, proc.stdout
    pytest.importorskip("matplotlib")
    assert (tmp_path / "tp-tiny-replicated.png").stat().st_size > 0
    assert (tmp_path / "tp-tiny-sequence-parallel.png").stat().st_size > 0
    dup = subprocess.run([sys.executable, "-m", "vpce.bench.plots_tp", str(path), str(path)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert dup.returncode != 0 and "two runs at tp=2" in dup.stderr, dup.stderr


@pytest.mark.parametrize("key", ["replicated", "one"])
def test_cpu_note_and_plots(runs, key):
    """A CPU run says that its times mean nothing, and rank 0 draws each shape's maxima over ranks."""
    stdout, stderr, doc, path = runs[key]
    note = "say nothing about GPU kernels"
    assert note in stderr and note in stdout.split("| method")[0]
    pytest.importorskip("matplotlib")
    for s in doc["shapes"]:
        png = path.parent / f"{path.stem}-{s['name']}.png"
        assert png.exists() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", (png, stderr[-2000:])


def _same_as_liger_fallback(rank, world):
    from liger_kernel.ops.fused_linear_scaled_cross_entropy import \
        _TensorParallelFusedLinearPPOFallbackFunction as LigerFallback
    import torch.distributed as dist
    from vpce.bench.peers import chunked_vocab_parallel_nll
    from vpce.parallel import copy_to_vocab_parallel_region

    gen = torch.Generator().manual_seed(3)
    n, d, v = 1100, 40, 96 * world  # 1100 tokens: two full chunks of 512 and a partial one
    x = torch.randn(n, d, generator=gen).bfloat16()
    w = (torch.randn(v, d, generator=gen) / d ** 0.5).bfloat16()[rank * 96:(rank + 1) * 96]
    y = torch.randint(0, v, (n,), generator=gen)
    group = dist.group.WORLD
    x1, w1, x2, w2 = (t.clone().requires_grad_() for t in (x, w, x, w))
    loss1 = LigerFallback.apply(x1, w1, y, 1.0, -100, False, group).mean()
    loss1.backward()
    loss2 = chunked_vocab_parallel_nll(copy_to_vocab_parallel_region(x2, group), w2, y, group, rank * 96).mean()
    loss2.backward()
    return torch.equal(loss1, loss2), torch.equal(x1.grad, x2.grad), torch.equal(w1.grad, w2.grad)


def test_chunked_tp_is_liger_fallback():
    """The ``chunked-tp`` row computes exactly what liger-kernel's TP fallback computes (bitwise, gloo ranks)."""
    pytest.importorskip("liger_kernel.ops.fused_linear_scaled_cross_entropy")
    from distributed import run_ranks
    for rank, same in enumerate(run_ranks(_same_as_liger_fallback, 2, timeout=60)):
        assert same == (True, True, True), f"rank {rank}: (loss, dX, dW) bitwise equal to liger's fallback: {same}"


DISTILL_METHODS = ["floor", "torch-fkl", "vpce-fkl", "vpce-jsd"]


@pytest.fixture(scope="module")
def distill_run(tmp_path_factory):
    """``--tp --sp --distill`` on 2 gloo ranks, one shape with uneven vocab shards (V=2003)."""
    out = tmp_path_factory.mktemp("bench-tp-distill")
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "vpce.bench",
           "--tp", "--sp", "--distill", "--device", "cpu", "--quick", "--shapes", "tiny-odd", "--methods",
           ",".join(DISTILL_METHODS), "--reps", "1", "--rep-time", "0", "--out", str(out), "--timeout", "60"]
    try:
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the --tp --distill run did not finish within {TIMEOUT} s (hung collective?)")
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-6000:]}"
    return proc.stdout, json.loads((out / "bench-distill-tp2-sp.json").read_text())


def test_distill_vocab_parallel(distill_run):
    """vpce's distillation rows run vocab-parallel (sequence parallel: each rank's hidden and teacher-hidden slices),
    every rank's row comes back, the sharded float64 references are the single-process ones, the errors are
    small; plain torch has no vocab-parallel form and is ``missing``; the floor adds the teacher's GEMM."""
    from vpce.reference import reference_distillation

    stdout, doc = distill_run
    assert doc["schema"] == "vpce.bench.tp.distill/1" and doc["task"] == "distillation" and doc["tp"] == 2, doc.keys()
    (s,) = doc["shapes"]
    assert s["d_teacher"] == 96 and s["rows_per_rank"] == [1002, 1001] and s["tokens_per_rank"] == 100, s
    assert "teacher hidden all-gather" in s["comm"]["what"] and "teacher_logits_ms" in s["floor"], s
    prob = make_problem(Shape(name="tiny-odd", n=200, d=72, v=2003, d_teacher=96),
                        Env(device=torch.device("cpu"), dtype=torch.bfloat16), Settings())
    for (divergence, beta), label in ((("forward_kl", None), "forward KL"), (("jsd", 0.5), "JSD beta=0.5")):
        want = float(reference_distillation(prob.x, prob.w, prob.xt, prob.wt, divergence=divergence, beta=beta).loss)
        # float64 in the bench's own process: its BLAS may split the sums differently (another thread count;
        # 4.9e-12 relative seen in CI)
        assert s["ref_losses"][label] == pytest.approx(want, rel=1e-10), (label, s["ref_losses"], want)
    got = sorted((r["method"], str(r["rank"])) for r in doc["rows"])
    assert got == sorted((m, str(k)) for m in DISTILL_METHODS for k in (0, 1, "max")), got
    floor, _ = _rows(doc, "tiny-odd", "floor")
    assert floor["status"] == "ok" and floor["floor_gemms"] == "teacher logits+logits+dX+dW", floor
    agg, per_rank = _rows(doc, "tiny-odd", "torch-fkl")
    assert all(r["status"] == "missing: no vocab-parallel form (a single-GPU row)" for r in per_rank + [agg]), agg
    for m in ("vpce-fkl", "vpce-jsd"):
        agg, per_rank = _rows(doc, "tiny-odd", m)
        for r in per_rank + [agg]:
            assert r["status"] == "ok", (m, r)
            for k in ("ms", "x_floor", "extra_gib", "loss", "loss_err", "dx_err", "dw_err"):
                assert _finite(r[k]), f"{m} rank {r['rank']}: {k}={r[k]!r}"
        assert agg["loss_err"] < 1e-5 and agg["dx_err"] < 1e-2 and agg["dw_err"] < 1e-2, (m, agg)
        assert agg["loss_spread"] <= 1e-6 * abs(agg["loss"]), f"{m}: ranks returned different losses"
    assert "## tiny-odd distillation: N=200 D=72 teacher D_T=96 V=2003, bf16, tp=2" in stdout, stdout


def test_grpo_rows_under_sequence_parallelism(tmp_path):
    """``--tp --sp``: the GRPO and GSPO rows pass each rank its whole rows (``[B / world, T, D]``), the layout
    ``linear_grpo_loss`` takes under sequence parallelism, and give the loss of one process on the whole batch;
    where a rank's slice does not hold whole rows the row is ``missing``, saying so."""
    from vpce.bench.methods import METHODS as ROWS

    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    methods = ["vpce-grpo", "vpce-gspo"]
    shapes = {"rows": "4096x32x256", "slices": "tiny"}  # two rows of 2048 tokens; one row of 256
    cmds = {key: [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                  "vpce.bench", "--tp", "--sp", "--device", "cpu", "--shapes", shape, "--methods", ",".join(methods),
                  "--reps", "1", "--warmup", "0", "--rep-time", "0", "--timeout", "60", "--out", str(tmp_path / key)]
            for key, shape in shapes.items()}
    run_commands(cmds, cwd=REPO, env=env, timeout=TIMEOUT)
    docs = {key: json.loads((tmp_path / key / "bench-tp2-sp.json").read_text()) for key in cmds}
    cpu = Env(device=torch.device("cpu"), dtype=torch.bfloat16)
    prob = make_problem(Shape(name="rows", n=4096, d=32, v=256), cpu, Settings())
    for method in methods:
        with torch.no_grad():
            one = float(ROWS[method].build(cpu)(prob.x, prob.w, prob.y))
        rows = {r["rank"]: r for r in docs["rows"]["rows"] if r["method"] == method}
        for rank in (0, 1):
            assert rows[rank]["status"] == "ok" and rows[rank]["loss"] == pytest.approx(one, rel=1e-4), (rows, one)
        slices = [r for r in docs["slices"]["rows"] if r["method"] == method and r["rank"] in (0, 1)]
        assert len(slices) == 2 and all("must hold whole rows of 256 tokens" in r["status"] for r in slices), slices
