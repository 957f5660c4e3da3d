"""A process's first launch of each kernel, when Triton's cache is empty.

Triton 3.6 and the releases before it build small C extensions with the system's C compiler the first time a
process whose Triton cache does not hold them needs them: its driver's utilities at the first kernel launch, then
each kernel's *launcher*, after compiling the kernel itself. A cold first step waits for them one after the other,
kernel by kernel. A launcher's source depends only on the kinds of the kernel's arguments (pointer, 32- or 64-bit
integer, float, constant), which Triton knows before it compiles, and the compiler is a separate process. So every
kernel of vpce is declared ``@first_launch``:

* its first launch in a process runs a Triton pre-run hook: the kinds of this launch's arguments from the kernel's
  own binder; a worker thread builds the launcher from Triton's own launcher source (into Triton's cache, under the
  key Triton computes) while the calling thread compiles the kernel (``JITFunction.warmup``: compile only, no
  launch), then waits for the build. Triton's launch that follows finds both in its caches. Nothing is guessed: a
  launch whose arguments differ later (another specialization) is compiled by Triton as before;
* ``start`` (the Triton backend's first call) has the worker create Triton's driver (its utilities' build) and hash
  Triton's sources (``triton_key``, part of every kernel's cache key) while the call's first GEMMs run, and the
  first launch of a ``@first_launch`` kernel waits for the driver (else the launch would build it a second time).

None of this changes what a kernel computes or when it is launched: it only moves Triton's host-side work. Where
Triton builds no launcher per signature (3.9 launches every kernel through one entry point of its driver), or under
the interpreter, ``first_launch`` returns the kernel as it is and ``start`` does nothing. The measured effect:
docs/benchmarks.md, "A cold first step's launchers".
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

from .common import INTERPRET

__all__ = ["first_launch", "start", "builds_launchers"]

_log = logging.getLogger(__name__)


@functools.cache
def _launcher_api():
    """``(nvidia driver module, compile_module_from_src)`` where this Triton builds a C launcher per kernel
    signature with ``make_launcher(constants, signature, tensordesc_meta)``; else ``None``."""
    if INTERPRET:
        return None
    try:
        from triton.backends.nvidia import driver as nv
        from triton.runtime.build import compile_module_from_src
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    make = getattr(nv, "make_launcher", None)
    if make is None or list(inspect.signature(make).parameters) != ["constants", "signature", "tensordesc_meta"]:
        return None
    if not all(hasattr(nv, n) for n in ("library_dirs", "include_dirs", "libraries")):
        return None
    if not hasattr(JITFunction, "warmup"):
        return None
    return nv, compile_module_from_src


def builds_launchers() -> bool:
    """Whether this Triton builds a C launcher per kernel signature (the case ``first_launch`` and ``start`` act on)."""
    return _launcher_api() is not None


@functools.cache
def _worker() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=2, thread_name_prefix="vpce-launcher")




class _FirstLaunch:
    """A kernel's pre-run hook for its first launch in this process (see the module docstring)."""

    def __init__(self, fn):
        self.fn = fn
        self.lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self.lock:  # one thread prepares; another launching the same kernel meanwhile compiles as Triton does
            if self not in self.fn.pre_run_hooks:
                return
            self.fn.pre_run_hooks.remove(self)
        build = self._build_launcher(args, kwargs)
        self.fn.warmup(*args, grid=(1,), **kwargs)  # a compile error is the kernel's, raised here as at its launch
        if build is not None and build.exception() is not None:
            # Triton builds the launcher itself at the launch and reports its own error there
            _log.debug("vpce: launcher of %s not prebuilt: %r", self.fn, build.exception())

    def _build_launcher(self, args, kwargs) -> Future | None:
        nv, compile_module_from_src = _launcher_api()
        try:
            import triton

            device = triton.runtime.driver.active.get_current_device()
            binder = self.fn.device_caches[device][4]
            _, specialization, _ = binder(*args, **kwargs)
            kinds = [s[0] for s in specialization]
            if any(isinstance(k, str) and k.startswith("tensordesc") for k in kinds):
                return None  # a TMA descriptor's launcher also depends on the compiled kernel's metadata
            src = nv.make_launcher({}, dict(enumerate(kinds)), None)
            return _worker().submit(compile_module_from_src, src=src, name="__triton_launcher",
                                    library_dirs=nv.library_dirs(), include_dirs=nv.include_dirs,
                                    libraries=nv.libraries)
        except Exception as e:  # noqa: BLE001 - only a head start: Triton builds the launcher at the launch anyway
            _log.debug("vpce: launcher of %s not prebuilt: %r", self.fn, e)
            return None


def _jit_function(obj):
    """The ``JITFunction`` under ``obj`` (through ``first_launch`` and ``triton.heuristics`` / ``autotune``
    wrappers), or ``None``."""
    from triton.runtime.jit import JITFunction
    if isinstance(obj, _Kernel):
        obj = obj.kernel
    while obj is not None and not isinstance(obj, JITFunction):
        obj = getattr(obj, "fn", None)
    return obj


class _Kernel:
    """A ``@first_launch`` kernel as its launch sites use it: ``kernel[grid](...)`` waits for the driver ``start``
    creates, once per process, then launches through Triton; every other attribute is the Triton kernel's."""

    def __init__(self, kernel):
        self.kernel = kernel

    def __getitem__(self, grid):
        if _driver is not None:
            _wait_for_driver()
        return self.kernel[grid]

    def __getattr__(self, name):
        return getattr(self.kernel, name)


def first_launch(kernel):
    """Declare a Triton kernel (``@triton.jit``, under ``triton.heuristics`` where it has them) as one of vpce's:
    its first launch in a process builds Triton's launcher beside its compile (see the module docstring). Returns
    ``kernel`` itself where Triton builds no launcher per signature."""
    fn = _jit_function(kernel) if _launcher_api() is not None else None
    if fn is None:
        return kernel
    fn.pre_run_hooks.append(_FirstLaunch(fn))
    return _Kernel(kernel)


_started = threading.Event()
_driver: Future | None = None  # Triton's driver, being created on the worker (``start``) until a launch has waited


def _create_driver():
    import triton
    return triton.runtime.driver.active


def _wait_for_driver():
    global _driver
    pending = _driver
    if pending is not None:
        if pending.exception() is not None:  # Triton creates it at the launch and reports its own error there
            _log.debug("vpce: Triton's driver not created ahead: %r", pending.exception())
        _driver = None


def start() -> None:
    """Once per process, where kernels are about to be compiled for a GPU: create Triton's driver and hash Triton's
    sources on the worker thread; returns at once."""
    global _driver
    if _started.is_set() or _launcher_api() is None:
        return
    _started.set()
    from triton.runtime.cache import triton_key
    _driver = _worker().submit(_create_driver)
    _worker().submit(triton_key)


def _after_fork_in_child():
    """A forked child has none of the parent's threads: it starts its own worker and driver if it ever needs them
    (a job the parent had queued would never run there)."""
    global _driver
    _worker.cache_clear()
    _driver = None
    _started.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
