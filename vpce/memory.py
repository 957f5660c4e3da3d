"""Peak memory of a region of code, on CUDA (the caching allocator's counters) and on CPU (live storages).

``with PeakMemory(device) as pm: ...`` then ``pm.peak`` is the largest number of bytes allocated inside the
region above what was allocated when it began. On CPU there is no allocator counter, so a
``TorchDispatchMode`` records every storage an operator creates (forward and backward) and a finalizer on
each storage subtracts it when it is freed: the peak of that running total is exact for tensor data.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class _LiveStorages(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()

    def _release(self, key: int, nbytes: int):
        self._seen.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                st = t.untyped_storage()
                key = id(st)
                if key not in self._seen and st.nbytes() > 0:
                    self._seen.add(key)
                    self.live += st.nbytes()
                    self.peak = max(self.peak, self.live)
                    weakref.finalize(st, self._release, key, st.nbytes())
        return out


class PeakMemory:
    """Context manager; ``peak`` (bytes) is set on exit."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak = 0

    def __enter__(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _LiveStorages()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._base
        else:
            self._mode.__exit__(*exc)
            self.peak = self._mode.peak
        return False
