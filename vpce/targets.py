"""Per-token target bookkeeping: ignored tokens, out-of-range ids, and the local column of each target."""

from __future__ import annotations

import math

import torch

from .parallel import VocabShard

__all__ = ["TokenTargets"]


class TokenTargets:
    """Where each token's target sits relative to this rank's shard; shared by both backends."""

    def __init__(self, target: torch.Tensor, shard: VocabShard, ignore_index: int):
        self.keep = target != ignore_index
        self.bad = self.keep & ((target < 0) | (target >= shard.vocab_size))
        local = target - shard.start
        self.in_shard = self.keep & (local >= 0) & (local < shard.valid_rows)
        self.idx = torch.where(self.in_shard, local, 0)
        self.count = self.keep.sum()

    def row_scale(self, per_token: torch.Tensor) -> torch.Tensor:
        """Upstream gradient per token: 0 on ignored tokens, NaN on out-of-range targets."""
        s = torch.where(self.keep, per_token, 0)
        return torch.where(self.bad, math.nan, s)
