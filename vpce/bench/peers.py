"""The peers the benchmark measures vpce against: one function per peer, each returning a loss function.

Every adapter takes an ``Env`` and returns ``loss(x [N, D], w [V, D], y [N]) -> scalar mean loss`` that autograd
differentiates into ``x.grad`` and ``w.grad``. A peer is imported when its row is built: one that is not
installed raises ``Unavailable`` (a ``missing: ...`` row). The peers are called as their documentation shows
(versions in the JSON):

* torch eager: ``F.cross_entropy(F.linear(x, w).float(), y)``; torch.compile of that same function.
* torch's own ``F.linear_cross_entropy(x, w, y, options=...)`` (torch >= 2.13): ``options=None`` is its reference
  path (``F.linear`` then ``F.cross_entropy`` on logits in the input dtype; the loss comes back in that dtype),
  a ``torch.nn.LinearCrossEntropyOptions`` its chunked path over the tokens (``TORCH_LCE``: the rows' options).
* liger-kernel: ``LigerFusedLinearCrossEntropyLoss()(w, x, y)``.
* cut-cross-entropy: ``linear_cross_entropy(x, w, y)`` (default gradient filter) and ``filter_eps=None`` (exact).
* quack-kernels 0.6.5 (Dao-AILab, CuTe DSL on ``nvidia-cutlass-dsl`` 4.7.1): ``chunked_linear_cross_entropy(x, w,
  y, chunk_size=4096)`` (its automatic choice, the scaled-exp path) and with ``use_scaled_exp=False`` (the base
  path). The scaled-exp path raises ``ValueError`` ("m == n makes row/col inference ambiguous") when
  ``chunk_size`` equals ``D``, so on the Llama-3-8B head (D=4096) that row is ``failed``.
  ``launch/quack_wheels.sh`` gets it onto a GPU machine without network.
* TRL 1.16's fused LM head (``trl``): ``trl.kernels.ChunkedLogProbFunction.apply(x[keep], w, None, y[keep], 1.0,
  32768, None, 1.0, outputs)``, as ``trl.trainer.utils.add_fused_lm_head`` calls it on CUDA (the non-ignored tokens
  gathered first, TRL's 32768-column tiles), the loss ``-log_probs.mean()``. ``outputs=()`` for the log-probs
  alone, or ``("entropy", "is_top1")``, the fields SFT logs (detached; the row is TRL SFT's call). Its backward
  imports ``trl.trainer.utils`` for ``maybe_gather_lm_head_ctx``, which needs pandas, accelerate and datasets; where
  those are not installed (the GPU machine gets only the wheels ``vpce/bench/wheels.sh`` lists), the row registers
  a ``trl.trainer.utils`` holding that one function as TRL defines it without DeepSpeed ZeRO-3, a null context,
  and says so in its note.
* megatron-core (0.16.1 in the test extra, 0.19.2 in ``vpce/bench/wheels.sh``): ``vocab_parallel_cross_entropy``
  / ``fused_vocab_parallel_cross_entropy(logits, target, tp_group)`` on bf16 logits from ``F.linear``, ``.mean()``
  of the per-token losses; they need Megatron's ``parallel_state``, initialized here on a process group of this one
  process (or, under torchrun, on the launched group). The unfused one is called without its ``tp_group`` keyword
  (0.19 added it; left out, it is ``parallel_state``'s group, as in 0.16).
* fla-core 0.6.0 (``fla``): ``FusedLinearCrossEntropyLoss(process_group=group)(x, y, w)``, its defaults otherwise
  (``num_chunks=8`` token chunks, each chunk's gradients formed in forward, ``dW`` accumulated in fp32); its
  Triton kernels run on a CPU only under ``TRITON_INTERPRET=1``.
* liger-kernel 0.8.5's FLCE through its kernel dispatcher with the CuTe DSL implementation asked for by name
  (``liger_cute``): ``liger_kernel.functional.fused_linear_cross_entropy(x, w, y, impl="nvidia-cutedsl")``, whose
  per-chunk cross-entropy is the CuTe DSL kernel (``nvidia-cutlass-dsl``, sm_90 or newer); the ``liger`` row's
  ``LigerFusedLinearCrossEntropyLoss`` never dispatches (its Triton kernel always).
* RL, the loss of vpce's ``vpce-logprob-loss`` row (``mean(A_i nll_i) - 0.01 mean(H_i)`` over the non-ignored
  tokens, per-sequence advantages of ``[B, T]`` rows of 2048 tokens; ``liger_logprob_loss``): liger-kernel 0.8.5's
  ``LigerFusedLinearScaledCrossEntropyFunction.apply(x, w, y, 1.0, -100, 1, True)`` (per-token NLL and entropy,
  as verl's ``FusedLinearForPPO`` calls it). Its dispatch: the Hopper CuTe DSL kernel on sm_90 (which imports
  ``nvidia-cutlass-dsl``: without it the row is ``missing``), otherwise its 512-token torch fallback (CPU
  included); the row's note says which.

Tensor parallelism (``--tp``): on each rank of ``env.group`` a loss function takes this rank's hidden input (all
``N`` tokens, or with ``env.sequence_parallel`` its ``N/tp`` slice), its contiguous vocab shard of ``w`` and the
full targets, and must leave in ``x.grad`` the complete ``dX`` (summed over the group; under SP this rank's slice)
and in ``w.grad`` its shard's gradient. The peers get their hidden states the way Megatron's lm_head gives them
(``hidden_entry``): identity forward and ``dX`` all-reduced in backward, or under SP all-gathered forward and
``dX`` reduce-scattered in backward, so each row's step includes the ``dX`` collective. The vocab-parallel peers:

* megatron-core: as above, ``F.linear`` of the shard, then its (fused) vocab-parallel cross-entropy.
* liger-kernel 0.8.5: ``LigerFusedLinearScaledCrossEntropyTPFunction.apply(x, w_shard, y, group)`` (per-token
  NLL, ``.mean()``): its native CUTLASS + NVSHMEM kernel for bf16 on Hopper/Blackwell when that is installed,
  otherwise its 512-token chunked fallback; the row's note says which. It all-reduces ``dX`` itself; it needs
  CUDA. (``LigerFusedLinearCrossEntropyLoss``, the ``liger`` row, has no vocab-parallel mode.) The RL row calls
  the same function with ``return_entropy=True``: ``apply(x, w_shard, y, group, 1.0, -100, 1, True)``.
* fla-core: ``FusedLinearCrossEntropyLoss(process_group=group)``, which takes equal contiguous vocab shards and
  the replicated hidden states and targets, and all-reduces ``dX`` itself.
* ``chunked-tp``: the idea of that fallback written here in plain torch (``chunked_vocab_parallel_nll``), so it
  runs anywhere, CPU included.
* torch ``loss_parallel``: the shard's logits as a DTensor ``Shard(-1)`` on a 1-D mesh of the group and
  ``F.cross_entropy`` under ``torch.distributed.tensor.parallel.loss_parallel()`` (forward and backward), once with
  fp32 logits like the ``torch`` row and once with bf16 logits, as the project's anchor measurements of the peers
  (quoted in docs/benchmarks.md) were taken.

A loss function may carry ``note`` (a string for the JSON: which path or region it uses) and ``context`` (a
context-manager factory that must hold over its forward and backward: torch's ``loss_parallel``).

Distillation (``--distill``, ``DistillFn``): ``loss(x [N, D], w [V, D], y [N], xt [N, D_T], wt [V, D_T])`` is the
mean over the tokens whose target is not -100 of a divergence between the teacher's softmax ``q`` (of ``xt @
wt.T``) and the student's ``p`` (of ``x @ w.T``), temperature 1, differentiated into ``x.grad`` and ``w.grad``
only (the teacher is used detached). The divergences are ``vpce.linear_distillation_loss``'s: forward KL
``KL(q || p)``, reverse KL ``KL(p || q)``, and the generalized JSD ``beta KL(q || m) + (1 - beta) KL(p || m)``
with ``m = beta q + (1 - beta) p`` (beta: the teacher's weight in the mixture, as TRL's ``generalized_jsd_loss``).

* torch eager (``torch_distill``): both heads' logits materialized with ``F.linear`` in the inputs' dtype, fp32
  ``log_softmax``, the teacher's under ``torch.no_grad()``, the divergence written from its definition.
* liger-kernel (``liger_jsd``): ``LigerFusedLinearJSD(jsd_beta=b, temperature=1.0)(student_input=x,
  student_weight=w, teacher_input=xt, teacher_weight=wt, shift_labels=y)`` (keywords, so that a version whose
  signature differs fails loudly instead of being mis-called). Its convention is vpce's: in liger-kernel's
  ``_jsd_kernel`` ``X = log Q`` is the student, ``Y = log P`` the teacher, ``M = beta P + (1 - beta) Q`` and the
  loss ``beta KL(P || M) + (1 - beta) KL(Q || M)``; ``jsd_beta=0`` is its forward KL ``KL(P || Q)`` and
  ``jsd_beta=1`` its reverse KL ``KL(Q || P)`` (those two branches since liger-kernel 0.4.2; an older version
  computes 0 there, which the row's loss error shows). So vpce's ``beta`` is passed as ``jsd_beta`` unchanged,
  forward KL is ``jsd_beta=0`` and reverse KL ``jsd_beta=1``. Its ``batchmean`` divides by the tokens whose label
  is not ``ignore_index`` (-100), vpce's ``mean``; it applies no ``T**2``. Its logits are ``F.linear``'s in the
  inputs' dtype, then fp32, as torch eager's; it accumulates ``dW`` in the weight's dtype.
"""

