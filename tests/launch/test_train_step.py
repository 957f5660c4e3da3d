"""launch/train_step.py on the CPU: the ``--tiny`` configuration end to end, and its capacity search.

- Megatron-core under torchrun at tp=2 (gloo): a ``GPTModel`` trained for a few steps by Megatron's own loss twice
  (``megatron``, ``megatron-repeat``) and by vpce (``vpce``: ``apply(model, reduction="sum")`` with ``loss_mask``;
  ``vpce-per-token``: ``apply(model)``), tied embeddings. Both are fp32 on the CPU, so the repeat is bit-identical
  and vpce's loss stays within ``REL_TOL`` of Megatron's at every step (it differs by rounding only: vpce sums over
  vocab shards and token chunks in another order).
- transformers: a Llama trained by ``Trainer`` with the stock loss and with ``vpce.integrations.transformers``; and
  ``--isolate`` (the default on GPUs): each path in a child process of its own, with the same flags, and the
  children's reports merged (children faked here: one process per path costs a transformers import each).
- ``find_max``: doubling then bisection, against a fake device with a known capacity.

Every run is a subprocess with a timeout, so that a hung collective fails the test instead of hanging CI.
"""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "launch" / "train_step.py"
TIMEOUT_S = 180
# Largest |loss_vpce - loss_megatron| / loss_megatron allowed at any of the --tiny run's 8 steps (fp32 both): measured
# 1.3e-7 (megatron, tp=2) and 6e-8 (transformers) on this CPU; a wrong gradient moves the curves apart by 1e-3 within
# a few steps at this learning rate.
REL_TOL = 1e-5


def _module():
    name = "launch_train_step"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, SCRIPT)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules[name]


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    # the tiny CPU configuration (fp32, gloo), as on CI, also on a machine with GPUs: its tolerances are the CPU's
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    assert run.returncode == 0, (f"exit {run.returncode}\n--- stdout\n{run.stdout[-3000:]}\n"
                                 f"--- stderr\n{run.stderr[-4000:]}")
    return run


def _check_paths(report: dict, want: list[str], reference: str, steps: int) -> None:
    paths = report["paths"]
    assert list(paths) == want, list(paths)
    ref = paths[reference]["losses"]
    assert len(ref) == steps and ref[-1] < ref[0], f"{reference} did not train: {ref}"
    for name, r in paths.items():
        assert len(r["losses"]) == len(r["step_s"]) == steps, (name, len(r["losses"]), len(r["step_s"]))
        assert r["tokens_per_s"] > 0, (name, r["tokens_per_s"])
        diffs = [abs(a - b) / abs(b) for a, b in zip(r["losses"], ref)]
        worst = max(range(steps), key=diffs.__getitem__)
        assert diffs[worst] <= REL_TOL, (f"{name} vs {reference}: loss differs by {diffs[worst]:.2e} (relative) at "
                                         f"step {worst + 1}: {r['losses'][worst]} vs {ref[worst]}")


def test_megatron_tp2_vpce_matches_megatron(tmp_path):
    out = tmp_path / "megatron"
    paths = ["megatron", "megatron-repeat", "vpce", "vpce-per-token"]
    _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(SCRIPT),
          "megatron", "--tiny", "--tied", "--paths", ",".join(paths), "--out", str(out)])
    report = json.loads((out / "train_step.json").read_text())
    assert report["world"] == 2 and report["config"]["model"]["tied"], report["config"]
    steps = report["config"]["run"]["steps"]
    _check_paths(report, paths, "megatron", steps)
    repeat = report["paths"]["megatron-repeat"]["losses"]
    assert repeat == report["paths"]["megatron"]["losses"], "Megatron's own fp32 CPU path should repeat exactly"
    if importlib.util.find_spec("matplotlib") is not None:
        assert (out / "loss.png").stat().st_size > 0


def test_transformers_trainer_vpce_matches_stock(tmp_path):
    pytest.importorskip("transformers")
    out = tmp_path / "hf"
    _run([sys.executable, str(SCRIPT), "hf", "--tiny", "--paths", "stock,vpce", "--out", str(out)])
    report = json.loads((out / "train_step.json").read_text())
    _check_paths(report, ["stock", "vpce"], "stock", report["config"]["run"]["steps"])


def test_transformers_trainer_with_gradient_checkpointing(tmp_path):
    """``--gradient-checkpointing``: Trainer recomputes the decoder layers in backward; vpce's loss curve is stock's
    under the same flag, and the report says the flag was on."""
    pytest.importorskip("transformers")
    out = tmp_path / "hf-gc"
    _run([sys.executable, str(SCRIPT), "hf", "--tiny", "--gradient-checkpointing", "--paths", "stock,vpce", "--out",
          str(out)])
    report = json.loads((out / "train_step.json").read_text())
    assert report["config"]["gradient_checkpointing"] is True
    _check_paths(report, ["stock", "vpce"], "stock", report["config"]["run"]["steps"])


def test_gradient_checkpointing_is_refused_for_megatron():
    with pytest.raises(SystemExit):
        _module().parse(["megatron", "--tiny", "--gradient-checkpointing", "--out", "unused"])


