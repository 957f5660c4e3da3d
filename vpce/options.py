"""The options every backend receives, validated once at the public boundary (``vpce.api``, ``vpce.distill``,
``vpce.post_training``: the ``validate()`` of each entry's arguments object returns one of these), and ``Folded``:
the logit transform the kernels apply, with the logit scale and the temperature folded in, derived in one place
(``Folded.of``) for every loss.

An options object keeps what the caller asked for (``softcap``, ``logit_scale``, ``temperature``), which the group
agrees on and ``torch.library`` passes as scalars; its ``folded`` field is what the backends and the kernels read.
"""

from __future__ import annotations

from dataclasses import dataclass, field

REDUCTIONS = ("mean", "sum", "none")
BACKENDS = ("auto", "torch", "triton")
BUDGET_NAMES = ("auto", "fast", "lean")
#: Metrics ``linear_cross_entropy`` can return, in the order of ``CrossEntropyOutput``'s fields after the loss.
METRICS = ("z_loss", "token_accuracy", "entropy")

#: Live chunk data the torch backend allows itself by default (GiB): logits, probabilities and their casts.
DEFAULT_CHUNK_GIB = 0.25


@dataclass(frozen=True, kw_only=True)
class Folded:
    """The logits every kernel computes from the raw ``x = h @ W.T + b``: ``z = inv_t * softcap * tanh(x / softcap)``
    (no ``tanh`` where ``softcap`` is None). The gradient with respect to ``x`` carries the same ``inv_t``, and the
    cap's derivative ``1 - (z / (softcap * inv_t))**2``."""

    softcap: float | None = None
    """The soft cap applied to the raw logits, or None."""
    inv_t: float = 1.0
    """The multiplier after the cap: the logit scale over the temperature."""

    @classmethod
    def of(cls, softcap: float | None, logit_scale: float = 1.0, temperature: float = 1.0) -> Folded:
        """The fold, for every loss: with ``s = logit_scale`` and ``c = softcap``,
        ``c * tanh(s x / c) / T = (s / T) * (c / s) * tanh(x / (c / s))``, so the kernels apply the cap ``c / s``
        to the raw logits and multiply by ``s / T`` after it."""
        s = logit_scale
        return cls(softcap=None if softcap is None else softcap / s, inv_t=s / temperature)

    def untempered(self) -> Folded:
        """The soft cap alone (``inv_t`` 1): the distillation's student logits of its cross-entropy term."""
        return Folded(softcap=self.softcap)


@dataclass(frozen=True, kw_only=True)
class LossOptions:
    """What the cross-entropy computes per token (the formulas: ``vpce.formulas.softmax``)."""

    ignore_index: int = -100
    """Target id whose token contributes nothing (loss 0, gradient 0, not counted by ``mean``)."""
    reduction: str = "mean"
    """``"mean"`` over non-ignored tokens, ``"sum"``, or ``"none"`` (shape of target, ignored tokens 0)."""
    label_smoothing: float = 0.0
    """torch's definition: ``(1 - eps) * CE + eps * mean_j(-log p_j)`` over the real global vocab."""
    z_loss: float = 0.0
    """Adds ``z_loss * lse**2`` per token."""
    softcap: float | None = None
    """Logits become ``softcap * tanh(logits / softcap)`` before everything else."""
    memory_budget: str | float = "auto"
    """``"fast"`` (gradients formed in forward, fp32 dW accumulator), ``"lean"`` (statistics in forward,
    logits recomputed in backward), ``"auto"`` (the fastest route whose buffers fit in free device memory: one
    chunk, fast, compact, lean; ``vpce.routing.settle_by_memory``), or a number: GiB of live chunk data on the
    compact fast route (each chunk freed in forward)."""

    logit_scale: float = 1.0
    """Multiplies the logits (after the bias, before the soft cap): ``z = softcap * tanh(logit_scale * x /
    softcap)`` (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``)."""
    token_scaling: bool = False
    """Multiply each token's loss (and its gradient) by the detached probability of its target (DFT; TRL's
    ``loss_type="dft"``, Liger's ``use_token_scaling``); ``mean`` still divides by the (weighted) token count."""
    metrics: tuple[str, ...] = ()
    """Detached per-token metrics computed in the same pass, among ``METRICS``, reduced like the loss."""
    folded: Folded = field(init=False)
    """``softcap`` and ``logit_scale`` as the kernels apply them (``Folded.of``)."""

    def __post_init__(self):
        object.__setattr__(self, "folded", Folded.of(self.softcap, self.logit_scale))

    @property
    def lean(self) -> bool:
        return self.memory_budget == "lean"

    def chunk_gib(self) -> float:
        """GiB of live chunk data for the torch backend."""
        return self.memory_budget if isinstance(self.memory_budget, float) else DEFAULT_CHUNK_GIB


