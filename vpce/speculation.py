"""The speculative route: the fast route's cost for per-token outputs that the caller reduces uniformly.

``linear_cross_entropy(..., reduction="none")`` and ``linear_log_probs`` return per-token values, and the caller
reduces them. The weight gradient ``dW = sum_i g_i dz_i^T x_i`` needs each token's upstream gradient ``g_i``,
which arrives only in backward. So the lean route recomputes the logits there: 8NDV in all, where the fast route
takes 6NDV. In the commonest case every non-ignored token gets the same ``g_i = c``. Examples are SFT's
``(loss * mask).sum() / mask.sum()`` with the mask equal to the non-ignored tokens, ``.sum()``, and ``.mean()``.
Token weights known in forward (``token_weight``, DFT's ``token_scaling``) keep ``g`` uniform, because they are part
of the forward. The speculative route (Triton backend, one process) then costs what the fast route costs.

Forward, while each chunk's logits are live (``vpce.backends.triton``: the fast route's chunk loop, at unit upstream
scale on every non-ignored token), forms and holds:

* ``dX_unit`` (fp32 ``[N, D]``). Row ``i`` of the true dX is ``g_i`` times row ``i`` of it, for **any** ``g``. Backward
  scales each row by its token's ``g_i`` and casts, in one pass (``kernels.row_scale_cast``);
* ``dW_unit`` (fp32 ``[V, D]``) and ``db_unit``, as the fast route does;
* the lean route's three statistics per token, for the fallback.

Backward decides on the device, with no host sync (``split_upstream``). ``c`` is ``g`` at the first non-ignored
token. The call is *uniform* when every non-ignored ``g_i`` equals ``c`` and ``c`` is finite; then
``dW = c dW_unit`` (``db`` alike). Otherwise ``dW_unit`` is dropped (times 0) and dW is recomputed the way the lean
route's token-major backward does it: per token block, the logits in grad mode at row scale ``g_i``, then
``dW += P_b^T X_b``. Each block's kernels (``kernels.logits_tiles`` with a ``flag``, ``kernels.gated_weight_grad_``)
first read that block's device flag, "some ``g_i`` in the block is not 0", and return at once when it is 0. With a
uniform gradient every flag is 0 (the recompute's gradient is ``where(uniform, 0, g)``), so the fallback costs
only its launches. NaN or inf in ``g`` makes a call non-uniform and flows through the recompute exactly as in the
lean route.

Why not ``c dW_unit + sum_i (g_i - c) dz_i^T x_i``, which recomputes only the blocks whose ``g_i`` differ from
``c``? Where ``c`` is not representative, the two terms cancel and dW loses the precision the lean route keeps.
That happens with mixed-sign per-sequence advantages, or with a caller's mask that zeroes the first token. A
misprediction costs 10NDV instead of 8NDV. It happens once per change of pattern (below).

Whether to speculate is decided per call in forward, from the previous backward at the same call site: the same
entry point, a weight of the same shape, dtype and device, and the same options. Not the weight's storage: a weight
gathered anew at every step (FSDP2's unsharded parameter, TRL's ``full_tensor()`` of a DTensor head) may land at
another address each time, and would never speculate; two heads alike in all of that but reduced differently
share one history, which costs speed (a misprediction per change), never exactness. Backward copies its
"uniform" flag into pinned host memory (``non_blocking``) and records a CUDA event. The next forward polls the event
(``event.query()``, no sync) and reads the flag once it is complete; while it is pending, the previous decision
stands. A call site's first call takes the lean route, so a caller whose gradients are never uniform (GRPO-style
advantages, DPO's signed sums) pays for at most one misprediction after each change. Not eligible (always the
lean route): a process group (a rank-local guess must never change the collective schedule), the torch backend,
``torch.compile`` and ``memory_budget="lean"``. ``linear_log_probs(return_entropy=True)`` speculates as well that
the entropy is only logged: its upstream gradient is not formed in forward, so a backward that brings one (known
on the host: autograd passes None for an unused output) drops the held gradients, recomputes as the lean route
does, and reports "not uniform". With ``memory_budget="auto"`` the speculative route is taken only
where the fast route's buffers fit (``vpce.routing.settle_by_memory``). Under CUDA-graph capture the decision
is not polled, and the route at capture time is replayed: exact either way.

A call that needs no weight or bias gradient (a frozen lm_head: LoRA) has nothing to speculate on: its ``dX`` is
exact for any ``g``, so it always takes this route (``dX`` formed in forward, 4NDV in all).

``memory_budget="lean"`` keeps a call off this route; ``reset()`` forgets every call site's history;
``route_of(output)`` tells which route a call took.

Bits. The two routes round differently (the speculative route's logits pass through ``P`` in the inputs' dtype,
and its dX is a row scale of ``dX_unit``; the lean route recomputes them in fp32 tiles), so outside deterministic
mode the last bits of the loss, dX and dW of a call can depend on the call site's history: a site's first call, the
first after a change between uniform and non-uniform upstream gradients, and any call that starts before its
previous backward's verdict has come back from the GPU (the event still pending) can take another route than the
call after it. Both are exact to the same error bars. Under a group no call speculates, so no rank-local fact enters
the decision.
Under ``torch.use_deterministic_algorithms(True)`` the history is neither read nor written: every eligible call
takes this route, so the same inputs and upstream gradient give the same bits on every call and in every run. A
non-uniform upstream gradient then costs the misprediction on every call (10NDV); ``memory_budget="lean"`` pins the
lean route (8NDV) for a caller whose gradients are never uniform. With ``memory_budget="auto"`` a call still falls
back to the lean route where the fast route's buffers do not fit in free device memory (``"fast"`` never
falls back), the same decision the fast route of ``reduction="mean"`` makes.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

__all__ = ["Record", "decide", "reset", "route_of", "split_upstream", "block_flags"]

MAX_SITES = 256  # call sites remembered (least recently used forgotten first)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


class Record:
    """One call site's history: the decision for its next forward, and the pending report of its last backward."""

    __slots__ = ("uniform", "host", "event")

    def __init__(self):
        self.uniform = False
        """Whether the last backward that has been read saw a uniform upstream gradient (the next decision)."""
        self.host: torch.Tensor | None = None
        self.event = None

    def predict(self) -> bool:
        """The decision for this forward: the last completed backward's outcome (never waits)."""
        if self.event is not None and not _capturing() and self.event.query():
            self.uniform = bool(self.host[0])  # pinned host memory the copy has finished writing
            self.event = None
        return self.uniform

    def report(self, uniform: torch.Tensor):
        """Backward's outcome (a 0-d bool tensor), for the next forward: read at once on the CPU, copied to pinned
        memory behind an event on CUDA (not while a CUDA graph is being captured)."""
        if uniform.device.type != "cuda":
            self.uniform = bool(uniform)
            return
        if _capturing():
            return
        if self.host is None:
            self.host = torch.empty(1, dtype=torch.bool, pin_memory=True)
        self.host.copy_(uniform.reshape(1), non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record()


_SITES: OrderedDict = OrderedDict()


def reset():
    """Forget every call site's history (the next call of each takes the lean route)."""
    _SITES.clear()


def _record(key) -> Record:
    rec = _SITES.get(key)
    if rec is None:
        rec = _SITES[key] = Record()
        while len(_SITES) > MAX_SITES:
            _SITES.popitem(last=False)
    else:
        _SITES.move_to_end(key)
    return rec


def decide(entry: str, weight: torch.Tensor, options, backend: str, sharded: bool,
           needs: tuple[bool, bool, bool]) -> tuple[bool, Record | None]:
    """Whether a call whose per-token outputs the caller reduces takes the speculative route, and the record its
    backward reports to (None where there is nothing to learn). ``weight``: the caller's weight (before any
    autocast cast); ``options``: a hashable summary of the call's options."""
    if backend != "triton" or sharded or not any(needs) or torch.compiler.is_compiling():
        return False, None
    if not (needs[1] or needs[2]):
        return True, None  # only dX: exact for any upstream gradient
    if torch.are_deterministic_algorithms_enabled():
        return True, None  # the same route whatever the history and the timing: bits follow the inputs alone
    key = (entry, tuple(weight.shape), weight.dtype, weight.device, options)
    rec = _record(key)
    return rec.predict(), rec


def split_upstream(g: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(uniform, c, gk)`` of a per-token upstream gradient ``g [N]`` (fp32, ``N > 0``), on the device:
    ``gk = g`` on non-ignored tokens (``keep``), 0 elsewhere; ``c = g`` at the first non-ignored token (0 if none);
    ``uniform``: every non-ignored token's ``g`` equals ``c``, and ``c`` is finite (0-d bool)."""
    gk = torch.where(keep, g, 0)
    first = keep.to(torch.uint8).argmax().reshape(1)  # the first maximum: the first non-ignored token
    c = torch.where(keep.any(), g.gather(0, first).reshape(()), 0)
    uniform = torch.where(keep, g == c, True).all() & torch.isfinite(c)
    return uniform, c, gk


def block_flags(r: torch.Tensor, block: int) -> torch.Tensor:
    """int32 per block of ``block`` consecutive tokens: 1 where some ``r_i`` in it is not 0 (NaN counts)."""
    n = r.shape[0]
    blocks = -(-n // block)
    padded = r.new_zeros(blocks * block)
    padded[:n] = r
    return (padded.view(blocks, block) != 0).any(1).to(torch.int32)


def route_of(output: torch.Tensor) -> str | None:
    """The route (``"speculative"``, ``"lean"``, ``"fast"``) the vpce call that produced ``output`` took, read from
    its autograd node, or the first such node up the chain of first inputs (a reshape, a mask, a mean: up to 8
    steps); None where there is none (no gradient was needed). For tests and diagnostics."""
    fn = output.grad_fn if isinstance(output, torch.Tensor) else None
    for _ in range(8):
        if fn is None:
            return None
        call = getattr(fn, "call", None)
        if call is not None:
            return call.plan.route
        fn = fn.next_functions[0][0] if fn.next_functions else None
    return None