from __future__ import annotations

import importlib
import math
import sys
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .. import parallel
from ..double_backward import refuse_double_backward
from .harness import Env
from .launch_env import free_port, set_collective_env
from .meta import package_version

__all__ = ["Unavailable", "LossFn", "DistillFn", "torch_eager", "torch_compile", "torch_lce", "TORCH_LCE", "liger",
           "cce", "quack", "trl", "megatron", "liger_tp", "chunked_tp", "loss_parallel", "megatron_tp_group",
           "shutdown_megatron", "hidden_entry", "chunked_vocab_parallel_nll", "torch_distill", "liger_jsd",
           "divergence_per_token", "verl_actor_config", "verl_loss", "liger_verl", "fla", "liger_cute",
           "liger_logprob_loss", "rl_advantages"]

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
DistillFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class Unavailable(Exception):
    """The row cannot run here (package not installed, needs CUDA or a process group): a ``missing`` row."""


def _import(module: str, package: str):
    """Import a peer module quietly; ``Unavailable`` if its package is not installed."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return importlib.import_module(module)
    except ImportError as e:
        raise Unavailable(f"{package} not importable ({type(e).__name__}: {e})") from e


def _with_note(fn, *parts):
    """``fn`` with ``fn.note``: the notes of the pieces it is made of (strings, or functions that carry one)."""
    fn.note = "; ".join(n for n in (getattr(p, "note", p) for p in parts) if isinstance(n, str) and n)
    return fn


def _needs_group(env: Env):
    if env.group is None:
        raise Unavailable("needs a process group (run under --tp)")


# -- torch ------------------------------------------------------------------------------------------------------

def _torch_loss(x, w, y):
    return F.cross_entropy(F.linear(x, w).float(), y)


def torch_eager(env: Env) -> LossFn:
    return _torch_loss


def torch_compile(env: Env) -> LossFn:
    torch._dynamo.reset()  # a fresh compile per shape: no recompile limit, no automatic dynamic shapes
    return torch.compile(_torch_loss, dynamic=False)


#: The ``torch.nn.LinearCrossEntropyOptions`` of the ``F.linear_cross_entropy`` rows (None: the reference path).
#: With an explicit ``acc_policy``, ``acc_dtype=None`` means the input dtype; those rows name float32, which
#: ``"auto"`` picks for bf16 on CUDA and on CPU.
TORCH_LCE = {  # name: (label, options)
    "ref": ("", None),
    "chunked": (" chunked (default options)", dict()),
    "accurate": (" chunked acc_policy=accurate fp32", dict(acc_policy="accurate", acc_dtype=torch.float32)),
    "balanced": (" chunked acc_policy=balanced fp32", dict(acc_policy="balanced", acc_dtype=torch.float32)),
    "ar1": (" chunked chunking_method=aspect_ratio", dict(chunking_method="aspect_ratio")),
}


def torch_lce_available() -> None:
    """Raise ``Unavailable`` unless this torch has ``F.linear_cross_entropy``."""
    if getattr(F, "linear_cross_entropy", None) is None:
        raise Unavailable(f"torch {torch.__version__} has no F.linear_cross_entropy (added in torch 2.13)")


def torch_lce(env: Env, *, options: dict | None) -> LossFn:
    """torch's ``F.linear_cross_entropy``, with ``torch.nn.LinearCrossEntropyOptions(**options)`` unless None."""
    torch_lce_available()
    lce = F.linear_cross_entropy
    if options is None:
        return lambda x, w, y: lce(x, w, y)
    opts = torch.nn.LinearCrossEntropyOptions(**options)
    return lambda x, w, y: lce(x, w, y, options=opts)


