"""A cold process's first launch of each kernel (``vpce.kernels.launch``): where Triton builds a C launcher per kernel
signature, the build runs on vpce's worker thread beside the kernel's compile, never on the launching thread, and
so does Triton's driver's; where it builds none (Triton 3.9, the interpreter), the kernels are Triton's own and
nothing starts."""

import json
import os
import subprocess
import sys
from concurrent.futures import Future

import pytest
import torch

import vpce.kernels as kernels
from vpce.kernels import launch

KERNEL_MODULES = (kernels.softmax, kernels.gated, kernels.distill)


def _kernels(module):
    return {name: obj for name, obj in vars(module).items() if name.endswith("_kernel")}


def _hooks(obj):
    return [h for h in getattr(launch._jit_function(obj), "pre_run_hooks", []) if isinstance(h, launch._FirstLaunch)]


@pytest.mark.skipif(launch.builds_launchers(), reason="this Triton builds a C launcher per signature")
def test_the_kernels_are_triton_s_own_and_nothing_starts_where_triton_builds_no_launcher_per_signature():
    for module in KERNEL_MODULES:
        for name, obj in _kernels(module).items():
            assert not isinstance(obj, launch._Kernel) and not _hooks(obj), name
    launch.start()
    assert not launch._started.is_set() and launch._driver is None, "nothing created, hashed or built"


@pytest.mark.skipif(not launch.builds_launchers(), reason="this Triton builds no C launcher per signature")
def test_every_kernel_is_declared_first_launch_with_at_most_one_hook():
    names = set()
    for module in KERNEL_MODULES:
        for name, obj in _kernels(module).items():
            assert isinstance(obj, launch._Kernel), f"{name}: expected @first_launch"
            assert launch._jit_function(obj) is not None, name
            assert len(_hooks(obj)) <= 1, name  # consumed at its first launch
            names.add(name)
    assert {"_stored_logits_kernel", "_scale_cast_kernel", "_distill_grad_kernel"} <= names


def test_a_forked_child_runs_its_own_worker_and_waits_for_no_driver_of_the_parent(monkeypatch):
    launch._worker().submit(int).result(timeout=30)  # the parent's worker exists
    monkeypatch.setattr(launch, "_driver", Future())  # a driver the parent is still creating
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: the parent's worker thread is not here; a job must still run
        os.close(r)
        try:
            ok = launch._worker().submit(lambda: 7).result(timeout=30) == 7 and launch._driver is None
        except BaseException:  # noqa: BLE001 - the parent reports it
            ok = False
        os.write(w, b"1" if ok else b"0")
        os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.waitpid(pid, 0)
    assert got == b"1", "a forked child's job ran on a worker of its own, with no pending driver of the parent's"


_COLD_STEP = r"""
import json, os, sys, threading, torch
import triton.runtime.build as build
builds = []
def _build(name, *a, **k):
    builds.append((name, threading.current_thread().name))
    return original(name, *a, **k)
original, build._build = build._build, _build
import vpce
torch.manual_seed(0)
n, d, v = 333, 256, 1000
x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
w = (torch.randn(v, d, device="cuda") / d**0.5).to(torch.bfloat16).requires_grad_()
y = torch.randint(0, v, (n,), device="cuda")
y[::7] = -100
loss = vpce.linear_cross_entropy(x, w, y, backend="triton")
loss.backward()
torch.cuda.synchronize()
ref = torch.nn.functional.cross_entropy(x.detach().double() @ w.detach().double().T, y)
print(json.dumps(dict(builds=builds, loss=loss.item(), ref=ref.item())))
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.skipif(not launch.builds_launchers(), reason="this Triton builds no C launcher per signature")
def test_gpu_a_cold_processs_launchers_are_built_on_the_worker_beside_the_compiles(tmp_path):
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), VPCE_OFFLINE="1")
    out = subprocess.run([sys.executable, "-c", _COLD_STEP], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    launchers = [thread for name, thread in result["builds"] if name == "__triton_launcher"]
    assert launchers, f"a cold process builds launchers: {result['builds']}"
    utils = [thread for name, thread in result["builds"] if name == "cuda_utils"]
    assert utils and all(t.startswith("vpce-launcher") for t in utils), f"Triton's driver built ahead: {utils}"
    on_caller = [t for t in launchers if not t.startswith("vpce-launcher")]
    assert not on_caller, (f"launcher builds on the launching thread {on_caller} (of {launchers}): a launch's argument "
                           "kinds differ from its kernel's first launch, or the prebuilt source is not Triton's")
    assert abs(result["loss"] - result["ref"]) <= 2e-2 * abs(result["ref"]), result