@dataclass(frozen=True, kw_only=True)
class LogProbOptions:
    """What ``linear_log_probs`` computes per token."""

    ignore_index: int = -100
    """Target id whose token gives 0 for every output."""
    softcap: float | None = None
    """Logits become ``softcap * tanh(logits / softcap)`` before the temperature."""
    logit_scale: float = 1.0
    """Multiplies the logits before the soft cap."""
    temperature: float = 1.0
    """The distribution is ``softmax(softcap(logit_scale * logits) / temperature)``."""
    entropy: bool = False
    """Also return the entropy of that distribution."""
    top1: bool = False
    """Also return whether the target is the argmax (ties to the lowest global id, as ``torch.argmax``)."""
    mean_logits: bool = False
    """Also return the mean of the (capped, tempered) logits over the real vocab (no gradient)."""
    log_sum_sq: bool = False
    """Also return ``log sum_j p_j^2`` (no gradient)."""
    memory_budget: str | float = "auto"
    """``"lean"``: never the speculative route (``vpce.speculation``); ``"auto"``: it where its buffers fit;
    ``"fast"``: it without weighing memory; a number: it, with a ``P`` chunk of that many GiB."""
    folded: Folded = field(init=False)
    """``softcap``, ``logit_scale`` and ``temperature`` as the kernels apply them (``Folded.of``)."""

    def __post_init__(self):
        object.__setattr__(self, "folded", Folded.of(self.softcap, self.logit_scale, self.temperature))

    def chunk_options(self) -> LossOptions:
        """The options the Triton backend's ``P`` chunk is sized from."""
        return LossOptions(memory_budget=self.memory_budget)


DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")


@dataclass(frozen=True, kw_only=True)
class DistillOptions:
    """What ``linear_distillation_loss`` computes per token, validated at the public boundary."""

    kind: str = "forward_kl"
    """The divergence computed: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"`` (a JSD with beta 0 or 1 is the
    matching KL)."""
    beta: float = 0.5
    """The teacher's weight in the JSD's mixture ``m = beta q + (1 - beta) p`` (``kind="jsd"`` only)."""
    temperature: float = 1.0
    """The temperature of both heads' divergence."""
    kd_scale: float = 1.0
    """The divergence's weight in the loss: ``(1 - ce_weight) * (T**2 if temperature_squared else 1)``."""
    ce_weight: float = 0.0
    """The hard-label cross-entropy's weight (on the untempered student logits)."""
    ignore_index: int = -100
    """Tokens whose target equals it count for nothing (-1 when no target was given: none is ignored)."""
    reduction: str = "mean"
    softcap: float | None = None
    """The student's soft cap, before the temperature."""
    teacher_softcap: float | None = None
    """The teacher's soft cap, before the temperature."""
    memory_budget: str | float = "auto"
    """``"auto"``/``"fast"``, ``"lean"``, or GiB of live chunk data."""
    student: Folded = field(init=False)
    """The student's ``softcap`` and ``temperature`` as the kernels apply them (``Folded.of``); its cross-entropy
    term takes the capped logits before ``inv_t``."""
    teacher: Folded = field(init=False)
    """The teacher's ``teacher_softcap`` and ``temperature``, likewise; the same ``inv_t`` as the student's."""

    def __post_init__(self):
        object.__setattr__(self, "student", Folded.of(self.softcap, temperature=self.temperature))
        object.__setattr__(self, "teacher", Folded.of(self.teacher_softcap, temperature=self.temperature))

    @property
    def extra(self) -> bool:
        """Whether the divergence's gradient needs a per-token statistic besides the two ``lse``'s."""
        return self.kind != "forward_kl"

    def chunk_gib(self) -> float:
        return self.memory_budget if isinstance(self.memory_budget, float) else DEFAULT_CHUNK_GIB


