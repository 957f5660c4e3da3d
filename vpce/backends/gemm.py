"""GEMMs of fp16/bf16 operands with an fp32 (or fp64) result, on any device.

On CUDA (torch >= 2.10) one cuBLAS call does it: ``torch.mm(a, b, out_dtype=torch.float32)`` and
``torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)`` accumulate the bf16 products in fp32 and never round
the result to bf16. Where the device has no such kernel (CPU) the operands are upcast block by block along the
reduction dimension, so the extra memory stays bounded.

Which of the two is used is decided once per device type, by capability: a probe on 1x1 tensors the first time.
An error from a real GEMM (out of memory, a bad shape) propagates; it never switches the path.

With the ``hopper`` extra (quack-kernels' CuTe GEMMs) on an sm_90 GPU, ``scaled_weight_grad`` finishes the fast
route's dW in one GEMM that reads the fp32 accumulator as C, scales by the upstream gradient (a device scalar: no
host sync) and writes the weight's 16-bit dtype: no separate scale-and-cast pass over ``[V_local, D]`` fp32
(docs/benchmarks.md has the measurement). Which library computes a rank's dW changes no collective.
"""

from __future__ import annotations

import functools
import math
import warnings

import torch

from ..options import Folded
from . import hopper

__all__ = ["HopperExtraWarning", "mm_out", "mm_into", "addmm_out_", "add_product", "logits_into", "has_mixed_gemm",
           "hopper_dw_ready", "scaled_weight_grad", "scaled_hidden_grad", "logits_with_stats"]

_UPCAST_ELEMS = 1 << 24  # elements of ``b`` upcast at a time on the fallback path


