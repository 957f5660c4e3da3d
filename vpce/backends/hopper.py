"""The ``hopper`` extra's kernels, built without holding up a process's first steps.

quack-kernels' CuTe GEMMs (``vpce.backends.gemm``: the dW and dX finishes, the logits GEMM with the statistics in
its epilogue) are compiled on first use and kept in quack's persistent cache of compiled objects (``QUACK_CACHE_DIR``,
by default a folder under the system's temporary directory). Compiling them and importing quack take seconds
(docs/benchmarks.md, "First step"), which a first training step would otherwise wait for. So, on an sm_90 GPU with the
extra installed, the first call that could use them (``ready``) returns False at once and starts:

1. a **child process that compiles them without the GPU** (``python -m vpce.backends.hopper_child``:
   ``CUDA_VISIBLE_DEVICES`` empty, the architecture given by ``QUACK_ARCH`` / ``CUTE_DSL_ARCH``): it calls the same
   functions of ``backends.gemm`` that the fast route calls, on small CPU tensors of the call's dtype and layouts,
   so that quack writes each kernel under the very key the GPU process will look up (the kernels are compiled for
   symbolic shapes; the key holds the dtypes, the operands' majors, the tile and the epilogue). The launch that
   would follow each compile cannot happen without a GPU and is skipped. No GPU memory, no CUDA context;
2. once the child has compiled the kernels of a plain call (it says so on stdout, then goes on with the
   soft-capped and label-smoothing epilogues), **quack's import** here, at the next call (once, on the calling
   thread: importing torch's and quack's modules from a second thread could meet the caller's own imports).

Until both are done, ``ready`` is False and the calls take the fast route on cuBLAS and Triton (the route without
the extra: the same results to rounding); from then on it is True and each quack call's first use loads its
compiled kernel from the cache. Which library finishes a rank's gradients changes no collective, so ranks may switch
at different steps.

``build(wait=True)`` (``vpce.build_hopper_kernels``) waits for both, for code that wants the extra's kernels from
its first step: a benchmark, a CUDA graph captured at the first step, a bitwise-reproducible run. With
``torch.use_deterministic_algorithms(True)`` the first call waits as well (quack imported and each kernel
compiled in this process on first use), so that every step runs the same kernels. With quack's cache turned
off (``QUACK_CACHE_ENABLED=0``) a child's kernels could not be found again, so the same holds there.

A child that fails (it cannot start, or exits with an error) is named once in a warning; the kernels are then
compiled in this process on first use, as without the child.
"""

from __future__ import annotations

import atexit
import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
import threading
import time
import warnings

import torch

__all__ = ["installed", "quack", "ready", "build", "Builds"]

#: Longest ``build(wait=True)`` waits for a child by default, in seconds.
WAIT_TIMEOUT_S = 600.0


@functools.cache
def installed() -> bool:
    """Whether the ``hopper`` extra is installed (quack-kernels and the CuTe DSL findable), without importing it."""
    return all(importlib.util.find_spec(name) is not None for name in ("quack", "cutlass"))


@functools.cache
def quack():
    """quack-kernels' GEMM interface (imported here, once), or None where the extra is not installed. An install
    that fails to import is named once, then left alone."""
    try:
        from quack import gemm_interface
    except ImportError:
        return None
    except Exception as e:  # noqa: BLE001 - a broken optional extra must not stop the loss
        warnings.warn(f"vpce: the hopper extra (quack-kernels) failed to import, the fast route runs on cuBLAS and "
                      f"Triton: {e!r}", stacklevel=2)
        return None
    return gemm_interface


def _dtype_name(dtype: torch.dtype) -> str:
    names = {torch.bfloat16: "bf16", torch.float16: "fp16"}
    if dtype not in names:
        raise TypeError(f"dtype: expected torch.bfloat16 or torch.float16 (the extra's GEMM operands), got {dtype}")
    return names[dtype]


def _device_of(device) -> torch.device:
    device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"device: expected a CUDA device (the hopper extra's kernels run on sm_90), got {device}")
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


@functools.cache
def _gpu(index: int) -> tuple[str, tuple[int, int]]:
    """The name and compute capability of CUDA device ``index``, asked once per process (``ready`` runs every call
    until the kernels are built)."""
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index)


def child_command(dtype: torch.dtype, device_name: str) -> list[str]:
    """The child's command line: build the kernels of ``dtype`` for the GPU named ``device_name``."""
    return [sys.executable, "-m", "vpce.backends.hopper_child", "--dtype", _dtype_name(dtype),
            "--device-name", device_name]


def child_env(capability: tuple[int, int]) -> dict:
    """The child's environment: this process's, with no GPU visible and the architecture to compile for."""
    arch = f"sm_{capability[0]}{capability[1]}"
    return dict(os.environ, CUDA_VISIBLE_DEVICES="", QUACK_ARCH=arch, CUTE_DSL_ARCH=arch + "a")


