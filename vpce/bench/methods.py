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

Tensor parallelism (``--tp``, ``vpce.bench.tp``): a method with ``tp=True`` takes, on each rank of ``env.group``,
this rank's hidden input (all ``N`` tokens, or with ``env.sequence_parallel`` its ``N/tp`` slice), its contiguous
vocab shard of ``w`` and the full targets, and must leave in ``x.grad`` the complete ``dX`` (summed over the
group; under SP this rank's slice) and in ``w.grad`` its shard's gradient. vpce does that itself. The peers get
their hidden states the way Megatron's lm_head gives them (``_hidden_entry``): through
``copy_to_tensor_model_parallel_region`` (identity forward, ``dX`` all-reduce backward) or, under SP,
``gather_from_sequence_parallel_region`` (all-gather forward, reduce-scatter backward), so each row's step
includes the ``dX`` collective. The vocab-parallel peers:

* megatron-core: as above, ``F.linear`` of the shard, then its (fused) vocab-parallel cross-entropy.
* liger-kernel 0.8.5: ``LigerFusedLinearScaledCrossEntropyTPFunction.apply(x, w_shard, y, group)`` (per-token
  NLL, ``.mean()``): its native CUTLASS + NVSHMEM kernel for bf16 on Hopper/Blackwell when that is installed,
  otherwise its 512-token chunked fallback; the row's note says which. It all-reduces ``dX`` itself; it needs
  CUDA. (``LigerFusedLinearCrossEntropyLoss``, the ``liger`` row, has no vocab-parallel mode.)
* ``chunked-tp``: the idea of that fallback written here in plain torch, so it runs anywhere (CPU included):
  512 tokens at a time, the shard's fp32 logits, the max all-reduced, then the sum of exponentials and the target
  logit all-reduced together; backward recomputes each chunk's logits and accumulates ``dW`` in the weight's
  dtype, as liger-kernel's fallback does.
* torch ``loss_parallel``: the shard's logits as a DTensor ``Shard(-1)`` on a 1-D mesh of the group and
  ``F.cross_entropy`` under ``torch.distributed.tensor.parallel.loss_parallel()`` (forward and backward), once with
  fp32 logits like the ``torch`` row and once with bf16 logits as the anchors in MISSION.md were measured.

Rows marked ``tp_only`` need a process group and are measured only under ``--tp``; rows marked ``even_shards``
need every rank to hold the same number of vocab rows (``V`` divisible by ``tp``) and are ``missing`` otherwise.
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

from .. import parallel

from .harness import Env

__all__ = ["Method", "Unavailable", "METHODS", "FLOOR", "method_names", "default_methods", "package_versions",
           "shutdown"]

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
    tp_only: bool = False
    """Needs a process group: measured only under ``--tp``."""
    even_shards: bool = False
    """Under ``--tp``, needs the same number of vocab rows on every rank."""
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
    enter = _hidden_entry(env, megatron=True)
    return _noted(lambda x, w, y: ce(F.linear(enter(x), w), y).mean(), enter)


def _megatron_fused(env: Env) -> LossFn:
    group = _megatron_tp_group(env)
    ce = _import("megatron.core.fusions.fused_cross_entropy", "megatron-core").fused_vocab_parallel_cross_entropy
    enter = _hidden_entry(env, megatron=True)
    return _noted(lambda x, w, y: ce(F.linear(enter(x), w), y, group).mean(), enter)


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


# -- tensor parallel: how the peers' hidden states enter the vocab-parallel region --------------------------------

# The collective spellings and the copy-to-region Function (identity forward, all-reduce of the gradient: what
# Megatron's copy_to_tensor_model_parallel_region does) are vpce.parallel's own.
_all_gather, _reduce_scatter = parallel.all_gather_tensor, parallel.reduce_scatter_tensor


class _GatherTokens(torch.autograd.Function):
    """Megatron's ``gather_from_sequence_parallel_region``: all-gather along dim 0 forward; backward, a
    reduce-scatter of the gradient (``reduce_grad``) or, for a gradient already summed over the group, this rank's
    own slice of it."""

    @staticmethod
    def forward(ctx, x, group, world, reduce_grad):
        ctx.group, ctx.world, ctx.reduce_grad, ctx.rank = group, world, reduce_grad, dist.get_rank(group)
        out = x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))
        _all_gather(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        rows = grad.shape[0] // ctx.world
        if not ctx.reduce_grad:
            return grad[ctx.rank * rows:(ctx.rank + 1) * rows].contiguous(), None, None, None
        out = grad.new_empty((rows,) + tuple(grad.shape[1:]))
        _reduce_scatter(out, grad.contiguous(), group=ctx.group)
        return out, None, None, None


def _hidden_entry(env: Env, *, megatron: bool = False, reduce_grad: bool = True) -> Callable:
    """``hidden -> hidden as this rank's logits GEMM needs it``, with the ``dX`` collective in backward.

    Hidden replicated: identity, ``dX`` all-reduced in backward. Sequence parallel: the token slices all-gathered,
    ``dX`` reduce-scattered in backward. ``reduce_grad=False`` is for a peer that sums ``dX`` over the group
    itself (liger-kernel's TP function): nothing more in backward, or under SP the rank's own slice of ``dX``.
    With ``megatron=True`` on CUDA these are megatron-core's own mappings; elsewhere (its gather allocates on
    CUDA) the equivalent Functions above. Identity without a group, and, like Megatron's, on a group of one.
    """
    if env.group is None or env.tp == 1:
        return _named(lambda x: x, "hidden: as is (one rank)")
    if megatron and env.cuda:
        mappings = _import("megatron.core.tensor_parallel.mappings", "megatron-core")
        group = _megatron_tp_group(env)
        if env.sequence_parallel:
            return _named(lambda x: mappings.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=reduce_grad, group=group),
                "hidden: megatron gather_from_sequence_parallel_region")
        return _named(lambda x: mappings.copy_to_tensor_model_parallel_region(x, group=group),
                      "hidden: megatron copy_to_tensor_model_parallel_region")
    group, world = env.group, env.tp
    if env.sequence_parallel:
        what = "dX reduce-scatter" if reduce_grad else "dX slice"
        return _named(lambda x: _GatherTokens.apply(x, group, world, reduce_grad),
                      f"hidden: all-gather + {what} (torch autograd Function)")
    if reduce_grad:
        return _named(lambda x: parallel.copy_to_vocab_parallel_region(x, group), "hidden: dX all-reduce (torch autograd Function)")
    return _named(lambda x: x, "hidden: as is (the peer all-reduces dX)")