# -- liger-kernel, cut-cross-entropy, quack -----------------------------------------------------------------------

def liger(env: Env) -> LossFn:
    module = _import("liger_kernel.transformers.fused_linear_cross_entropy", "liger-kernel")
    loss = module.LigerFusedLinearCrossEntropyLoss()
    return lambda x, w, y: loss(w, x, y)


def cce(env: Env, *, exact: bool) -> LossFn:
    lce = _import("cut_cross_entropy", "cut-cross-entropy").linear_cross_entropy
    if exact:
        return lambda x, w, y: lce(x, w, y, filter_eps=None)
    return lambda x, w, y: lce(x, w, y)


def quack(env: Env, *, scaled_exp: bool) -> LossFn:
    lce = _import("quack.linear_cross_entropy", "quack-kernels").chunked_linear_cross_entropy
    if scaled_exp:
        return lambda x, w, y: lce(x, w, y, chunk_size=4096)
    return lambda x, w, y: lce(x, w, y, chunk_size=4096, use_scaled_exp=False)


def trl(env: Env, *, sft: bool) -> LossFn:
    kernel = _import("trl.kernels.chunked_logprob", "trl").ChunkedLogProbFunction
    note = ""
    try:
        importlib.import_module("trl.trainer.utils")
    except ImportError as e:  # TRL's own definition without DeepSpeed ZeRO-3 (see the module docstring)
        import contextlib
        import types
        shim = types.ModuleType("trl.trainer.utils")
        shim.maybe_gather_lm_head_ctx = lambda *params: contextlib.nullcontext()
        sys.modules["trl.trainer.utils"] = shim
        note = f"trl.trainer.utils not importable ({e}): its maybe_gather_lm_head_ctx taken as a null context"
    outputs = ("entropy", "is_top1") if sft else ()

    def loss(x, w, y):
        keep = y != -100
        return -kernel.apply(x[keep], w, None, y[keep], 1.0, 32768, None, 1.0, outputs)[0].mean()
    return _with_note(loss, note)