def test_agreement_pairs_and_medians():
    """``--repeats``: Megatron's runs against each other (every pair), each other path's run k against Megatron's
    run k, and the medians over the pairs, on made-up curves whose differences are known."""
    m = lambda *xs: {"losses": list(xs)}  # noqa: E731
    runs = {"megatron": m(1.0, 2.0, 3.0), "vpce": m(1.0, 2.5, 3.0), "megatron#2": m(1.0, 2.0, 3.1),
            "vpce#2": m(1.2, 2.0, 3.1), "megatron#3": m(1.0, 2.4, 3.0), "vpce#3": m(1.0, 2.4, 3.3)}
    got = _module().agreement(runs, ["megatron", "vpce"], 3)
    noise, ours = got["megatron vs megatron"], got["vpce vs megatron"]
    assert [p["pair"] for p in noise["pairs"]] == [["megatron", "megatron#2"], ["megatron", "megatron#3"],
                                                   ["megatron#2", "megatron#3"]]
    assert [p["pair"] for p in ours["pairs"]] == [["vpce", "megatron"], ["vpce#2", "megatron#2"],
                                                  ["vpce#3", "megatron#3"]]
    assert [p["max"] for p in noise["pairs"]] == pytest.approx([0.1, 0.4, 0.4])
    assert [p["max"] for p in ours["pairs"]] == pytest.approx([0.5, 0.2, 0.3])
    assert noise["median_max"] == pytest.approx(0.4) and ours["median_max"] == pytest.approx(0.3)
    assert ours["median_mean"] == pytest.approx(0.1)  # means 0.5/3, 0.2/3, 0.3/3


@pytest.mark.parametrize("capacity", [1, 300, 512, 1000, 4095, 4096, 10_000, 70_000])
def test_find_max_doubles_then_bisects(capacity):
    find_max = _module().find_max
    tried = []

    def fits(n):
        tried.append(n)
        return n <= capacity

    best, trials = find_max(fits, start=512, cap=65536, granule=128)
    assert trials == [(n, n <= capacity) for n in tried]
    want = min(capacity, 65536)
    assert best <= want and (best > want - 128 or best == 65536), (capacity, best, trials)
    assert best == 0 or best % 128 == 0 or best in (512 * 2**k for k in range(8)), (best, trials)
    assert len(trials) <= 8 + 9, f"{len(trials)} trials: {trials}"


def test_out_of_memory_is_caught_and_the_search_goes_on():
    """``oom_guarded``: an OOM raised inside a step (as torch raises it) is a "does not fit", after ``cleanup``;
    the search around it ends at the capacity; any other error goes through."""
    import torch

    mod = _module()
    capacity, cleaned, held = 3000, [], []

    def step(seq):
        held.append(torch.empty(seq))  # what a step holds when it fails
        if seq > capacity:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {seq} bytes")
        held.clear()

    fits = mod.oom_guarded(step, lambda: (cleaned.append(len(held)), held.clear()), torch.device("cpu"),
                           lambda line: None, "fake", 1)
    best, trials = mod.find_max(fits, start=512, cap=65536, granule=128)
    assert 3000 - 128 < best <= 3000, (best, trials)
    assert len(cleaned) == sum(not ok for _, ok in trials) and all(n == 1 for n in cleaned), cleaned

    def broken(seq):
        raise RuntimeError("CUBLAS_STATUS_EXECUTION_FAILED")  # not an allocation failure

    with pytest.raises(RuntimeError, match="EXECUTION_FAILED"):
        mod.oom_guarded(broken, lambda: None, torch.device("cpu"), lambda line: None, "fake", 1)(512)


def test_isolate_runs_each_path_in_a_child_with_the_same_flags(tmp_path, monkeypatch):
    mod = _module()
    args = mod.parse(["hf", "--tiny", "--isolate", "--paths", "stock,vpce", "--out", str(tmp_path), "--seq", "48",
                      "--tied", "--lr", "0.01"])
    args.seed = 7
    commands, real_run = [], mod.subprocess.run

    def fake_run(cmd, **kwargs):
        if str(mod.__file__) not in cmd:  # describe(): git, uname
            return real_run(cmd, **kwargs)
        commands.append(cmd)
        out = Path(cmd[cmd.index("--out") + 1])
        path = cmd[cmd.index("--paths") + 1]
        losses = [3.0, 2.0] if path == "stock" else [3.0, 2.5]
        out.mkdir(parents=True)
        (out / "train_step.json").write_text(json.dumps({"paths": {path: {
            "losses": losses, "step_s": [0.1, 0.2], "peak_gib_per_rank": [1.0], "start_gib_per_rank": [0.0]}}}))

    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    import torch
    report = mod.run_hf(args, torch.device("cpu"), tmp_path, lambda line: None)
    assert [c[c.index("--paths") + 1] for c in commands] == ["stock", "vpce"]
    for cmd in commands:
        assert cmd[2:3] == ["hf"] and "--no-isolate" in cmd and "--tiny" in cmd and "--tied" in cmd, cmd
        assert cmd[cmd.index("--seq") + 1] == "48" and cmd[cmd.index("--seed") + 1] == "7", cmd
        assert cmd[cmd.index("--lr") + 1] == "0.01", cmd
    assert report["config"]["one_process_per_path"] is True
    assert report["paths"]["vpce"]["max_abs_loss_diff_vs_first"] == 0.5, report["paths"]["vpce"]
    assert report["paths"]["stock"]["tokens_per_s"] == pytest.approx(48 * 2 / 0.15), report["paths"]["stock"]