class _Child:
    """One child: its process, and files for what it prints (stdout: one line once the kernels a fast-route call
    needs first are compiled, ``hopper_child.READY``; stderr: for a warning if it fails)."""

    def __init__(self, proc, out, err):
        self.proc, self.out, self.err = proc, out, err
        self.first_done = proc is None  # no process (it could not start): nothing to wait for

    def built(self) -> bool:
        """Whether the kernels a call needs first are compiled (the child said so, or has ended)."""
        if self.proc is not None:
            code = self.proc.poll()
            if code is not None:
                self.ended(f"exit {code}" if code else 0)
            elif not self.first_done:
                self.first_done = os.fstat(self.out.fileno()).st_size > 0
        return self.first_done

    def ended(self, code) -> None:
        """Close the files (warning once with the last line of stderr where ``code`` is not 0)."""
        self.proc, self.first_done = None, True
        if code != 0:
            self.err.seek(0)
            lines = self.err.read().decode(errors="replace").strip().splitlines()
            _warn(f"the child that compiles the hopper extra's kernels failed ({code}: "
                  f"{lines[-1] if lines else 'no output'}); they compile in this process on first use")
        self.out.close()
        self.err.close()


class Builds:
    """The builds of one process: per (dtype, GPU name) a child, and one import of quack for all of them.

    ``command(dtype, name)`` and ``env(capability)`` give a child's command line and environment (``child_command``,
    ``child_env``); ``load()`` imports quack and returns whether it imported (``_load_quack``)."""

    def __init__(self, command=child_command, env=child_env, load=None):
        self._command, self._env = command, env
        self._load = load if load is not None else _load_quack
        self._lock = threading.Lock()
        self._children: dict = {}  # (dtype, GPU name) -> _Child
        self._imported: bool | None = None  # None: not imported yet

    def _child(self, key, capability) -> _Child:
        if key not in self._children:
            dtype, name = key
            out, err = tempfile.TemporaryFile(), tempfile.TemporaryFile()
            try:
                proc = subprocess.Popen(self._command(dtype, name), env=self._env(capability),
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=err)
            except OSError as e:
                out.close()
                err.close()
                _warn(f"could not start the child that compiles the hopper extra's kernels ({e!r}); they compile "
                      f"in this process on first use")
                proc = out = err = None
            else:
                atexit.register(_stop, proc)
            self._children[key] = _Child(proc, out, err)
        return self._children[key]

    def _import(self) -> bool:
        if self._imported is None:
            try:
                self._imported = bool(self._load())
            except Exception as e:  # noqa: BLE001 - a broken optional extra must not stop the loss
                _warn(f"the hopper extra failed to load ({e!r}); the fast route runs on cuBLAS and Triton")
                self._imported = False
        return self._imported

    def ready(self, dtype: torch.dtype, name: str, capability: tuple[int, int]) -> bool:
        """Whether the kernels of ``dtype`` on the GPU named ``name`` that a call needs first are built and quack
        imported: starts the child the first time and returns at once while it compiles them; imports quack (here,
        once) when they are done. The child goes on with the rarer variants (the soft-capped and label-smoothing
        epilogues); a call that needs one before it is done waits for that compile on quack's lock."""
        with self._lock:
            if not self._child((dtype, name), capability).built():
                return False
            return self._import()

    def wait(self, dtype: torch.dtype, name: str, capability: tuple[int, int], timeout: float) -> bool:
        """``ready``, once the child has compiled what a call needs first (stopped after ``timeout`` seconds)."""
        end = time.monotonic() + timeout
        while True:
            with self._lock:
                child = self._child((dtype, name), capability)
                if child.built():
                    return self._import()
                if time.monotonic() > end:
                    _stop(child.proc)
                    child.ended(f"stopped after {timeout:.0f} s")
                    return self._import()
            time.sleep(0.05)


def _load_quack() -> bool:
    if quack() is None:
        return False
    from ..kernels.epilogue import stats_epilogue

    for capped in (False, True):  # the epilogues' Python definitions, so that first use only loads the kernels
        for sum_z in (False, True):
            stats_epilogue(capped, sum_z)
    return True


def _stop(proc: subprocess.Popen):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@functools.cache
def _warn(message: str):
    warnings.warn(f"vpce: {message}", RuntimeWarning, stacklevel=4)


_BUILDS = Builds()


def _blocking() -> bool:
    """Whether first use waits for the kernels: deterministic algorithms asked for, or quack's cache turned off."""
    return torch.are_deterministic_algorithms_enabled() or os.environ.get("QUACK_CACHE_ENABLED", "1") != "1"


def ready(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fast route may run the extra's kernels of ``dtype`` on ``device`` (an sm_90 GPU, the extra
    installed) now; starts their build the first time and returns at once (module docstring)."""
    if _blocking():
        return quack() is not None
    return _BUILDS.ready(dtype, *_gpu(_device_of(device).index))


def build(device=None, dtype: torch.dtype = torch.bfloat16, *, wait: bool = True,
          timeout: float = WAIT_TIMEOUT_S) -> bool:
    """Build the ``hopper`` extra's kernels for ``dtype`` operands on ``device`` (default: the current CUDA device)
    and import quack, as the first fast-route call on an sm_90 GPU does by itself in the background. ``wait``: return
    once they are ready, so that the next call runs them (for a benchmark, a CUDA graph captured at the first step,
    a bitwise-reproducible run); else start them and return at once. Returns whether the fast route runs the
    extra's kernels from now on: False without an sm_90 GPU or without the extra (``pip install 'vpce[hopper]'``)."""
    _dtype_name(dtype)  # the argument's check
    if not torch.cuda.is_available():
        return False
    device = _device_of(device)
    gpu, capability = _gpu(device.index)
    if capability[0] != 9 or not installed():
        return False
    if _blocking():
        return ready(device, dtype)
    if wait:
        return _BUILDS.wait(dtype, gpu, capability, timeout)
    return _BUILDS.ready(dtype, gpu, capability)
