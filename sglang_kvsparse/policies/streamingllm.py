"""StreamingLLM: attention sinks plus the most recent tokens, ignoring content."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy


@dataclass(frozen=True)
class StreamingLLMPolicy(ScoringPolicy):
    """Score = position in the sequence: the selection then keeps the sinks and the latest tokens.

    A decoded key is scored by its position too and attention never changes a score, so every
    eviction drops the oldest unprotected entries. The baseline every attention-based policy must
    beat; it needs no attention statistics.
    """

    name = "streamingllm"
    score_update = "none"
    first_score = "position"

    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        position = inputs.keys.positions.to(torch.float32)
        return position[:, None].expand(-1, inputs.k_buf.shape[1]).contiguous()
