"""TOVA: keep what the latest query attends to (Oren et al., 2024)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy


@dataclass(frozen=True)
class TOVAPolicy(ScoringPolicy):
    """Score = the attention of the sequence's latest query, summed over the query heads of each
    KV head: at prefill the prompt's last token's, while decoding each step's (it replaces the
    score, nothing accumulates). History counts only through what is still kept.
    """

    name = "tova"
    score_update = "replace"

    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        return inputs.attention_from_last(1)