#: Scopes of ``linear_log_prob_loss``'s ``loss_fn``.
SCOPES = ("token", "sequence", "batch")


@dataclass(frozen=True, kw_only=True)
class LogProbLossOptions:
    """What ``linear_log_prob_loss`` computes (validated at the public boundary, ``vpce.post_training``)."""

    loss_fn: object
    """``loss_fn(log_probs, entropy, **inputs) -> Tensor``; the loss is the sum of its elements."""
    scope: str = "token"
    """``"token"``, ``"sequence"`` or ``"batch"`` (``SCOPES``)."""
    entropy: bool = False
    """Whether ``loss_fn`` gets the entropy (else None)."""
    entropy_stats: bool = False
    """Whether the entropy is computed (for ``loss_fn``, or only as an output: a metric)."""
    row: int = 1
    """Tokens per row (``target.shape[-1]``); ``loss_fn`` sees ``[rows, row]`` in scope ``"sequence"``."""
    ignore_index: int = -100
    softcap: float | None = None
    logit_scale: float = 1.0
    temperature: float = 1.0
    """As ``LogProbOptions``'."""
    memory_budget: str | float = "auto"
    top1: bool = False
    """Whether ``is_top1`` is computed as an output (a metric; ``linear_log_probs``' definition)."""
    mean_logits: bool = False
    """Whether the mean logit is computed as an output (a metric; ``linear_log_probs``' definition)."""
    folded: Folded = field(init=False)
    """``softcap``, ``logit_scale`` and ``temperature`` as the kernels apply them (``Folded.of``)."""

    def __post_init__(self):
        object.__setattr__(self, "folded", Folded.of(self.softcap, self.logit_scale, self.temperature))

    def chunk_options(self) -> LossOptions:
        """The options the fast route's ``P`` chunk is sized from (the cross-entropy's)."""
        return LossOptions(memory_budget=self.memory_budget)

    def finish_options(self) -> LossOptions:
        """The cross-entropy options whose fast-route finish (``routing.finish_fast``) is this loss's:
        ``reduction="sum"`` (``loss_fn`` normalises its own sum: there is no ``mean`` to fold into ``P``) and the
        same ``memory_budget`` (the logits are the plan's, ``Plan.folded``)."""
        return LossOptions(memory_budget=self.memory_budget, reduction="sum")

    def stats_beyond_lse(self) -> bool:
        """Whether the loss needs statistics that the logits GEMM's epilogue does not take (it takes the log-sum-exp
        and the target logit): the entropy for ``loss_fn``, the argmax test, the mean logit; an entropy that is only
        an output comes from the gradient pass instead (under a group each rank's share, summed over the ranks)."""
        return self.entropy or self.top1 or self.mean_logits

    def stats_options(self) -> LogProbOptions:
        """The options of the statistics pass (``log_probs``) of the two-pass form."""
        return LogProbOptions(ignore_index=self.ignore_index, softcap=self.softcap, logit_scale=self.logit_scale,
                              temperature=self.temperature, entropy=self.entropy_stats, top1=self.top1,
                              mean_logits=self.mean_logits, memory_budget=self.memory_budget)