def trl_grpo(env: Env) -> LossFn:
    """What GRPOTrainer runs: TRL's fused head for the per-token log-probs and entropy of ``[B, T]`` rows of 2048
    tokens, then TRL's GRPO loss math on them (``vpce.reference.trl_grpo``, TRL 1.16's ``_compute_loss`` written
    out): ``dapo``, ``beta=0.04``, per-sequence advantages, old and reference log-probs given."""
    from ..reference import trl_grpo as grpo_math
    kernel = trl(env, sft=True)  # the import (and its shim) checked
    head = _import("trl.kernels.chunked_logprob", "trl").ChunkedLogProbFunction
    cache = {}

    def loss(x, w, y):
        n = y.shape[0]
        t = 2048 if n % 2048 == 0 else n
        if "adv" not in cache:
            gen = torch.Generator(device=y.device).manual_seed(0)
            with torch.no_grad():
                lp = head.apply(x, w, None, y.clamp(min=0), 1.0, 32768, None, 1.0, ())[0].float()
            cache["adv"] = torch.randn(n // t, generator=gen, device=y.device)
            cache["old"] = (lp + 0.1 * torch.randn(n, generator=gen, device=y.device)).reshape(-1, t)
            cache["ref"] = (lp + 0.1 * torch.randn(n, generator=gen, device=y.device)).reshape(-1, t)
        mask = (y != -100).reshape(-1, t).float()
        out = head.apply(x, w, None, y.clamp(min=0), 1.0, 32768, None, 1.0, ("entropy",))
        logp, ent = out[0].float().reshape(-1, t), out[1].float().reshape(-1, t)
        return grpo_math(logp, cache["old"], cache["ref"], cache["adv"], mask, ent.detach(), beta=0.04, eps_low=0.2,
                         eps_high=0.2, delta=None, loss_type="dapo", level="token", max_completion_length=t,
                         num_items_in_batch=mask.sum())[0]
    return _with_note(loss, kernel)


# -- verl's policy loss (its actor's loss on per-token log-probs and entropy) -----------------------------------------

def verl_actor_config():
    """The verl actor configuration of the RL rows: PPO (``vanilla``), ``token-mean``, ``entropy_coeff=0.01``,
    no KL loss: the loss ``mean(-A r) - 0.01 mean(H)`` with ``r`` the clipped ratio to the old log-probs."""
    _import("verl.trainer.ppo.core_algos", "verl")
    from verl.workers.config import ActorConfig
    from verl.workers.config.actor import PolicyLossConfig
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, loss_agg_mode="token-mean",
                       entropy_coeff=0.01, policy_loss=PolicyLossConfig(loss_mode="vanilla"))


def verl_loss(config, logp, ent, old, adv, mask):
    """verl's ``workers.utils.losses.ppo_loss`` composition (its policy loss, minus ``entropy_coeff`` times the
    aggregated entropy) on per-token values ``[B, T]``."""
    core_algos = _import("verl.trainer.ppo.core_algos", "verl")
    pg, _ = core_algos.get_policy_loss_fn(config.policy_loss.get("loss_mode", "vanilla"))(
        old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask, loss_agg_mode=config.loss_agg_mode,
        config=config)
    return pg - config.entropy_coeff * core_algos.agg_loss(loss_mat=ent, loss_mask=mask,
                                                           loss_agg_mode=config.loss_agg_mode)