def _named(fn, note: str):
    fn.note = note
    return fn


def _noted(fn: LossFn, *parts) -> LossFn:
    """Attach to ``fn`` the notes of the pieces it is made of (the JSON's ``note``)."""
    fn.note = "; ".join(n for n in (getattr(p, "note", p) for p in parts) if isinstance(n, str) and n)
    return fn


# -- liger-kernel's tensor-parallel function, and the idea of its fallback in plain torch -------------------------

def _liger_tp(env: Env) -> LossFn:
    mod = _import("liger_kernel.ops.fused_linear_scaled_cross_entropy", "liger-kernel")
    tp_fn = getattr(mod, "LigerFusedLinearScaledCrossEntropyTPFunction", None)
    if tp_fn is None:
        raise Unavailable(f"liger-kernel {_version('liger-kernel')} has no "
                          f"LigerFusedLinearScaledCrossEntropyTPFunction")
    group = env.group
    enter = _hidden_entry(env, reduce_grad=False)
    try:  # the dispatch of LigerFusedLinearScaledCrossEntropyTPFunction.apply, to say which path is measured
        native = env.dtype == torch.bfloat16 and mod._supports_native_tp_architecture(env.device)
        if native:
            try:
                native = mod._load_native_tp_function() is not None
            except ImportError:  # as liger-kernel's own dispatch: no native kernel, the fallback runs
                native = False
        path = "liger: native CUTLASS + NVSHMEM path" if native else "liger: 512-token fallback path"
    except Exception as e:  # noqa: BLE001 - private helpers of 0.8.5; the row runs anyway
        path = f"liger: path unknown ({type(e).__name__}: {e})"
    return _noted(lambda x, w, y: tp_fn.apply(enter(x), w, y, group).mean(), path, enter)


