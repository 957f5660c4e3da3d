"""The rows of the benchmark: the ``Method`` registry, and vpce's own rows (the peers are in ``vpce.bench.peers``).

A ``Method`` builds, for an ``Env``, a function ``loss(x [N, D], w [V, D], y [N]) -> scalar mean loss`` that
autograd differentiates into ``x.grad`` and ``w.grad``. A row that cannot run here (package not installed, needs
CUDA, needs a process group) shows up with status ``missing: ...``; one that raises while building or running
shows up as ``failed: ...``. None is silently dropped.

A row with ``frozen=True`` (``<name>-frozen``, made by ``frozen`` from the rows named in ``FROZEN``) differentiates
``x`` only: its weight has ``requires_grad=False``, as a LoRA fine-tune's lm_head. It is timed against the
two-GEMM floor (logits + dX), and its ``dW`` is not checked (there is none).

Caller-reduced rows (the speculative route, ``vpce.speculation``): a call site's first call takes the lean route,
and later ones the speculative route once a backward saw a uniform upstream gradient. So in ``vpce-logprobs`` the
first (checked) step is lean and the timed steps, after the warmup's, are speculative; ``vpce-logprobs-primed`` and
``vpce-none-mean`` run one throwaway step first, so that their checked step is speculative too;
``vpce-logprobs-grpo`` (per-token advantages) stays lean: the general case.

vpce's rows call ``vpce.linear_cross_entropy`` (or ``vpce.linear_log_probs``) as a user does: ``vpce-triton`` and
``vpce-triton-lean`` (``memory_budget="lean"``; ``vpce-triton-main-grad`` and ``vpce-triton-lean-main-grad`` with
``accumulate_main_grad``: see ``Method.main_grad``) name the Triton backend and need CUDA; ``vpce-torch`` names the
torch backend; the loss-option rows (label smoothing, z-loss, soft cap, token weights) and the log-prob rows use
the backend that fits the device (Triton on CUDA, torch elsewhere; their labels say which).

The peers' rows are ``vpce.bench.peers``'s. Of note: ``liger`` (``LigerFusedLinearCrossEntropyLoss``: liger-kernel's
Triton kernel, always) and ``liger-cute`` (the same FLCE through liger-kernel's dispatcher with its CuTe DSL
implementation by name: needs ``nvidia-cutlass-dsl`` and an sm_90 or newer GPU); ``fla`` (fla-core's
``FusedLinearCrossEntropyLoss``, vocab-parallel with ``process_group`` under ``--tp``; on a CPU only under
``TRITON_INTERPRET=1``: ``Method.triton_interpret``); ``liger-logprob-loss``, the loss of ``vpce-logprob-loss``
(``mean(A nll) - 0.01 mean(H)``, the same advantages) from liger-kernel's per-token NLL and entropy (its Hopper CuTe
DSL kernel on sm_90, its torch fallback elsewhere; under ``--tp`` its tensor-parallel function, CUDA only); and
``liger-verl`` beside ``vpce-verl`` (verl's PPO loss).

Distillation (``--distill``): a row with ``distill=(divergence, beta)`` builds ``loss(x, w, y, xt, wt)`` (the
teacher's hidden states and weight after the targets; ``vpce.bench.peers.DistillFn``) and is measured only in a
``--distill`` run, which measures only such rows; its errors are checked against the float64 reference of that
divergence. ``DISTILL`` names the divergences: for each, ``torch-<key>`` (plain eager, both heads' logits
materialized), ``liger-<key>`` (liger-kernel's ``LigerFusedLinearJSD``, CUDA) and ``vpce-<key>``
(``vpce.linear_distillation_loss`` on the device's backend, vocab-parallel under ``--tp``), and for forward KL and
JSD ``vpce-<key>-lean`` (``memory_budget="lean"``).

Tensor parallelism (``--tp``, ``vpce.bench.tp``): a method with ``tp=True`` takes, on each rank of ``env.group``,
this rank's hidden input, its vocab shard of ``w`` and the full targets (``vpce.bench.peers`` says how); vpce
does the collectives itself. Rows marked ``tp_only`` need a process group and are measured only under ``--tp``;
rows marked ``even_shards`` need every rank to hold the same number of vocab rows (``V`` divisible by ``tp``) and
are ``missing`` otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch

from . import peers
from .harness import Env
from .peers import LossFn, Unavailable

__all__ = ["Method", "METHODS", "FLOOR", "FROZEN", "VARIANTS", "DISTILL", "QUICK", "frozen", "method_names",
           "default_methods", "quick_methods", "runs_here", "device_backend", "divergence_label"]

#: Name of the three-GEMM floor in ``--methods`` (measured by the runner, not a loss).
FLOOR = "floor"


@dataclass(frozen=True, kw_only=True)
class Method:
    """One row of the table."""

    name: str
    """Key for ``--methods``."""
    label: str
    """Text in the table; ``{backend}`` stands for ``device_backend(env)``."""
    build: Callable[[Env], LossFn]
    """Returns the loss function for this environment; raises ``Unavailable`` when it cannot run here. A
    distillation row's function also takes the teacher's ``xt`` and ``wt`` after ``y``."""
    package: str | None = None
    """Distribution whose version the JSON records."""
    requires: tuple[str, ...] = ()
    """Top-level modules the row imports (optional dependencies): a row without them is ``missing: <module> not
    installed``, checked before it is built (vpce's own TRL rows need ``trl`` as TRL's rows do)."""
    check: Callable[[], None] | None = None
    """Raises ``Unavailable`` where what the row needs is missing in a way ``requires`` cannot name (torch's
    ``F.linear_cross_entropy``, which only some torch versions have); checked before it is built."""
    needs_cuda: bool = False
    """Has no CPU implementation."""
    triton_interpret: bool = False
    """With ``needs_cuda``: its Triton kernels also run on a CPU under ``TRITON_INTERPRET=1`` (fla-core's do; vpce's
    Triton rows do not, as the interpreter computes no bfloat16 there)."""
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
    frozen: bool = False
    """The lm_head is frozen (``w.requires_grad=False``, as in LoRA fine-tuning): the step computes the loss and
    ``dX`` only, and is timed against the two-GEMM floor (logits + dX); there is no ``dW`` to check."""
    main_grad: bool = False
    """The weight's gradient goes into an fp32 ``w.main_grad`` (``accumulate_main_grad=True``, as megatron-core's
    gradient-accumulation fusion): the harness gives the weight that buffer before the first step, zeroed, so it is
    live before the memory is measured, as Megatron's gradient buffer is; the dW checked is ``w.main_grad``."""
    distill: tuple[str, float | None] | None = None
    """A distillation row (``--distill``): the ``(divergence, beta)`` it computes, as ``linear_distillation_loss``
    names them; its errors are checked against the float64 reference of that divergence. None: a cross-entropy
    row."""

    def row_label(self, env: Env) -> str:
        """The table's text for this row on ``env``."""
        return self.label.format(backend=device_backend(env))

    def require(self, env: Env, shard_rows: list[int] | None = None):
        """Raise ``Unavailable`` if this row cannot run on ``env`` (under ``--tp``: with these vocab shards)."""
        if env.group is not None and not self.tp:
            raise Unavailable("no vocab-parallel form (a single-GPU row)")
        if self.needs_cuda and not env.cuda and not (self.triton_interpret and _interpreting()):
            hint = "; or TRITON_INTERPRET=1 for its Triton kernels" if self.triton_interpret else ""
            raise Unavailable(f"needs a CUDA device (running on {env.device}{hint})")
        if env.group is None and self.tp_only:
            raise Unavailable("a vocab-parallel row, measured only under --tp (torchrun)")
        if self.even_shards and shard_rows and len(set(shard_rows)) > 1:
            raise Unavailable(f"needs equal vocab shards (V={sum(shard_rows)} is not divisible by tp={env.tp})")
        for module in self.requires:
            if not _installed(module):
                raise Unavailable(f"{_DISTRIBUTIONS.get(module, module)} not importable (no module {module!r})")
        if self.check is not None:
            self.check()