def rl_batch(y: torch.Tensor) -> tuple[int, torch.Tensor, torch.Generator]:
    """The RL rows' batch: the targets as ``[B, T]`` rows of ``T = 2048`` tokens (one row where ``N`` is not a
    multiple) and per-sequence advantages ``[B]`` of both signs, the first draw of a generator seeded 0 on ``y``'s
    device; returns ``(T, advantages, generator)``, the generator for the caller's further draws (vpce's rows draw
    their old and reference log-probs next), so that every RL row sees the same advantages."""
    n = y.shape[0]
    t = 2048 if n % 2048 == 0 else n
    gen = torch.Generator(device=y.device).manual_seed(0)
    return t, torch.randn(n // t, generator=gen, device=y.device), gen


def _liger_tp_path(mod, env: Env) -> str:
    """Which path ``LigerFusedLinearScaledCrossEntropyTPFunction.apply`` takes on ``env`` (its own dispatch)."""
    try:
        native = env.dtype == torch.bfloat16 and mod._supports_native_tp_architecture(env.device)
        if native:
            try:
                native = mod._load_native_tp_function() is not None
            except ImportError:  # as liger-kernel's own dispatch: no native kernel, the fallback runs
                native = False
        return "liger: native CUTLASS + NVSHMEM path" if native else "liger: 512-token fallback path"
    except Exception as e:  # noqa: BLE001 - liger-kernel 0.8.5's own private helpers; the row runs anyway
        return f"liger: path unknown ({type(e).__name__}: {e})"


def _liger_scaled_ce(env: Env) -> Callable:
    """liger-kernel's per-token NLL and entropy, ``(x, w, y) -> (nll [N] fp32, entropy [N])`` (ignored tokens 0),
    temperature 1, with a ``note`` saying which kernel runs. One rank: ``LigerFusedLinearScaledCrossEntropyFunction``,
    which takes the Hopper CuTe DSL kernel on an sm_90 GPU (it imports ``nvidia-cutlass-dsl``: ``Unavailable``
    without it) and its 512-token torch fallback elsewhere, CPU included. Under a group:
    ``LigerFusedLinearScaledCrossEntropyTPFunction`` on this rank's equal vocab shard (CUDA only), which all-reduces
    ``dX`` itself."""
    ops = _import("liger_kernel.ops", "liger-kernel")
    if env.group is None:
        fn = getattr(ops, "LigerFusedLinearScaledCrossEntropyFunction", None)
        if fn is None:
            raise Unavailable(f"liger-kernel {package_version('liger-kernel')} has no "
                              f"LigerFusedLinearScaledCrossEntropyFunction (0.8.5 has)")
        hopper = env.cuda and torch.version.hip is None and torch.cuda.get_device_capability(env.device) == (9, 0)
        if hopper:  # liger-kernel's own dispatch takes its sm_90 kernel here, and fails if it cannot import it
            _import("liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90",
                    "liger-kernel's sm_90 scaled CE kernel (needs nvidia-cutlass-dsl)")
        note = "liger: Hopper CuTe DSL kernel (sm_90)" if hopper else "liger: 512-token torch fallback"
        return _with_note(lambda x, w, y: fn.apply(x, w, y, 1.0, -100, 1, True), note)
    mod = _import("liger_kernel.ops.fused_linear_scaled_cross_entropy", "liger-kernel")
    tp_fn = getattr(mod, "LigerFusedLinearScaledCrossEntropyTPFunction", None)
    if tp_fn is None:
        raise Unavailable(f"liger-kernel {package_version('liger-kernel')} has no "
                          f"LigerFusedLinearScaledCrossEntropyTPFunction")
    if not env.cuda:
        raise Unavailable(f"liger-kernel's tensor-parallel function needs CUDA tensors (running on {env.device})")
    group = env.group
    enter = hidden_entry(env, reduce_grad=False)
    return _with_note(lambda x, w, y: tp_fn.apply(enter(x), w, y, group, 1.0, -100, 1, True),
                      _liger_tp_path(mod, env), enter)


def liger_verl(env: Env) -> LossFn:
    """verl's actor with ``use_fused_kernels`` and ``impl_backend="liger"``: liger-kernel's
    ``LigerFusedLinearScaledCrossEntropyFunction`` (per-token NLL and entropy; Hopper CuTe kernel in 0.8.5) called as
    ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` calls it, then verl's loss on ``[B, T]`` rows of
    2048 tokens (``verl_loss``), per-sequence advantages (``rl_batch``), old log-probs near the current ones."""
    scaled_ce = _liger_scaled_ce(env)
    config = verl_actor_config()
    cache = {}

    def loss(x, w, y):
        if "adv" not in cache:
            t, adv, gen = rl_batch(y)
            with torch.no_grad():
                lp = -scaled_ce(x, w, y)[0].float()
            cache["t"], cache["adv"] = t, adv[:, None].expand(-1, t)
            cache["old"] = (lp + 0.1 * torch.randn(y.shape[0], generator=gen, device=y.device)).reshape(-1, t)
        t = cache["t"]
        nll, ent = scaled_ce(x, w, y)
        mask = (y != -100).reshape(-1, t)
        return verl_loss(config, -nll.float().reshape(-1, t), ent.float().reshape(-1, t), cache["old"], cache["adv"],
                         mask)
    return _with_note(loss, scaled_ce)


def liger_logprob_loss(env: Env) -> LossFn:
    """The loss of vpce's ``vpce-logprob-loss`` row from liger-kernel's per-token NLL and entropy
    (``_liger_scaled_ce``; under ``--tp`` its tensor-parallel function): ``sum((A nll - 0.01 H) * keep) /
    count(keep)`` over the non-ignored tokens, with the per-sequence advantages of ``rl_batch`` (the same as
    vpce's row) broadcast over each row's tokens."""
    scaled_ce = _liger_scaled_ce(env)
    cache = {}

    def loss(x, w, y):
        if "adv" not in cache:
            t, adv, _ = rl_batch(y)
            cache["adv"] = adv[:, None].expand(-1, t).reshape(-1)
        keep = y != -100
        nll, ent = scaled_ce(x, w, y)
        return ((cache["adv"] * nll - 0.01 * ent.float()) * keep).sum() / keep.sum().clamp(min=1)
    return _with_note(loss, scaled_ce)


# -- fla-core -------------------------------------------------------------------------------------------------------

def fla(env: Env) -> LossFn:
    """fla-core's ``FusedLinearCrossEntropyLoss`` with its defaults; under ``--tp`` with ``process_group`` (equal
    vocab shards, hidden states and targets replicated: under SP the peer gets the gathered tokens)."""
    mod = _import("fla.modules.fused_linear_cross_entropy", "fla-core")
    if env.group is not None and env.tp > 1 and dist.get_backend(env.group) == "gloo":
        raise Unavailable("fla-core's vocab-parallel path gathers its [world, N] statistics with "
                          "all_gather_into_tensor, whose shapes gloo refuses (NCCL takes them)")
    loss = mod.FusedLinearCrossEntropyLoss(process_group=env.group)
    enter = hidden_entry(env, reduce_grad=False)
    return _with_note(lambda x, w, y: loss(enter(x), y, w), enter)


# -- liger-kernel's FLCE through its dispatcher, CuTe DSL -------------------------------------------------------------

def liger_cute(env: Env) -> LossFn:
    """liger-kernel's FLCE with its CuTe DSL implementation asked for by name (``impl="nvidia-cutedsl"``), after
    liger-kernel's own dispatcher says it can run on this device (``Unavailable`` with its reason otherwise)."""
    functional = _import("liger_kernel.functional", "liger-kernel")
    backends = _import("liger_kernel.backends", "liger-kernel")
    flce = getattr(functional, "fused_linear_cross_entropy", None)
    if flce is None:
        raise Unavailable(f"liger-kernel {package_version('liger-kernel')} has no "
                          f"liger_kernel.functional.fused_linear_cross_entropy (0.8.5 has)")
    try:
        backends.resolve_impl("fused_linear_cross_entropy", "nvidia-cutedsl", env.device if env.cuda else None)
    except RuntimeError as e:  # ImplNotAvailableError: the capability it lacks here, in liger-kernel's words
        raise Unavailable(f"liger-kernel's CuTe DSL FLCE is not available ({e})") from e

    def loss(x, w, y):
        return flce(x, w, y, impl="nvidia-cutedsl")[0]
    return _with_note(loss, "liger: per-chunk CE by its CuTe DSL kernel (a vocab not a multiple of 16 bytes per "
                            "row: its Triton kernel, with liger-kernel's warning)")


# -- megatron-core ------------------------------------------------------------------------------------------------

_OWN_GROUP = False  # whether megatron_tp_group created the default process group (and so shutdown destroys it)


def megatron_tp_group(env: Env):
    """Megatron's tensor-parallel group, initializing ``parallel_state`` (and a 1-rank process group) once."""
    global _OWN_GROUP
    ps = _import("megatron.core.parallel_state", "megatron-core")
    if not dist.is_available():
        raise Unavailable("torch.distributed is not available in this torch build")
    if not dist.is_initialized():
        if env.cuda:
            torch.cuda.set_device(env.device)
        set_collective_env()
        dist.init_process_group("nccl" if env.cuda else "gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                                rank=0, world_size=1)
        _OWN_GROUP = True
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=env.tp)
    return ps.get_tensor_model_parallel_group()


def shutdown_megatron():
    """Tear down Megatron's ``parallel_state`` if a row set it up, and the process group if ``megatron_tp_group``
    created it, so that the process exits without NCCL warnings."""
    global _OWN_GROUP
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if _OWN_GROUP and dist.is_initialized():
        dist.destroy_process_group()
    _OWN_GROUP = False


def megatron(env: Env, *, fused: bool) -> LossFn:
    group = megatron_tp_group(env)
    enter = hidden_entry(env, megatron=True)
    if fused:
        ce = _import("megatron.core.fusions.fused_cross_entropy", "megatron-core").fused_vocab_parallel_cross_entropy
        return _with_note(lambda x, w, y: ce(F.linear(enter(x), w), y, group).mean(), enter)
    ce = _import("megatron.core.tensor_parallel", "megatron-core").vocab_parallel_cross_entropy
    return _with_note(lambda x, w, y: ce(F.linear(enter(x), w), y).mean(), enter)


# -- tensor parallel: how the peers' hidden states enter the vocab-parallel region --------------------------------

class _GatherTokensKeepSlice(torch.autograd.Function):
    """All-gather along dim 0 forward; backward, this rank's own slice of a gradient that the peer has already
    summed over the group (liger-kernel's TP function all-reduces ``dX`` itself)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.rank, world = dist.get_rank(group), dist.get_world_size(group)
        out = x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))
        parallel.all_gather_tensor(out, x, group=group)
        ctx.rows = x.shape[0]
        return out

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward("the bench's sequence-parallel gather")
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows].contiguous(), None


def hidden_entry(env: Env, *, megatron: bool = False, reduce_grad: bool = True) -> Callable:
    """``hidden -> hidden as this rank's logits GEMM needs it``, with the ``dX`` collective in backward.

    Hidden replicated: identity, ``dX`` all-reduced in backward. Sequence parallel: the token slices all-gathered,
    ``dX`` reduce-scattered in backward. ``reduce_grad=False`` is for a peer that sums ``dX`` over the group
    itself (liger-kernel's TP function): nothing more in backward, or under SP the rank's own slice of ``dX``.
    With ``megatron=True`` on CUDA these are megatron-core's own mappings; elsewhere (its gather allocates on
    CUDA) ``vpce.parallel``'s. Identity without a group, and, like Megatron's, on a group of one.
    """
    if env.group is None or env.tp == 1:
        return _with_note(lambda x: x, "hidden: as is (one rank)")
    if megatron and env.cuda:
        mappings = _import("megatron.core.tensor_parallel.mappings", "megatron-core")
        group = megatron_tp_group(env)
        if env.sequence_parallel:
            return _with_note(lambda x: mappings.gather_from_sequence_parallel_region(
                x, tensor_parallel_output_grad=reduce_grad, group=group),
                "hidden: megatron gather_from_sequence_parallel_region")
        return _with_note(lambda x: mappings.copy_to_tensor_model_parallel_region(x, group=group),
                          "hidden: megatron copy_to_tensor_model_parallel_region")
    group = env.group
    if env.sequence_parallel and reduce_grad:
        return _with_note(lambda x: parallel.gather_from_sequence_parallel_region(x, group),
                          "hidden: all-gather + dX reduce-scatter (torch autograd Function)")
    if env.sequence_parallel:
        return _with_note(lambda x: _GatherTokensKeepSlice.apply(x, group),
                          "hidden: all-gather + dX slice (torch autograd Function)")
    if reduce_grad:
        return _with_note(lambda x: parallel.copy_to_vocab_parallel_region(x, group),
                          "hidden: dX all-reduce (torch autograd Function)")
    return _with_note(lambda x: x, "hidden: as is (the peer all-reduces dX)")


# -- liger-kernel's tensor-parallel function, and the idea of its fallback in plain torch -------------------------

def liger_tp(env: Env) -> LossFn:
    mod = _import("liger_kernel.ops.fused_linear_scaled_cross_entropy", "liger-kernel")
    tp_fn = getattr(mod, "LigerFusedLinearScaledCrossEntropyTPFunction", None)
    if tp_fn is None:
        raise Unavailable(f"liger-kernel {package_version('liger-kernel')} has no "
                          f"LigerFusedLinearScaledCrossEntropyTPFunction")
    group = env.group
    enter = hidden_entry(env, reduce_grad=False)
    return _with_note(lambda x, w, y: tp_fn.apply(enter(x), w, y, group).mean(), _liger_tp_path(mod, env), enter)


class _ChunkedVocabParallelNLL(torch.autograd.Function):
    """See ``chunked_vocab_parallel_nll``."""

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
        refuse_double_backward("the bench's chunked-tp row")
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


def chunked_vocab_parallel_nll(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, group,
                               vocab_start: int) -> torch.Tensor:
    """Per-token NLL of ``x @ w.T`` over a vocab sharded on ``group`` (``w``: this rank's rows from
    ``vocab_start``), 512 tokens at a time, never more than one chunk's logits live: the scheme of liger-kernel
    0.8.5's tensor-parallel fallback (``_TensorParallelFusedLinearPPOFallbackFunction``, adapted there from verl),
    in plain torch.

    Forward, per chunk: the shard's logits in fp32; their max all-reduced (MAX); ``sum exp(z - max)`` and the
    target's logit (0 on ranks that do not hold it) all-reduced together (SUM); ``nll = max + log(sum) - z_t``.
    Backward, per chunk: logits recomputed, ``(softmax - onehot) * g`` cast to the input dtype, this shard's part
    of ``dX`` and ``dW`` accumulated in the weight's dtype (as the fallback does). ``dX`` is this shard's part
    only: the caller sums it over the group (``hidden_entry``).
    """
    return _ChunkedVocabParallelNLL.apply(x, w, y, group, vocab_start)


def chunked_tp(env: Env) -> LossFn:
    _needs_group(env)
    group, rank = env.group, env.rank
    enter = hidden_entry(env)
    return _with_note(lambda x, w, y: chunked_vocab_parallel_nll(enter(x), w, y, group, rank * w.shape[0]).mean(),
                      enter)


# -- torch loss_parallel (DTensor) --------------------------------------------------------------------------------

def loss_parallel(env: Env, *, fp32: bool) -> LossFn:
    _needs_group(env)
    tensor = _import("torch.distributed.tensor", "torch")
    context = _import("torch.distributed.tensor.parallel", "torch").loss_parallel
    mesh = _import("torch.distributed.device_mesh", "torch").DeviceMesh.from_group(env.group, env.device.type)
    enter = hidden_entry(env)

    def fn(x, w, y):
        logits = F.linear(enter(x), w)
        if fp32:
            logits = logits.float()
        logits = tensor.DTensor.from_local(logits, mesh, [tensor.Shard(logits.ndim - 1)], run_check=False)
        target = tensor.DTensor.from_local(y, mesh, [tensor.Replicate()], run_check=False)
        return F.cross_entropy(logits, target).to_local()
    fn.context = context
    return _with_note(fn, "logits fp32" if fp32 else "logits bf16 (as the anchors)", enter)


# -- distillation (--distill) -------------------------------------------------------------------------------------

def divergence_per_token(s: torch.Tensor, u: torch.Tensor, divergence: str, beta: float | None) -> torch.Tensor:
    """The per-token divergence from the student's and the teacher's log-probabilities ``s``, ``u`` ``[N, V]``,
    written from its definition (``q = exp(u)``, ``p = exp(s)``)."""
    if divergence == "forward_kl":
        return (u.exp() * (u - s)).sum(-1)
    if divergence == "reverse_kl":
        return (s.exp() * (s - u)).sum(-1)
    log_m = torch.logsumexp(torch.stack([s + math.log1p(-beta), u + math.log(beta)]), dim=0)
    return beta * (u.exp() * (u - log_m)).sum(-1) + (1 - beta) * (s.exp() * (s - log_m)).sum(-1)


def torch_distill(env: Env, *, divergence: str, beta: float | None) -> DistillFn:
    """What a user writes today: both heads' logits materialized, fp32 log-softmax, the divergence by its
    definition, the mean over the labelled tokens; autograd into the student only."""
    def fn(x, w, y, xt, wt):
        s = F.log_softmax(F.linear(x, w).float(), dim=-1)
        with torch.no_grad():
            u = F.log_softmax(F.linear(xt, wt).float(), dim=-1)
        keep = y != -100
        return (divergence_per_token(s, u, divergence, beta) * keep).sum() / keep.sum()
    return fn


def liger_jsd(env: Env, *, jsd_beta: float) -> DistillFn:
    """liger-kernel's ``LigerFusedLinearJSD`` with ``jsd_beta`` (vpce's beta; 0: forward KL, 1: reverse KL)."""
    module = _import("liger_kernel.transformers.fused_linear_jsd", "liger-kernel")
    loss = module.LigerFusedLinearJSD(jsd_beta=jsd_beta, temperature=1.0)
    return lambda x, w, y, xt, wt: loss(student_input=x, student_weight=w, teacher_input=xt, teacher_weight=wt,
                                        shift_labels=y)
