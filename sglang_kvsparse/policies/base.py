"""The contract every scoring policy meets: one importance score per key and KV head.

A policy only scores; which keys survive is decided by the shared selection (protected sink and
observation window, then the best scores up to the budget: `sglang_kvsparse.kernels.select_kept`),
and decode-time refresh adds attention probabilities to whatever the policy wrote. Keeping
policies this small lets them be swapped by name and tested against each other on the same inputs.

A policy is a frozen dataclass whose fields are its own knobs (SnapKV's pooling, for instance),
set in the configuration as `{"policy": {"name": ..., knob: value}}` and validated by the policy.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

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
    name: ClassVar[str]

    @abstractmethod
    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        """[total_kv, H_kv] float32 scores aligned with ``inputs.kv_indices``."""

    def options(self) -> dict[str, Any]:
        """The policy's knobs and their values (its dataclass fields)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> ScoringPolicy:
        """The policy with these knobs; ValueError("<knob>: <problem>") for a bad one."""
        known = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in known:
                raise ValueError(f"{key}: unknown knob of policy {cls.name!r} (knobs: {', '.join(known) or 'none'})")
        return cls(**options)

    def describe(self) -> str:
        """The name, and the knobs if it has any, for the start-up log."""
        knobs = ", ".join(f"{key} {value}" for key, value in self.options().items())
        return f"{self.name} ({knobs})" if knobs else self.name