#: ``Method.requires`` module -> the distribution that provides it (the ``missing`` row names it, as the peers do).
_DISTRIBUTIONS = {"trl": "trl", "verl": "verl", "megatron": "megatron-core", "liger_kernel": "liger-kernel",
                  "cut_cross_entropy": "cut-cross-entropy", "quack": "quack-kernels", "fla": "fla-core",
                  "cutlass": "nvidia-cutlass-dsl"}


def _interpreting() -> bool:
    """Whether Triton kernels run in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported, without importing it (a module already imported, or a stand-in put in
    ``sys.modules``, counts)."""
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def device_backend(env: Env) -> str:
    """The vpce backend that fits ``env``'s device: Triton on CUDA, torch elsewhere."""
    return "triton" if env.cuda else "torch"


# -- vpce ---------------------------------------------------------------------------------------------------------

def _vpce(env: Env, *, backend: str, memory_budget: str = "auto", accumulate_main_grad: bool = False) -> LossFn:
    from .. import linear_cross_entropy
    return functools.partial(linear_cross_entropy, backend=backend, memory_budget=memory_budget,
                             accumulate_main_grad=accumulate_main_grad, **env.vpce_layout())


def _vpce_variant(env: Env, **options) -> LossFn:
    """vpce with loss options (``token_weight``: a fixed random weight per token), on the device's backend."""
    from .. import linear_cross_entropy
    weights = options.pop("token_weight", False)
    backend = device_backend(env)
    cache = {}

    def fn(x, w, y):
        if weights and "tw" not in cache:
            gen = torch.Generator(device=y.device).manual_seed(0)
            cache["tw"] = torch.rand(y.shape, generator=gen, device=y.device)
        return linear_cross_entropy(x, w, y, backend=backend, token_weight=cache.get("tw"), **env.vpce_layout(),
                                    **options)
    return fn


