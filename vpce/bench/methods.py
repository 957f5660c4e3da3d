"""The rows of the benchmark: every loss implementation measured, behind one calling convention.

A ``Method`` builds, for an ``Env``, a function ``loss(x [N, D], w [V, D], y [N]) -> scalar mean loss`` that
autograd differentiates into ``x.grad`` and ``w.grad``. Peers are imported lazily when their row is built: one that
is not installed raises ``Unavailable`` and shows up as a row with status ``missing: ...``; one that raises while
building or running shows up as ``failed: ...``. None is silently dropped.

The peers are called as their documentation shows (versions in the JSON):
* torch eager: ``F.cross_entropy(F.linear(x, w).float(), y)``; torch.compile of that same function.
* liger-kernel: ``LigerFusedLinearCrossEntropyLoss()(w, x, y)``.
* cut-cross-entropy: ``linear_cross_entropy(x, w, y)`` (default gradient filter) and ``filter_eps=None`` (exact).
* megatron-core: ``vocab_parallel_cross_entropy`` / ``fused_vocab_parallel_cross_entropy`` on bf16 logits from
  ``F.linear``, ``.mean()`` of the per-token losses; they need Megatron's ``parallel_state``, initialized here on
  a process group of this one process (or, under torchrun, on the launched group).
* vpce: ``vpce.linear_cross_entropy`` with ``backend="triton"`` (default budget and ``memory_budget="lean"``)
  and ``backend="torch"``.

Tensor parallelism: a method with ``tp=True`` takes the vocab shard of ``w`` on each rank of ``env.group``; the
others have no vocab-parallel form and are single-GPU rows only.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import socket
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .harness import Env

__all__ = ["Method", "Unavailable", "METHODS", "FLOOR", "method_names", "package_versions", "shutdown"]

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

#: Name of the three-GEMM floor in ``--methods`` (measured by the runner, not a loss).
FLOOR = "floor"


class Unavailable(Exception):
    """The method cannot run here (package not installed, needs CUDA, not built yet): a ``missing`` row."""


@dataclass(frozen=True, kw_only=True)
class Method:
    """One row of the table."""

    name: str
    """Key for ``--methods``."""
    label: str
    """Text in the table."""
    build: Callable[[Env], LossFn]
    """Returns the loss function for this environment; raises ``Unavailable`` when it cannot run here."""
    package: str | None = None
    """Distribution whose version the JSON records."""
    needs_cuda: bool = False
    """Has no CPU implementation."""
    no_grad: bool = False
    """Also measure a forward under ``torch.no_grad()`` (against the single logits GEMM)."""
    tp: bool = False
    """Has a vocab-parallel form (for ``--tp``)."""
    plain: bool = True
    """Computes the plain mean cross-entropy, so its errors are checked against the float64 reference; the loss
    variants (label smoothing, z-loss, ...) compute something else and report no errors (their exactness is the
    test suite's job)."""


def _import(module: str, package: str):
    """Import a peer module quietly; ``Unavailable`` if its package is not installed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ImportError as e:
        raise Unavailable(f"{package} not importable ({type(e).__name__}: {e})") from e


# -- torch ------------------------------------------------------------------------------------------------------

def _torch_loss(x, w, y):
    return F.cross_entropy(F.linear(x, w).float(), y)


def _torch_eager(env: Env) -> LossFn:
    return _torch_loss


def _torch_compile(env: Env) -> LossFn:
    torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no automatic dynamic shapes
    return torch.compile(_torch_loss, dynamic=False)


# -- liger-kernel, cut-cross-entropy ------------------------------------------------------------------------------

def _liger(env: Env) -> LossFn:
    mod = _import("liger_kernel.transformers.fused_linear_cross_entropy", "liger-kernel")
    module = mod.LigerFusedLinearCrossEntropyLoss()
    return lambda x, w, y: module(w, x, y)


def _cce(env: Env, *, exact: bool) -> LossFn:
    lce = _import("cut_cross_entropy", "cut-cross-entropy").linear_cross_entropy
    if exact:
        return lambda x, w, y: lce(x, w, y, filter_eps=None)
    return lambda x, w, y: lce(x, w, y)


# -- megatron-core ------------------------------------------------------------------------------------------------

_OWN_GROUP = False  # whether this process created the default process group (and so destroys it)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _megatron_tp_group(env: Env):
    """Megatron's tensor-parallel group, initializing ``parallel_state`` (and a 1-rank process group) once."""
    global _OWN_GROUP
    ps = _import("megatron.core.parallel_state", "megatron-core")
    if not dist.is_available():
        raise Unavailable("torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        if env.cuda:
            torch.cuda.set_device(env.device)
        dist.init_process_group("nccl" if env.cuda else "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}",
                                rank=0, world_size=1)
        _OWN_GROUP = True
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=env.tp)
    return ps.get_tensor_model_parallel_group()


def _megatron(env: Env) -> LossFn:
    _megatron_tp_group(env)
    ce = _import("megatron.core.tensor_parallel", "megatron-core").vocab_parallel_cross_entropy
    return lambda x, w, y: ce(F.linear(x, w), y).mean()


def _megatron_fused(env: Env) -> LossFn:
    group = _megatron_tp_group(env)
    ce = _import("megatron.core.fusions.fused_cross_entropy", "megatron-core").fused_vocab_parallel_cross_entropy
    return lambda x, w, y: ce(F.linear(x, w), y, group).mean()


def shutdown():
    """Tear down what ``_megatron_tp_group`` set up, so that the process exits without NCCL warnings."""
    global _OWN_GROUP
    if not _OWN_GROUP:
        return
    try:
        from megatron.core import parallel_state
        parallel_state.destroy_model_parallel()
    except ImportError:
        pass
    if dist.is_initialized():
        dist.destroy_process_group()
    _OWN_GROUP = False


# -- vpce ---------------------------------------------------------------------------------------------------------

def _vpce(env: Env, *, backend: str, memory_budget: str = "auto") -> LossFn:
    if backend == "triton" and importlib.util.find_spec("vpce.triton_backend") is None:
        raise Unavailable("vpce.triton_backend does not exist yet")
    from .. import linear_cross_entropy
    return functools.partial(linear_cross_entropy, backend=backend, memory_budget=memory_budget, group=env.group)


def _vpce_variant(env: Env, **options) -> LossFn:
    """vpce triton with loss options (``token_weight``: a fixed random weight per token)."""
    from .. import linear_cross_entropy
    weights = options.pop("token_weight", False)
    cache = {}

    def fn(x, w, y):
        if weights and "tw" not in cache:
            gen = torch.Generator(device=y.device).manual_seed(0)
            cache["tw"] = torch.rand(y.shape, generator=gen, device=y.device)
        return linear_cross_entropy(x, w, y, backend="triton", group=env.group,
                                    token_weight=cache.get("tw"), **options)
    return fn


def _vpce_log_probs(env: Env, *, entropy: bool) -> LossFn:
    """Mean negative log-probability (= the plain loss, so its errors are checked), plus 0.01 x mean entropy."""
    from .. import linear_log_probs

    def fn(x, w, y):
        out = linear_log_probs(x, w, y, backend="triton", group=env.group, return_entropy=entropy)
        if entropy:
            return -out[0].mean() + 0.01 * out[1].mean()
        return -out.mean()
    return fn


VARIANTS = {  # name: (label, options)
    "smooth": ("label_smoothing=0.1", dict(label_smoothing=0.1)),
    "zloss": ("z_loss=1e-4", dict(z_loss=1e-4)),
    "softcap": ("softcap=30", dict(softcap=30.0)),
    "weights": ("token_weight", dict(token_weight=True)),
    "all": ("smoothing+z-loss+softcap+weights", dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0,
                                                      token_weight=True)),
}