@functools.cache
def has_mixed_gemm(device_type: str) -> bool:
    """Whether ``torch.mm``/``torch.addmm`` take 16-bit operands with ``out_dtype=torch.float32`` on this device
    type (probed once on 1x1 tensors)."""
    if device_type == "cpu":
        return False
    try:
        a = torch.ones(1, 1, dtype=torch.bfloat16, device=device_type)
        acc = torch.zeros(1, 1, dtype=torch.float32, device=device_type)
        torch.mm(a, a, out_dtype=torch.float32)
        torch.addmm(acc, a, a, beta=0, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    return True


def _mixed(a: torch.Tensor, out_dtype: torch.dtype) -> bool:
    return out_dtype == torch.float32 and a.dtype in (torch.float16, torch.bfloat16) and has_mixed_gemm(a.device.type)


def mm_out(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` with the result in ``out_dtype``; ``a``, ``b`` in their own (equal) dtype."""
    if a.dtype == out_dtype:
        return a @ b
    if _mixed(a, out_dtype):
        return torch.mm(a, b, out_dtype=out_dtype)
    out = a.new_zeros((a.shape[0], b.shape[1]), dtype=out_dtype)
    return addmm_out_(out, a, b)


def mm_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``out = a @ b`` written straight into ``out`` (e.g. a row slice of a bigger result), in ``out``'s dtype."""
    if a.dtype == out.dtype:
        return torch.mm(a, b, out=out)
    if _mixed(a, out.dtype):  # beta=0: cuBLAS does not read ``out`` (NaN or garbage in it never propagates)
        return torch.addmm(out, a, b, beta=0, out_dtype=out.dtype, out=out)
    return out.copy_(mm_out(a, b, out.dtype))


def addmm_out_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in ``acc``'s dtype, in place."""
    if a.dtype == acc.dtype and b.dtype == acc.dtype:
        return acc.addmm_(a, b)
    if _mixed(a, acc.dtype):
        return torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    step = max(1, _UPCAST_ELEMS // max(1, b.shape[1]))
    for k0 in range(0, a.shape[1], step):
        acc.addmm_(a[:, k0:k0 + step].to(acc.dtype), b[k0:k0 + step].to(acc.dtype))
    return acc


def add_product(acc: torch.Tensor | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``acc += a @ b`` in fp32, in place; a new fp32 ``a @ b`` where there is no ``acc`` yet (no zero fill)."""
    return mm_out(a, b, torch.float32) if acc is None else addmm_out_(acc, a, b)


def logits_into(out: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """``out = h @ w.T (+ b)`` in ``out``'s (the inputs') dtype, the bias added before the one rounding, as
    ``F.linear`` does (cuBLAS's bias epilogue)."""
    if b is None:
        return torch.mm(h, w.t(), out=out)
    return torch.addmm(b, h, w.t(), out=out)


class HopperExtraWarning(UserWarning):
    """Said once per process on an sm_90 GPU (H100, H200) where the ``hopper`` extra is not installed: the fast
    route then runs on cuBLAS with a statistics pass and a cast pass. Turn it off with
    ``warnings.filterwarnings("ignore", category=vpce.HopperExtraWarning)``."""


@functools.cache
def _suggest_hopper_extra() -> None:
    warnings.warn("vpce: this is an sm_90 GPU (H100/H200) without the `hopper` extra; the fast route runs on cuBLAS "
                  "with a statistics pass and a cast pass. `pip install 'vpce[hopper]'` (quack-kernels 0.6.5, "
                  "nvidia-cutlass-dsl 4.7.1) gives the faster path (README, Install). Silence this with "
                  "warnings.filterwarnings('ignore', category=vpce.HopperExtraWarning).", HopperExtraWarning,
                  stacklevel=3)


def hopper_dw_ready(g: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``scaled_weight_grad(acc, g, x, ...)`` (and ``scaled_hidden_grad(g, x, ...)``, ``x`` then the weight
    ``[V, D]``) can run as one quack GEMM: an sm_90 GPU, the ``hopper`` extra with its kernels built
    (``backends.hopper.ready``: False while they build, without waiting), 16-bit row-major ``g`` and ``x`` of one
    dtype, 16-byte aligned (TMA)."""
    if not (g.is_cuda and g.dtype in (torch.float16, torch.bfloat16) and x.dtype == g.dtype):
        return False
    if torch.cuda.get_device_capability(g.device)[0] != 9:
        return False
    if not hopper.installed():
        _suggest_hopper_extra()
        return False
    if not hopper.ready(g.device, g.dtype):  # the kernels still building (vpce.backends.hopper), or a broken extra
        return False
    return all(t.dim() == 2 and t.stride(1) == 1 and t.stride(0) % 8 == 0 and t.data_ptr() % 16 == 0 for t in (g, x))


# quack's sm_90 GEMM configs for the dW finish, pinned (the autotuner's pick could differ from run to run, and its
# first call tunes for minutes): each the fastest of those timed on both bench heads (Llama-3-8B, Gemma-2-2B),
# with the same bits as cuBLAS + cast (docs/benchmarks.md). ``DW_TILE``: one chunk, no accumulator; ``DW_ADD_TILE``:
# the last of several chunks, the accumulator read as C.
DW_TILE = dict(tile_m=256, tile_n=192, cluster_m=1, cluster_n=2, pingpong=False)
DW_ADD_TILE = dict(tile_m=128, tile_n=256, cluster_m=2, cluster_n=1, pingpong=False)
# dX of one whole chunk (``scaled_hidden_grad``), per device, each the fastest timed there with the same bits as
# cuBLAS + cast (docs/benchmarks.md): the H200 takes ``DW_TILE``'s config, any other sm_90 part the H100's.
DX_TILE = DW_ADD_TILE
DX_TILE_H200 = DW_TILE


def dx_tile(device_name: str) -> dict:
    """The pinned dX config for the GPU named ``device_name`` (the H200's differs from the H100's)."""
    return DX_TILE_H200 if "H200" in device_name else DX_TILE


@functools.lru_cache(maxsize=None)
def _dx_tile(device_index: int) -> dict:
    return dx_tile(torch.cuda.get_device_name(device_index))


# Every quack GEMM here takes its output tiles from a counter in global memory (quack's dynamic persistent
# scheduler) instead of a fixed share per CTA. Under a group a collective's kernels (NCCL, on a high-priority
# stream) take some SMs at the start of the GEMM queued after them; with fixed shares the CTAs left without an SM
# did all of their tiles after the collective ended, so the GEMM ran about the collective's time longer. With the
# counter the other CTAs take those tiles (docs/benchmarks.md has the tp=2 A/B).
@functools.cache
def _config_of(tile: tuple):
    from quack.gemm_config import GemmConfig

    return GemmConfig(**dict(tile), is_dynamic_persistent=True)


def _config(tile: dict):
    """``tile`` as one ``GemmConfig`` object for the process, dynamically scheduled: quack's eager fast path keys a
    call's recorded launch by the config's identity, so a new (equal) object per call would re-record every call."""
    return _config_of(tuple(tile.items()))


def scaled_weight_grad(acc: torch.Tensor | None, g: torch.Tensor, x: torch.Tensor, scale: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """``scale * (acc + g^T x)`` in the 16-bit ``dtype``, accumulated in fp32 and rounded once, in one quack GEMM
    (``hopper_dw_ready``): ``acc`` is the fp32 accumulator of the earlier chunks (None: there were none), ``scale``
    the 0-d upstream gradient."""
    q = hopper.quack()
    s = scale.detach().to(torch.float32).reshape(1).contiguous()  # read on the device: no host sync
    out = torch.empty(g.shape[1], x.shape[1], dtype=dtype, device=g.device)
    if acc is None:
        q.gemm_tuned.fn(g.t(), x, out, alpha=s, config=_config(DW_TILE))
    else:
        q.gemm_tuned.fn(g.t(), x, out, C=acc, alpha=s, beta=s, config=_config(DW_ADD_TILE))
    return out


def scaled_hidden_grad(g: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                       tile: dict | None = None) -> torch.Tensor:
    """``scale * (g @ w)`` in the 16-bit ``dtype``, accumulated in fp32 and rounded once, in one quack GEMM
    (``hopper_dw_ready(g, w)``): dX of a call whose gradient ``g [N, V]`` is one chunk, with no fp32 ``[N, D]``
    buffer and no scale-and-cast pass; ``scale`` the 0-d upstream gradient. ``tile``: the config (default: the
    GPU's, ``dx_tile``)."""
    s = scale.detach().to(torch.float32).reshape(1).contiguous()  # read on the device: no host sync
    out = torch.empty(g.shape[0], w.shape[1], dtype=dtype, device=g.device)
    if tile is None:
        tile = _dx_tile(g.device.index if g.device.index is not None else torch.cuda.current_device())
    hopper.quack().gemm_tuned.fn(g, w, out, alpha=s, config=_config(tile))
    return out


# The logits GEMM with the statistics in its epilogue (``logits_with_stats``), at the fastest of the configs timed
# for the whole statistics step (the GEMM, the select, ``kernels.target_out_of_lse``, the reduction and the
# combine), plain and soft-capped, on both bench heads (docs/benchmarks.md). A ping-pong schedule: one warp group's
# epilogue (an exp per logit; with the cap an exp2 and a reciprocal more) runs under the other's main loop; the
# cooperative configs ran it exposed.
LOGITS_TILE = dict(tile_m=128, tile_n=192, cluster_m=2, cluster_n=1, pingpong=True)


def logits_with_stats(p: torch.Tensor, h: torch.Tensor, w: torch.Tensor, t_local: torch.Tensor, zt: torch.Tensor,
                      folded: Folded = Folded(), sum_z: bool = False,
                      class_weight: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``p = h @ w.T`` (bf16) in one quack GEMM whose epilogue also takes the row statistics
    (``vpce.routing.finish_fast`` decides where), without reading ``p`` again. Returns per row the log-sum-exp
    ``[C]`` fp32 of all of ``p``'s logits as ``p`` holds them (soft-capped and scaled by ``folded``, where it has a
    soft cap), and (``sum_z``: label smoothing) the sum of those logits times ``class_weight`` (ones where None),
    else None; writes the target column's raw fp32 logit into ``zt`` (-inf where the target is not among these
    columns: ``t_local`` -1). ``kernels.target_out_of_lse`` turns these into the statistics pass's."""
    zt.fill_(-math.inf)  # quack's select writes only the rows whose target is here
    v = p.shape[1]
    ops = dict(target=t_local, target_logit=zt)  # the select's buffer as an operand: quack writes into it
    if folded.softcap is not None:
        cap = float(folded.softcap)
        ops.update(k=-2 * math.log2(math.e) / cap, cap=cap, scale=float(folded.inv_t))
    if sum_z:
        ops["cw"] = class_weight if class_weight is not None else torch.ones(v, dtype=torch.float32, device=p.device)
    # the CuTe kernel, imported here: ``vpce.kernels`` loads Triton, which the CPU path never needs
    from ..kernels.epilogue import stats_epilogue

    res = stats_epilogue(folded.softcap is not None, sum_z)(h, w.t(), out={"D": p}, tuned=False,
                                                     config=_config(LOGITS_TILE), **ops)
    return res["lse"], res.get("sumz")