def _primed(env: Env, fn: LossFn) -> LossFn:
    """``fn``, whose first call is preceded by one throwaway fwd+bwd on leaves that share the inputs' storage (the
    call site the speculative route keys on: ``vpce.speculation``), synchronized. The row's first (checked) step
    then already has a uniform history and takes the speculative route, as every timed step does."""
    from .harness import synchronize
    done = []

    def primed(x, w, y):
        if not done:
            done.append(True)
            fn(x.detach().requires_grad_(x.requires_grad), w.detach().requires_grad_(w.requires_grad), y).backward()
            synchronize(env.device)
        return fn(x, w, y)
    return primed


def _vpce_log_probs(env: Env, *, entropy: bool, top1: bool = False, primed: bool = False,
                    advantages: bool = False) -> LossFn:
    """Mean negative log-probability (= the plain loss, so its errors are checked), plus 0.01 x mean entropy; with
    ``top1`` TRL's SFT fields instead: the entropy and ``is_top1`` asked for and only logged (the loss is the plain
    one). ``primed``: see ``_primed``. ``advantages``: GRPO's
    shape of loss instead, ``-mean(A_i log p_i)`` with a fixed random advantage per token (never uniform: the lean
    route, whatever the history)."""
    from .. import linear_log_probs
    backend = device_backend(env)
    cache = {}

    def fn(x, w, y):
        out = linear_log_probs(x, w, y, backend=backend, return_entropy=entropy, return_top1=top1,
                               **env.vpce_layout())
        if entropy and not top1:
            return -out[0].mean() + 0.01 * out[1].mean()
        logp = out[0] if top1 else out
        if advantages:
            if "a" not in cache:
                gen = torch.Generator(device=y.device).manual_seed(0)
                cache["a"] = torch.randn(y.shape, generator=gen, device=y.device)
            return -(logp * cache["a"]).mean()
        return -logp.mean()
    return _primed(env, fn) if primed else fn


def _post_training_inputs(env: Env, x, w, y, cache: dict):
    """The bench's GRPO/DPO inputs, made once per row: ``y`` as ``[B, T]`` rows of ``T = 2048`` tokens (one row
    where ``N`` is not a multiple), per-sequence advantages of both signs (``peers.rl_batch``: the peers' RL rows
    draw the same), and old / reference log-probs near the current ones (ratios around 1, some clipped)."""
    from .. import linear_log_probs
    if "y" not in cache:
        n = y.shape[0]
        t, adv, gen = peers.rl_batch(y)
        with torch.no_grad():
            logp = linear_log_probs(x, w, y, backend=device_backend(env), **env.vpce_layout()).float()
        cache["y"] = y.reshape(-1, t)
        cache["t"] = t
        cache["adv"] = adv
        cache["old"] = (logp + 0.1 * torch.randn(n, generator=gen, device=y.device)).reshape(-1, t)
        cache["ref"] = (logp + 0.1 * torch.randn(n, generator=gen, device=y.device)).reshape(-1, t)
    return cache