class _ChunkedVocabParallelNLL(torch.autograd.Function):
    """Per-token NLL of ``x @ w_shard.T`` over a vocab sharded on ``group`` (equal contiguous shards), a chunk of
    tokens at a time, never more than one chunk's logits live: the scheme of liger-kernel 0.8.5's tensor-parallel
    fallback (``_TensorParallelFusedLinearPPOFallbackFunction``, adapted there from verl), in plain torch.

    Forward, per chunk: the shard's logits in fp32; their max all-reduced (MAX); ``sum exp(z - max)`` and the
    target's logit (0 on ranks that do not hold it) all-reduced together (SUM); ``nll = max + log(sum) - z_t``.
    Backward, per chunk: logits recomputed, ``(softmax - onehot) * g`` cast to the input dtype, this shard's part
    of ``dX`` and ``dW`` accumulated in the weight's dtype (as the fallback does). ``dX`` is this shard's part
    only: the caller's ``_hidden_entry`` sums it over the group.
    """

    CHUNK = 512

    @staticmethod
    def forward(ctx, x, w, y, group, vocab_start):
        rows = w.shape[0]
        nll = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
        lse = torch.empty_like(nll)
        for c0 in range(0, x.shape[0], _ChunkedVocabParallelNLL.CHUNK):
            sl = slice(c0, min(x.shape[0], c0 + _ChunkedVocabParallelNLL.CHUNK))
            z = (x[sl] @ w.t()).float()
            m = z.amax(1)
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
            local = y[sl] - vocab_start
            owns = (local >= 0) & (local < rows)
            zt = torch.where(owns, z.gather(1, local.clamp(0, rows - 1)[:, None]).squeeze(1), 0.0)
            sums = torch.stack([torch.exp(z - m[:, None]).sum(1), zt])
            dist.all_reduce(sums, group=group)
            lse[sl] = m + torch.log(sums[0])
            nll[sl] = lse[sl] - sums[1]
        ctx.save_for_backward(x, w, y, lse)
        ctx.vocab_start = vocab_start
        return nll

    @staticmethod
    def backward(ctx, grad):
        x, w, y, lse = ctx.saved_tensors
        rows = w.shape[0]
        dx = torch.empty_like(x)
        dw = torch.zeros_like(w)
        for c0 in range(0, x.shape[0], _ChunkedVocabParallelNLL.CHUNK):
            sl = slice(c0, min(x.shape[0], c0 + _ChunkedVocabParallelNLL.CHUNK))
            g = grad[sl].float()
            dz = torch.exp((x[sl] @ w.t()).float() - lse[sl, None]).mul_(g[:, None])
            local = y[sl] - ctx.vocab_start
            owns = (local >= 0) & (local < rows)
            dz[torch.arange(dz.shape[0], device=dz.device), local.clamp(0, rows - 1)] -= g * owns
            dz = dz.to(x.dtype)
            dx[sl] = dz @ w
            dw.add_(dz.t() @ x[sl])
        return dx, dw, None, None, None


def _chunked_tp(env: Env) -> LossFn:
    if env.group is None:
        raise Unavailable("needs a process group (run under --tp)")
    group, rank = env.group, env.rank
    enter = _hidden_entry(env)

    def fn(x, w, y):
        return _ChunkedVocabParallelNLL.apply(enter(x), w, y, group, rank * w.shape[0]).mean()
    return _noted(fn, enter)


# -- torch loss_parallel (DTensor) --------------------------------------------------------------------------------

