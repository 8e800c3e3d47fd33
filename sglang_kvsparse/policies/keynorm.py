"""Key norm: keys with a small L2 norm tend to draw attention (Devoto et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy


@dataclass(frozen=True)
class KeyNormPolicy(ScoringPolicy):
    """Score = minus the key's L2 norm per KV head; needs no queries at all."""

    name = "keynorm"

    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        keys = inputs.k_buf[inputs.kv_indices.long()].float()  # [total_kv, H_kv, D]
        return -torch.linalg.vector_norm(keys, dim=-1)
