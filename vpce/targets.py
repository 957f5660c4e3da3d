"""Per-token bookkeeping: ignored tokens, out-of-range ids, per-token loss weights, per-class loss weights, and each
target's local column."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .parallel import VocabShard, sum_over_ranks

__all__ = ["TokenTargets", "ClassWeights"]


class ClassWeights(NamedTuple):
    """Per-class loss weights (``class_weight``, sharded like the weight rows) as the formulas need them."""

    columns: torch.Tensor
    """This shard's weights of its valid rows ``[V_r]`` (padding rows cut off)."""
    target: torch.Tensor
    """``[N]``: each token's target class weight ``w_t`` over the global vocab (0 where ignored or out of range)."""
    total: torch.Tensor
    """0-d: ``sum_c w_c`` over the real global vocab (the label-smoothing term's weight of ``lse``)."""

    @staticmethod
    def of(class_weight: torch.Tensor, tg: "TokenTargets", shard: VocabShard) -> "ClassWeights":
        """From this shard's ``class_weight [V_local]``: the target weights and the total summed over the group in
        one all-gather (the same on every rank; each token's weight comes from the one rank that holds it)."""
        cols = class_weight[: shard.valid_rows]
        mine = torch.where(tg.in_shard, cols[tg.idx], 0) if shard.valid_rows else \
            torch.zeros(tg.idx.shape, dtype=cols.dtype, device=cols.device)
        summed = sum_over_ranks(torch.cat([mine.reshape(-1), cols.sum().reshape(1)]), shard)
        return ClassWeights(cols, summed[:-1], summed[-1])


class TokenTargets:
    """Where each token's target sits relative to this rank's shard; shared by both backends.

    ``weight`` (optional, float ``[N]``) multiplies each token's loss and gradient; ``mean`` divides by the sum of
    the weights of non-ignored tokens (by their count without weights). ``class_weight`` (optional: this shard's
    ``[V_local]`` weights, exchanged here under a group, or the ``ClassWeights`` of an earlier pass) weights the
    loss as ``torch.nn.functional.cross_entropy(weight=...)`` does (``vpce.formulas.softmax``); ``mean`` then divides by
    the sum of the target classes' weights (times the token weights).
    """

    def __init__(self, target: torch.Tensor, shard: VocabShard, ignore_index: int,
                 weight: torch.Tensor | None = None, class_weight: torch.Tensor | ClassWeights | None = None):
        self.keep = target != ignore_index
        self.bad = self.keep & ((target < 0) | (target >= shard.vocab_size))
        local = target - shard.start
        self._valid = shard.valid_rows
        self.in_shard = self.keep & (local >= 0) & (local < shard.valid_rows)
        self.idx = torch.where(self.in_shard, local, 0)
        self.weight = weight
        if isinstance(class_weight, torch.Tensor):
            class_weight = ClassWeights.of(class_weight, self, shard)
        self.class_weight = class_weight
        counted = weight
        if class_weight is not None:
            counted = class_weight.target if weight is None else weight * class_weight.target
        self.count = self.keep.sum() if counted is None else torch.where(self.keep, counted, 0).sum()
        self.scaling = None
        """A detached per-token factor of the loss and its gradient but not of ``mean``'s denominator (DFT's
        ``token_scaling``: ``p_t``), filled by a backend's ``cross_entropy`` as the statistics become known."""
        self._local = local
        self.metrics: dict[str, torch.Tensor] = {}
        """Per-token metrics a backend's ``cross_entropy`` computed in the same pass (``LossOptions.metrics``)."""


    def local_columns(self) -> torch.Tensor:
        """int32 column of each token's target in this shard's rows, -1 where it is not here (another shard,
        ignored, or out of range): what the Triton kernels take."""
        return torch.where(self.in_shard, self.idx, -1).to(torch.int32)
    def class_rows(self, sl: slice) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(w_t of rows sl, sum_c w_c)`` for ``vpce.formulas.softmax``, or None without class weights."""
        cw = self.class_weight
        return None if cw is None else (cw.target[sl], cw.total)

    @property
    def before(self) -> torch.Tensor:
        """Per token, how many of this shard's (valid) columns have a global id below the target's: the columns a
        tie with the target must lose to for the target to be the argmax (``torch.argmax``: the lowest id wins)."""
        return self._local.clamp(0, self._valid)

    def denominator(self, dtype: torch.dtype) -> torch.Tensor:
        """What ``mean`` divides by: the (weighted) count of non-ignored tokens, 1 where that is 0."""
        c = self.count.to(dtype)
        return torch.where(c == 0, torch.ones_like(c), c)

    def row_scale(self, per_token: torch.Tensor) -> torch.Tensor:
        """Upstream gradient per token times its weight: 0 on ignored tokens, NaN on out-of-range targets."""
        if self.weight is not None:
            per_token = per_token * self.weight
        s = torch.where(self.keep, per_token, 0)
        return torch.where(self.bad, math.nan, s)

    def token_loss(self, loss: torch.Tensor, sl: slice) -> torch.Tensor:
        """Per-token loss of rows ``sl``: weighted, 0 on ignored tokens, NaN on out-of-range targets."""
        loss = torch.where(self.bad[sl], math.nan, loss)
        if self.weight is not None:
            loss = loss * self.weight[sl]
        return torch.where(self.keep[sl], loss, 0)

    def metric(self, value: torch.Tensor, sl: slice) -> torch.Tensor:
        """A per-token metric of rows ``sl``: 0 on ignored tokens, NaN on out-of-range targets, never weighted."""
        return torch.where(self.keep[sl], torch.where(self.bad[sl], math.nan, value), 0)

    def reduce_metric(self, tok: torch.Tensor, reduction: str) -> torch.Tensor:
        """A metric reduced like the loss but unweighted: ``mean`` over non-ignored tokens (0 when there are none)."""
        if reduction == "mean":
            return tok.sum() / self.keep.sum().clamp(min=1).to(tok.dtype)
        return tok.sum() if reduction == "sum" else tok

    def reduce(self, loss_tok: torch.Tensor, reduction: str) -> torch.Tensor:
        if reduction == "mean":
            return loss_tok.sum() / self.denominator(loss_tok.dtype)
        return loss_tok.sum() if reduction == "sum" else loss_tok
