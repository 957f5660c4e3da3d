"""The backends: the engine that walks a call's tokens and vocab in chunks and blocks and forms its gradients.

* ``triton``: the GPU backend, an engine (``triton.engine``: one forward chunk loop, one block loop for the
  recompute) and one module per loss family (``triton.softmax``, ``triton.distill``), mirroring ``vpce.kernels``;
* ``pytorch``: the same functions in plain PyTorch, the CPU path;
* ``gemm``: the GEMM dispatch both use (cuBLAS with an fp32 result, the upcast fallback, the ``hopper`` extra's
  quack GEMMs);
* ``hopper`` (and ``hopper_child``, its child process): the ``hopper`` extra's kernels, compiled without a GPU in a
  child process while a process's first calls run without them (``vpce.build_hopper_kernels`` waits for them);
* ``grads``: how a backend hands its gradients back (the fast route's held gradients finished in backward,
  ``main_grad``).

Nothing is imported here: the Triton backend loads Triton, which the CPU path never needs.
"""
