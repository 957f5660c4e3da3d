"""The hopper extra's kernels built in a child process while the first calls run without them
(``vpce.backends.hopper``): the state of one process's builds, with children that stand in for the compiler, and the
real child where quack-kernels is installed (it compiles without a GPU)."""

import os
import subprocess
import sys
import time
import warnings

import pytest
import torch

import vpce
from vpce.backends import hopper

PY = sys.executable


def _builds(script: str, loaded=True):
    """``Builds`` whose child runs ``script`` and whose import of quack counts its calls."""
    calls = []

    def load():
        calls.append(1)
        return loaded
    return hopper.Builds(command=lambda dtype, name: [PY, "-c", script], env=hopper.child_env, load=load), calls


def _until(fn, timeout=30.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if fn():
            return True
        time.sleep(0.02)
    return False


def test_not_ready_while_the_child_runs_then_ready_once_it_has_ended(tmp_path):
    gate = tmp_path / "go"
    builds, loads = _builds(f"import os, time\nwhile not os.path.exists({str(gate)!r}): time.sleep(0.01)")
    args = (torch.bfloat16, "NVIDIA H200", (9, 0))
    assert builds.ready(*args) is False and builds.ready(*args) is False
    assert loads == [], "quack is imported only once the child has ended"
    gate.touch()
    assert _until(lambda: builds.ready(*args)), "ready once the child has ended"
    assert builds.ready(*args) is True and loads == [1], "one import for the process"
    other = (torch.float16, "NVIDIA H200", (9, 0))  # another dtype: its own child, the same import
    assert _until(lambda: builds.ready(*other)) and loads == [1]


def test_ready_once_the_child_says_a_plain_calls_kernels_are_built_while_it_goes_on(tmp_path):
    gate = tmp_path / "go"
    builds, loads = _builds("import os, time\nprint('ready', flush=True)\n"
                            f"while not os.path.exists({str(gate)!r}): time.sleep(0.01)")
    args = (torch.bfloat16, "NVIDIA H200", (9, 0))
    assert _until(lambda: builds.ready(*args)), "ready on the child's line, before it ends"
    child = builds._children[(torch.bfloat16, "NVIDIA H200")]
    assert child.proc is not None and child.proc.poll() is None and loads == [1]
    gate.touch()
    assert _until(lambda: builds.ready(*args) and child.proc is None), "the ended child is reaped"


def test_a_failed_child_is_named_once_and_the_kernels_then_compile_in_process():
    builds, loads = _builds("import sys; print('no compiler here', file=sys.stderr); sys.exit(3)")
    args = (torch.bfloat16, "NVIDIA H100 80GB HBM3", (9, 0))
    hopper._warn.cache_clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert _until(lambda: builds.ready(*args))
        builds.ready(*args)
    said = [str(w.message) for w in seen]
    assert len(said) == 1 and "exit 3" in said[0] and "no compiler here" in said[0], said
    assert loads == [1]


def test_a_child_that_cannot_start_is_named_and_the_import_goes_on():
    builds = hopper.Builds(command=lambda dtype, name: [os.path.join(os.sep, "no", "such", "python")],
                           env=hopper.child_env, load=lambda: True)
    hopper._warn.cache_clear()
    with pytest.warns(RuntimeWarning, match="could not start"):
        assert builds.ready(torch.bfloat16, "NVIDIA H200", (9, 0)) is True


def test_a_broken_extra_is_named_and_left_off():
    def load():
        raise ImportError("cutlass: undefined symbol")
    builds = hopper.Builds(command=lambda dtype, name: [PY, "-c", "pass"], env=hopper.child_env, load=load)
    hopper._warn.cache_clear()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not _until(lambda: builds.ready(torch.bfloat16, "NVIDIA H200", (9, 0)), timeout=1.0)
    assert [w for w in seen if "failed to load" in str(w.message) and "undefined symbol" in str(w.message)]


def test_wait_returns_once_the_child_has_ended_and_stops_one_past_its_time(tmp_path):
    builds, loads = _builds("import time; time.sleep(0.3)")
    t0 = time.monotonic()
    assert builds.wait(torch.bfloat16, "NVIDIA H200", (9, 0), timeout=60) is True
    assert time.monotonic() - t0 >= 0.3 and loads == [1]
    slow, _ = _builds("import time; time.sleep(60)")
    hopper._warn.cache_clear()
    with pytest.warns(RuntimeWarning, match="stopped after 1 s"):
        t0 = time.monotonic()
        assert slow.wait(torch.bfloat16, "NVIDIA H200", (9, 0), timeout=1) is True
    assert time.monotonic() - t0 < 30


def test_the_child_sees_no_gpu_and_compiles_for_the_gpus_architecture():
    env = hopper.child_env((9, 0))
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["QUACK_ARCH"] == "sm_90" and env["CUTE_DSL_ARCH"] == "sm_90a"
    cmd = hopper.child_command(torch.float16, "NVIDIA H200")
    assert cmd[1:] == ["-m", "vpce.backends.hopper_child", "--dtype", "fp16", "--device-name", "NVIDIA H200"]
    with pytest.raises(TypeError, match="dtype: expected torch.bfloat16 or torch.float16.*torch.float32"):
        hopper.child_command(torch.float32, "NVIDIA H200")


def test_build_without_an_sm90_gpu_says_no_and_checks_its_arguments():
    with pytest.raises(TypeError, match="dtype"):
        vpce.build_hopper_kernels(dtype=torch.float32)
    if not torch.cuda.is_available():
        assert vpce.build_hopper_kernels() is False
        assert vpce.build_hopper_kernels(wait=False) is False


def test_deterministic_algorithms_wait_for_the_kernels():
    was = torch.are_deterministic_algorithms_enabled()
    try:
        torch.use_deterministic_algorithms(True)
        assert hopper._blocking()
        torch.use_deterministic_algorithms(False)
        assert hopper._blocking() == (os.environ.get("QUACK_CACHE_ENABLED", "1") != "1")
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.skipif(not hopper.installed() or torch.cuda.is_available(),
                    reason="needs the hopper extra (quack-kernels); on a GPU the suite's own build runs it")
def test_the_real_child_compiles_every_kernel_without_a_gpu(tmp_path):
    """The child on this machine with no GPU visible: quack writes one compiled object per kernel of bf16 (dW, dX,
    the four statistics epilogues, dW after earlier chunks), and a second child finds them all."""
    env = dict(hopper.child_env((9, 0)), QUACK_CACHE_DIR=str(tmp_path))
    cmd = hopper.child_command(torch.bfloat16, "NVIDIA H200")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    objects = sorted(tmp_path.rglob("*.o"))
    assert len(objects) == 7, (objects, done.stderr[-2000:])
    stamps = [o.stat().st_mtime_ns for o in objects]
    again = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0 and [o.stat().st_mtime_ns for o in sorted(tmp_path.rglob("*.o"))] == stamps