def _loss_parallel(env: Env, *, fp32: bool) -> LossFn:
    if env.group is None:
        raise Unavailable("needs a process group (run under --tp)")
    tensor = _import("torch.distributed.tensor", "torch")
    loss_parallel = _import("torch.distributed.tensor.parallel", "torch").loss_parallel
    mesh = _import("torch.distributed.device_mesh", "torch").DeviceMesh.from_group(env.group, env.device.type)
    enter = _hidden_entry(env)

    def fn(x, w, y):
        logits = F.linear(enter(x), w)
        if fp32:
            logits = logits.float()
        logits = tensor.DTensor.from_local(logits, mesh, [tensor.Shard(logits.ndim - 1)], run_check=False)
        target = tensor.DTensor.from_local(y, mesh, [tensor.Replicate()], run_check=False)
        return F.cross_entropy(logits, target).to_local()
    fn.context = loss_parallel
    return _noted(fn, "logits fp32" if fp32 else "logits bf16 (as the anchors)", enter)


# -- vpce ---------------------------------------------------------------------------------------------------------

def _vpce(env: Env, *, backend: str, memory_budget: str = "auto") -> LossFn:
    if backend == "triton" and importlib.util.find_spec("vpce.triton_backend") is None:
        raise Unavailable("vpce.triton_backend does not exist yet")
    from .. import linear_cross_entropy
    return functools.partial(linear_cross_entropy, backend=backend, memory_budget=memory_budget, group=env.group,
                             sequence_parallel=env.sequence_parallel)


def _vpce_backward_reduce(env: Env) -> LossFn:
    """vpce triton with dX summed over the group in backward, in the input dtype (one all-reduce, or reduce-scatter
    with SP, of the 16-bit dX, as Megatron does), instead of chunk by chunk in forward in fp32 (the default)."""
    from .. import linear_cross_entropy, triton_backend

    def fn(x, w, y):
        before = triton_backend.REDUCE_DX_IN_FORWARD
        triton_backend.REDUCE_DX_IN_FORWARD = False  # read in forward only
        try:
            return linear_cross_entropy(x, w, y, backend="triton", group=env.group,
                                        sequence_parallel=env.sequence_parallel)
        finally:
            triton_backend.REDUCE_DX_IN_FORWARD = before
    return fn


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
    Method(name="megatron", label="megatron vocab_parallel_ce", build=_megatron, package="megatron-core", tp=True,
           even_shards=True),
    Method(name="megatron-fused", label="megatron fused_vp_ce", build=_megatron_fused, package="megatron-core",
           tp=True, even_shards=True),
    Method(name="liger-tp", label="liger-kernel TP scaled CE", build=_liger_tp, package="liger-kernel",
           needs_cuda=True, tp=True, tp_only=True, even_shards=True),
    Method(name="chunked-tp", label="chunked vp CE (liger fallback idea, torch)", build=_chunked_tp, tp=True,
           tp_only=True, even_shards=True),
    Method(name="loss-parallel", label="torch loss_parallel", build=functools.partial(_loss_parallel, fp32=True),
           package="torch", tp=True, tp_only=True, even_shards=True),
    Method(name="loss-parallel-bf16", label="torch loss_parallel bf16 logits",
           build=functools.partial(_loss_parallel, fp32=False), package="torch", tp=True, tp_only=True,
           even_shards=True),
    Method(name="vpce-triton", label="vpce triton", build=functools.partial(_vpce, backend="triton"),
           package="vpce", needs_cuda=True, no_grad=True, tp=True),
    Method(name="vpce-triton-bwd-reduce", label="vpce triton, 16-bit dX reduce in bwd", build=_vpce_backward_reduce,
           package="vpce", needs_cuda=True, tp=True, tp_only=True),
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


def default_methods(tp: bool) -> list[str]:
    """What ``--methods all`` (the default) means: every single-GPU row, or under ``--tp`` every row with a
    vocab-parallel form."""
    return [FLOOR, *(m.name for m in METHODS.values() if (m.tp if tp else not m.tp_only))]


def _version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


def package_versions() -> dict[str, str | None]:
    """Installed versions of torch, triton, the peers and vpce (None: not installed)."""
    out = {pkg: _version(pkg) for pkg in ("torch", "triton", "liger-kernel", "cut-cross-entropy", "megatron-core",
                                          "numpy", "matplotlib")}
    from .. import __version__
    out["vpce"] = __version__
    out["cuda"] = torch.version.cuda
    return out
