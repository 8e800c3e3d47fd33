"""SnapKV: keys the observation window attends to, pooled so that spans survive together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from sglang_kvsparse.kernels import pool_scores, window_scores
from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy


@dataclass(frozen=True)
class SnapKVPolicy(ScoringPolicy):
    """Sum of the last ``window`` queries' attention probabilities, max- or average-pooled.

    Pooling matters on retrieval: the question's attention lands on the first token of an answer
    span, and pooling keeps its neighbours, which the model needs to copy the rest of the span.
    """

    pool_kind: Literal["max", "avg"] = "max"
    pool_kernel: int = 15
    name = "snapkv"

    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        raw = window_scores(
            inputs.q,
            inputs.k_buf,
            inputs.lse,
            inputs.qo_indptr,
            inputs.kv_indptr,
            inputs.kv_indices,
            inputs.window,
            inputs.sm_scale,
        )
        return pool_scores(raw, inputs.kv_indptr, self.pool_kernel, self.pool_kind)