METHODS: dict[str, Method] = {m.name: m for m in [
    Method(name="torch", label="torch eager", build=_torch_eager, package="torch", no_grad=True),
    Method(name="compile", label="torch.compile", build=_torch_compile, package="torch"),
    Method(name="liger", label="liger-kernel FLCE", build=_liger, package="liger-kernel", needs_cuda=True),
    Method(name="cce", label="cut-cross-entropy", build=functools.partial(_cce, exact=False),
           package="cut-cross-entropy", needs_cuda=True),
    Method(name="cce-exact", label="cut-cross-entropy exact", build=functools.partial(_cce, exact=True),
           package="cut-cross-entropy", needs_cuda=True),
    Method(name="megatron", label="megatron vocab_parallel_ce", build=_megatron, package="megatron-core", tp=True),
    Method(name="megatron-fused", label="megatron fused_vp_ce", build=_megatron_fused, package="megatron-core",
           tp=True),
    Method(name="vpce-triton", label="vpce triton", build=functools.partial(_vpce, backend="triton"),
           package="vpce", needs_cuda=True, no_grad=True, tp=True),
    Method(name="vpce-triton-lean", label="vpce triton lean",
           build=functools.partial(_vpce, backend="triton", memory_budget="lean"), package="vpce",
           needs_cuda=True, tp=True),
    Method(name="vpce-torch", label="vpce torch", build=functools.partial(_vpce, backend="torch"), package="vpce",
           no_grad=True, tp=True),
    *[Method(name=f"vpce-{key}", label=f"vpce triton {label}", build=functools.partial(_vpce_variant, **opts),
             package="vpce", needs_cuda=True, plain=False) for key, (label, opts) in VARIANTS.items()],
    Method(name="vpce-logprobs", label="vpce linear_log_probs", package="vpce", needs_cuda=True,
           build=functools.partial(_vpce_log_probs, entropy=False)),
    Method(name="vpce-logprobs-entropy", label="vpce linear_log_probs + entropy", package="vpce", needs_cuda=True,
           build=functools.partial(_vpce_log_probs, entropy=True), plain=False),
]}


def method_names() -> list[str]:
    """Every name ``--methods`` accepts, in table order."""
    return [FLOOR, *METHODS]


def package_versions() -> dict[str, str | None]:
    """Installed versions of torch, triton, the peers and vpce (None: not installed)."""
    out = {}
    for pkg in ("torch", "triton", "liger-kernel", "cut-cross-entropy", "megatron-core", "numpy", "matplotlib"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            out[pkg] = None
    from .. import __version__
    out["vpce"] = __version__
    out["cuda"] = torch.version.cuda
    return out