def _rows(x, c, whole_rows: bool = False):
    """The hidden states as ``[B, T, D]`` (a view: the gradient reaches ``x``). A sequence-parallel slice stays
    flat, or with ``whole_rows`` (a loss over whole sequences: GRPO, DPO, verl's) becomes this rank's ``[B / world,
    T, D]`` rows, the layout those losses take under sequence parallelism (the slice must hold whole rows)."""
    t = c["t"]
    if x.shape[0] == c["y"].numel() or (whole_rows and x.shape[0] % t == 0):
        return x.view(-1, t, x.shape[-1])
    if whole_rows:
        raise Unavailable(f"under --sp each rank's slice of {x.shape[0]} tokens must hold whole rows of {t} tokens")
    return x


def _vpce_grpo(env: Env, *, level: str, memory_budget: str | float = "auto") -> LossFn:
    """``vpce.linear_grpo_loss`` as GRPOTrainer would call it: ``dapo``, ``beta=0.04``, per-sequence advantages,
    ``old_log_probs`` given; ``level="sequence"``: GSPO."""
    from .. import linear_grpo_loss
    cache = {}

    def fn(x, w, y):
        c = _post_training_inputs(env, x, w, y, cache)
        return linear_grpo_loss(_rows(x, c, True), w, c["y"], c["adv"], old_log_probs=c["old"], ref_log_probs=c["ref"],
                                beta=0.04, loss_type="dapo", importance_sampling_level=level, backend=device_backend(env),
                                memory_budget=memory_budget, **env.vpce_layout()).loss
    return fn


