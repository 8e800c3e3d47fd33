"""Random eviction: the baseline that any scoring must beat on long outputs.

A study of decode-time eviction on reasoning-length outputs found random per-head eviction (the
prompt kept) about as good as scored eviction; a policy's scores only earn their cost where they
beat chance. This one keeps the sinks and the recent window and chooses the rest at random, the
prompt's keys included.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.kernels.common import positions_in_segment
from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy

_MASK = 0xFFFFFFFF
#: An integer hash's multiplier (below 2**31, so every product fits in int64).
_MIX = 0x045D9F3B


def position_hash(positions: torch.Tensor, heads: int) -> torch.Tensor:
    """[N, heads] float32 in [0, 1): a fixed pseudo-random number per sequence position and KV
    head. A hash, not a generator: the same key gets the same score in every run, batch and
    replayed graph, and a decoded key's score needs no state."""
    head = torch.arange(heads, device=positions.device, dtype=torch.int64)
    x = (positions.to(torch.int64)[:, None] * heads + head[None, :] + 1) & _MASK
    for _ in range(2):
        x = (((x >> 16) ^ x) * _MIX) & _MASK
    x = (x >> 16) ^ x
    return x.to(torch.float32) / float(1 << 32)


@dataclass(frozen=True)
class RandomPolicy(ScoringPolicy):
    """Score = a pseudo-random number per key position and KV head, fixed for the key's life:
    the selection keeps the sinks and the window and a uniform random choice of the rest, each
    KV head its own; attention never changes a score, so every eviction drops random entries."""

    name = "random"
    score_update = "none"

    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        positions = positions_in_segment(inputs.kv_indptr, inputs.kv_indices.numel())
        return position_hash(positions, inputs.k_buf.shape[1])

    def new_key_scores(self, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return position_hash(positions, k.shape[1])
