"""Random eviction: the baseline that any scoring must beat on long outputs.

A study of decode-time eviction on reasoning-length outputs found random per-head eviction (the
prompt kept) about as good as scored eviction; a policy's scores only earn their cost where they
beat chance. This one keeps the sinks and the recent window and chooses the rest at random, the
prompt's keys included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.kernels import position_hash
from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy


@dataclass(frozen=True)
class RandomPolicy(ScoringPolicy):
    """Score = a pseudo-random number per key position and KV head, fixed for the key's life:
    the selection keeps the sinks and the window and a uniform random choice of the rest, each
    KV head its own; attention never changes a score, so every eviction drops random entries."""

    name = "random"
    score_update = "none"
    first_score = "position_hash"

    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        return position_hash(inputs.keys.positions, inputs.k_buf.shape[1])
