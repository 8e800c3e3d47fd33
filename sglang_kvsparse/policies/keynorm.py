"""Key norm: keys with a small L2 norm tend to draw attention (Devoto et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.kernels import minus_key_norm
from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy


@dataclass(frozen=True)
class KeyNormPolicy(ScoringPolicy):
    """Score = minus the key's L2 norm per KV head; needs no queries at all.

    A decoded key is scored the same way and attention never changes a score, so a row always
    keeps its smallest keys (beside the protected sink and window), prompt and decoded alike.
    """

    name = "keynorm"
    score_update = "none"
    first_score = "minus_key_norm"

    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        return minus_key_norm(inputs.k_buf[inputs.kv_indices.long()]) * inputs.k_scale