def _vpce_dpo(env: Env) -> LossFn:
    """``vpce.linear_dpo_loss`` (sigmoid, the reference's sequence log-probs given) on ``[2B, T]`` rows: the first
    half chosen, the second rejected."""
    from .. import linear_dpo_loss
    cache = {}

    def fn(x, w, y):
        c = _post_training_inputs(env, x, w, y, cache)
        rows = c["y"].shape[0]
        if rows % 2:
            raise Unavailable("DPO needs an even number of 2048-token rows")
        ref = c["ref"].sum(-1)
        return linear_dpo_loss(_rows(x, c, True), w, c["y"], ref[: rows // 2], ref[rows // 2:],
                               backend=device_backend(env), **env.vpce_layout()).loss
    return fn


def _vpce_log_prob_loss(env: Env) -> LossFn:
    """``vpce.linear_log_prob_loss`` with an entropy bonus: ``-A_b log p_i - 0.01 H_i`` over ``[B, T]`` rows, the
    mean over the non-ignored tokens (scope ``"token"``); the same loss as the ``liger-logprob-loss`` row. Under
    ``--sp`` the hidden states are a flat slice of the tokens, so the targets and advantages are passed flat."""
    from .. import linear_log_prob_loss
    cache = {}

    def fn(x, w, y):
        c = _post_training_inputs(env, x, w, y, cache)
        count = (c["y"] != -100).sum().clamp(min=1)
        adv = c["adv"][:, None].expand_as(c["old"])
        target = c["y"]
        if env.sequence_parallel:
            target, adv = target.reshape(-1), adv.reshape(-1)
        return linear_log_prob_loss(_rows(x, c), w, target, lambda lp, ent, a: (-a * lp - 0.01 * ent) / count,
                                    inputs={"a": adv}, use_entropy=True, backend=device_backend(env),
                                    **env.vpce_layout())
    return fn


def _vpce_verl(env: Env) -> LossFn:
    """verl's actor loss through ``vpce.integrations.verl.ppo_loss`` (``peers.verl_actor_config``: PPO,
    ``token-mean``, ``entropy_coeff=0.01``), fused, on ``[B, T]`` rows of 2048 tokens, per-sequence advantages, old
    log-probs near the current ones; the same loss as the ``liger-verl`` row."""
    from ..integrations import verl as vverl
    config = peers.verl_actor_config()
    cache = {}

    def fn(x, w, y):
        c = _post_training_inputs(env, x, w, y, cache)
        adv = c["adv"][:, None].expand_as(c["old"])
        return vverl.ppo_loss(config, _rows(x, c, True), w, c["y"], c["old"], adv, backend=device_backend(env),
                              group=env.group, vocab_start=env.vocab_start, vocab_size=env.vocab_size)[0]
    return fn


def _vpce_none_mean(env: Env) -> LossFn:
    """``reduction="none"``, then the caller's mean over the non-ignored tokens (SFT's masked mean: the plain loss,
    checked), primed (``_primed``)."""
    from .. import linear_cross_entropy
    backend = device_backend(env)

    def fn(x, w, y):
        per_token = linear_cross_entropy(x, w, y, backend=backend, reduction="none", **env.vpce_layout())
        keep = y != -100
        return (per_token * keep).sum() / keep.sum().clamp(min=1)
    return _primed(env, fn)


def _vpce_trl(env: Env) -> LossFn:
    """``vpce.integrations.trl``'s head called as TRL's trainers call theirs (the ``trl-sft`` row: the non-ignored
    tokens gathered, entropy and ``is_top1`` logged), primed (``_primed``)."""
    from ..integrations.trl import VpceLogProbHead
    head = VpceLogProbHead(backend=device_backend(env))

    def fn(x, w, y):
        keep = y != -100
        return -head.apply(x[keep], w, None, y[keep], 1.0, 32768, None, 1.0, ("entropy", "is_top1"))[0].mean()
    return _primed(env, fn)


def _vpce_metrics(env: Env) -> LossFn:
    """The mean loss with every metric asked for (accuracy, entropy, z-loss term): the loss is the plain one, so its
    errors are checked; the metrics are computed in the same pass and dropped."""
    from .. import linear_cross_entropy
    backend = device_backend(env)

    def fn(x, w, y):
        return linear_cross_entropy(x, w, y, backend=backend, return_token_accuracy=True, return_entropy=True,
                                    return_z_loss=True, **env.vpce_layout()).loss
    return fn


VARIANTS = {  # name: (label, options)
    "smooth": ("label_smoothing=0.1", dict(label_smoothing=0.1)),
    "zloss": ("z_loss=1e-4", dict(z_loss=1e-4)),
    "softcap": ("softcap=30", dict(softcap=30.0)),
    "weights": ("token_weight", dict(token_weight=True)),
    "all": ("smoothing+z-loss+softcap+weights", dict(label_smoothing=0.1, z_loss=1e-4, softcap=30.0,
                                                      token_weight=True)),
    "dft": ("token_scaling (DFT)", dict(token_scaling=True)),
}

def _vpce_distill(env: Env, *, divergence: str, beta: float | None, memory_budget: str = "auto"):
    """``vpce.linear_distillation_loss`` on the device's backend, the targets passed (none is ignored)."""
    from .. import linear_distillation_loss
    backend = device_backend(env)
    layout = env.vpce_layout()

    def fn(x, w, y, xt, wt):
        return linear_distillation_loss(x, w, xt, wt, y, divergence=divergence, beta=beta, backend=backend,
                                        memory_budget=memory_budget, **layout)
    return fn


#: The divergences of ``--distill``: key: (label, divergence, beta, liger-kernel's jsd_beta for it, a lean row).
DISTILL = {
    "fkl": ("forward KL", "forward_kl", None, 0.0, True),
    "jsd": ("JSD beta=0.5", "jsd", 0.5, 0.5, True),
    "rkl": ("reverse KL", "reverse_kl", None, 1.0, False),
}


def divergence_label(distill: tuple[str, float | None]) -> str:
    """``(divergence, beta)`` as the tables and the JSON name it: "forward KL", "JSD beta=0.5", "reverse KL"."""
    divergence, beta = distill
    return {"forward_kl": "forward KL", "reverse_kl": "reverse KL"}.get(divergence, f"JSD beta={beta}")


def _distill_rows() -> list[Method]:
    rows = []
    for key, (label, divergence, beta, jsd_beta, lean) in DISTILL.items():
        which = (divergence, beta)
        rows += [
            Method(name=f"torch-{key}", label=f"torch eager {label} (both logits)", package="torch", distill=which,
                   build=functools.partial(peers.torch_distill, divergence=divergence, beta=beta)),
            Method(name=f"liger-{key}", label=f"liger-kernel FusedLinearJSD {label} (jsd_beta={jsd_beta:g})",
                   package="liger-kernel", needs_cuda=True, distill=which, requires=("liger_kernel",),
                   build=functools.partial(peers.liger_jsd, jsd_beta=jsd_beta)),
            Method(name=f"vpce-{key}", label=f"vpce {{backend}} {label}", package="vpce", tp=True, distill=which,
                   build=functools.partial(_vpce_distill, divergence=divergence, beta=beta)),
        ]
        if lean:
            rows.append(Method(name=f"vpce-{key}-lean", label=f"vpce {{backend}} {label} lean", package="vpce",
                               tp=True, distill=which, build=functools.partial(
                                   _vpce_distill, divergence=divergence, beta=beta, memory_budget="lean")))
    return rows


def frozen(method: Method) -> Method:
    """``method`` with the lm_head frozen: the row ``<name>-frozen``, single-GPU, fwd+bwd only."""
    return dataclasses.replace(method, name=f"{method.name}-frozen", label=f"{method.label} frozen W", frozen=True,
                               no_grad=False, tp=False, tp_only=False, even_shards=False)


#: The rows that also have a frozen-lm_head variant (``<name>-frozen``).
FROZEN = ("torch", "compile", "quack", "quack-base", "trl-sft", "vpce-triton", "vpce-torch", "vpce-logprobs",
          "vpce-logprobs-top1", "vpce-trl-sft")

_ROWS = [
    Method(name="torch", label="torch eager", build=peers.torch_eager, package="torch", no_grad=True),
    Method(name="compile", label="torch.compile", build=peers.torch_compile, package="torch"),
    *[Method(name="torch-lce" if opts is None else f"torch-lce-{key}", label=f"torch F.linear_cross_entropy{label}",
             build=functools.partial(peers.torch_lce, options=opts), package="torch",
             check=peers.torch_lce_available)
      for key, (label, opts) in peers.TORCH_LCE.items()],
    Method(name="liger", label="liger-kernel FLCE", build=peers.liger, package="liger-kernel", needs_cuda=True,
           requires=("liger_kernel",)),
    Method(name="liger-cute", label="liger-kernel FLCE, CuTe DSL dispatch (impl='nvidia-cutedsl')",
           build=peers.liger_cute, package="liger-kernel", needs_cuda=True, requires=("liger_kernel", "cutlass")),
    Method(name="fla", label="fla-core FusedLinearCrossEntropyLoss", build=peers.fla, package="fla-core",
           needs_cuda=True, triton_interpret=True, tp=True, even_shards=True, requires=("fla",)),
    Method(name="cce", label="cut-cross-entropy", build=functools.partial(peers.cce, exact=False),
           package="cut-cross-entropy", needs_cuda=True, requires=("cut_cross_entropy",)),
    Method(name="cce-exact", label="cut-cross-entropy exact", build=functools.partial(peers.cce, exact=True),
           package="cut-cross-entropy", needs_cuda=True, requires=("cut_cross_entropy",)),
    Method(name="quack", label="quack chunked LCE (auto: scaled exp)",
           build=functools.partial(peers.quack, scaled_exp=True), package="quack-kernels", needs_cuda=True,
           requires=("quack",)),
    Method(name="quack-base", label="quack chunked LCE use_scaled_exp=False",
           build=functools.partial(peers.quack, scaled_exp=False), package="quack-kernels", needs_cuda=True,
           requires=("quack",)),
    Method(name="trl", label="TRL fused LM head (log_probs)", build=functools.partial(peers.trl, sft=False),
           package="trl", requires=("trl",)),
    Method(name="trl-sft", label="TRL fused LM head, entropy and is_top1 (SFT)",
           build=functools.partial(peers.trl, sft=True), package="trl", requires=("trl",)),
    Method(name="megatron", label="megatron vocab_parallel_ce", build=functools.partial(peers.megatron, fused=False),
           package="megatron-core", tp=True, even_shards=True, requires=("megatron",)),
    Method(name="megatron-fused", label="megatron fused_vp_ce", build=functools.partial(peers.megatron, fused=True),
           package="megatron-core", tp=True, even_shards=True, requires=("megatron",)),
    Method(name="liger-tp", label="liger-kernel TP scaled CE", build=peers.liger_tp, package="liger-kernel",
           needs_cuda=True, tp=True, tp_only=True, even_shards=True, requires=("liger_kernel",)),
    Method(name="chunked-tp", label="chunked vp CE (liger fallback idea, torch)", build=peers.chunked_tp, tp=True,
           tp_only=True, even_shards=True),
    Method(name="loss-parallel", label="torch loss_parallel", build=functools.partial(peers.loss_parallel, fp32=True),
           package="torch", tp=True, tp_only=True, even_shards=True),
    Method(name="loss-parallel-bf16", label="torch loss_parallel bf16 logits",
           build=functools.partial(peers.loss_parallel, fp32=False), package="torch", tp=True, tp_only=True,
           even_shards=True),
    Method(name="vpce-triton", label="vpce triton", build=functools.partial(_vpce, backend="triton"),
           package="vpce", needs_cuda=True, no_grad=True, tp=True),
    Method(name="vpce-triton-lean", label="vpce triton lean",
           build=functools.partial(_vpce, backend="triton", memory_budget="lean"), package="vpce",
           needs_cuda=True, tp=True),
    Method(name="vpce-triton-compact",
           label="vpce triton compact (memory_budget=1.0: 1 GiB P chunks freed in forward)",
           build=functools.partial(_vpce, backend="triton", memory_budget=1.0), package="vpce", needs_cuda=True,
           tp=True),
    Method(name="vpce-triton-main-grad", label="vpce triton, dW into fp32 main_grad (Megatron)",
           build=functools.partial(_vpce, backend="triton", accumulate_main_grad=True), package="vpce",
           needs_cuda=True, main_grad=True),
    Method(name="vpce-triton-lean-main-grad", label="vpce triton lean, dW into fp32 main_grad (Megatron)",
           build=functools.partial(_vpce, backend="triton", memory_budget="lean", accumulate_main_grad=True),
           package="vpce", needs_cuda=True, main_grad=True),
    Method(name="vpce-torch", label="vpce torch", build=functools.partial(_vpce, backend="torch"), package="vpce",
           no_grad=True, tp=True),
    *[Method(name=f"vpce-{key}", label=f"vpce {{backend}} {label}", build=functools.partial(_vpce_variant, **opts),
             package="vpce", plain=False) for key, (label, opts) in VARIANTS.items()],
    Method(name="vpce-logprobs", label="vpce {backend} linear_log_probs", package="vpce",
           build=functools.partial(_vpce_log_probs, entropy=False)),
    Method(name="vpce-logprobs-primed", label="vpce {backend} linear_log_probs, after a uniform call (SFT)",
           package="vpce", build=functools.partial(_vpce_log_probs, entropy=False, primed=True)),
    Method(name="vpce-none-mean", label="vpce {backend} reduction='none' then masked mean, after a uniform call",
           package="vpce", build=_vpce_none_mean),
    Method(name="vpce-logprobs-grpo", label="vpce {backend} linear_log_probs x per-token advantages (GRPO)",
           package="vpce", build=functools.partial(_vpce_log_probs, entropy=False, advantages=True), plain=False),
    Method(name="vpce-logprobs-entropy", label="vpce {backend} linear_log_probs + entropy", package="vpce",
           build=functools.partial(_vpce_log_probs, entropy=True), plain=False),
    Method(name="vpce-logprobs-top1",
           label="vpce {backend} linear_log_probs, entropy and is_top1 logged (TRL SFT), after a uniform call",
           package="vpce", build=functools.partial(_vpce_log_probs, entropy=True, top1=True, primed=True)),
    Method(name="vpce-trl-sft", label="vpce.integrations.trl head, entropy and is_top1 (TRL SFT), after a uniform call",
           package="vpce", build=_vpce_trl, requires=("trl",)),
    Method(name="vpce-grpo", label="vpce {backend} linear_grpo_loss (dapo, beta 0.04, old log-probs)",
           package="vpce", build=functools.partial(_vpce_grpo, level="token"), plain=False, tp=True),
    Method(name="vpce-grpo-compact", label="vpce {backend} linear_grpo_loss (dapo, beta 0.04), memory_budget=1.0",
           package="vpce", build=functools.partial(_vpce_grpo, level="token", memory_budget=1.0), plain=False,
           tp=True),
    Method(name="vpce-gspo", label="vpce {backend} linear_grpo_loss, sequence-level ratio (GSPO)", package="vpce",
           build=functools.partial(_vpce_grpo, level="sequence"), plain=False, tp=True),
    Method(name="vpce-dpo", label="vpce {backend} linear_dpo_loss (sigmoid)", package="vpce", build=_vpce_dpo,
           plain=False),
    Method(name="vpce-logprob-loss", label="vpce {backend} linear_log_prob_loss with an entropy bonus",
           package="vpce", build=_vpce_log_prob_loss, plain=False, tp=True),
    Method(name="liger-logprob-loss", label="liger-kernel scaled CE (NLL + entropy), the loss of vpce-logprob-loss",
           package="liger-kernel", build=peers.liger_logprob_loss, plain=False, tp=True, even_shards=True,
           requires=("liger_kernel",)),
    Method(name="vpce-verl", label="vpce.integrations.verl.ppo_loss (PPO, token-mean, entropy 0.01), fused",
           package="verl", build=_vpce_verl, plain=False, requires=("verl",)),
    Method(name="liger-verl", label="liger-kernel scaled CE (NLL + entropy), then verl's loss (PPO, entropy 0.01)",
           package="liger-kernel", build=peers.liger_verl, plain=False, requires=("liger_kernel", "verl")),
    Method(name="trl-grpo", label="TRL fused LM head + entropy, then TRL's GRPO loss (dapo, beta 0.04)",
           build=peers.trl_grpo, package="trl", plain=False, requires=("trl",)),
    Method(name="vpce-metrics", label="vpce {backend} + accuracy, entropy, z-loss metrics", package="vpce",
           build=_vpce_metrics, tp=True),
    *_distill_rows(),
]

METHODS: dict[str, Method] = {m.name: m for m in [*_ROWS, *(frozen(m) for m in _ROWS if m.name in FROZEN)]}


def method_names() -> list[str]:
    """Every name ``--methods`` accepts, in table order."""
    return [FLOOR, *METHODS]


def default_methods(tp: bool, distill: bool = False) -> list[str]:
    """What ``--methods all`` (the default) means: every single-GPU row, or under ``--tp`` every row with a
    vocab-parallel form; of the cross-entropy rows, or with ``distill`` of the distillation rows."""
    return [FLOOR, *(m.name for m in METHODS.values()
                     if (m.distill is not None) == distill and (m.tp if tp else not m.tp_only))]


#: ``--quick`` without ``--methods``: a smoke run of one row per peer and vpce's main routes, those that run here
#: (``runs_here``), in seconds on a CPU. ``--methods all`` still means every row.
QUICK = ("floor", "torch", "torch-lce", "liger", "liger-cute", "fla", "cce", "quack-base", "trl-sft",
         "megatron-fused", "vpce-triton", "vpce-triton-lean", "vpce-torch", "vpce-all", "vpce-logprobs-top1",
         "vpce-trl-sft", "vpce-metrics", "torch-frozen", "vpce-triton-frozen", "vpce-torch-frozen")


def runs_here(name: str, env: Env) -> bool:
    """Whether row ``name`` can run on ``env``: its modules are installed and its device is there."""
    if name == FLOOR:
        return True
    try:
        METHODS[name].require(env)
    except Unavailable:
        return False
    return True


def quick_methods(env: Env) -> tuple[list[str], list[str]]:
    """``--quick``'s rows on ``env``: (those of ``QUICK`` that run here, those left out)."""
    return [n for n in QUICK if runs_here(n, env)], [n for n in QUICK if not runs_here(n, env)]
