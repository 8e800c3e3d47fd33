"""The contract every scoring policy meets: one importance score per key and KV head.

A policy only scores; which keys survive is decided by the shared selection (protected sink and
observation window, then the best scores up to the budget: `sglang_kvsparse.kernels.select_kept`),
and decode-time refresh adds attention probabilities to whatever the policy wrote. Keeping
policies this small lets them be swapped by name and tested against each other on the same inputs.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PrefillScoringInputs:
    """One sparse layer's view of a prefill batch, in the kernels' ragged layout.

    The new tokens' K/V are already in ``k_buf``; ``lse`` holds each new query row's softmax
    log-sum-exp from `extend_attention_with_stats`, so attention probabilities can be recomputed
    for a few queries without a second full softmax.
    """

    q: torch.Tensor  # [num_q_tokens, H_q, D]
    k_buf: torch.Tensor  # [num_slots, H_kv, D]
    lse: torch.Tensor  # [num_q_tokens, H_q] float32
    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # [total_kv] slot ids, request-major, in sequence order
    sm_scale: float
    window: int  # observation window alpha


class ScoringPolicy(ABC):
    """Scores keys at prefill; higher means more worth keeping."""

    #: Name used in the configuration (`policy`), unique across policies.
    name: str

    @abstractmethod
    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        """[total_kv, H_kv] float32 scores aligned with ``inputs.kv_indices``."""
