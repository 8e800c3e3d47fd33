"""The contract every scoring policy meets: one importance score per key and KV head.

A policy only scores; which keys survive is decided by the shared selection (protected sink and
observation window, then the best scores up to the budget: `sglang_kvsparse.kernels.select_kept`).
It scores in its own units and keeps them while decoding: at prefill `score`; a decoded token's
key starts with the score `first_score` names; on every decode step the attention kernel updates
the kept keys' scores as `score_update` says (add this step's attention, replace by it, or leave
them); before a decode eviction ranks a row, `eviction_scores`. So a prompt's keys and the
decoded ones compete in the same units. The two decode-time rules are kinds the kernels
implement, not code, so that one launch (and one captured graph) serves a batch whose requests
have different policies; a policy whose decoded keys need another rule needs a kernel kind.
Keeping policies this small lets them be swapped by name and tested against each other on the
same inputs.

A policy is a frozen dataclass whose fields are its own knobs (SnapKV's pooling, for instance),
set in the configuration as `{"policy": {"name": ..., knob: value}}` and validated by the policy.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from sglang_kvsparse.kernels import FIRST_SCORES, SCORE_UPDATES, FirstScore, ScoreUpdate, window_scores
from sglang_kvsparse.kernels.common import Segments


@dataclass(frozen=True)
class PrefillScoringInputs:
    """One sparse layer's view of a prefill batch, in the kernels' ragged layout.

    The new tokens' K/V are already in ``k_buf``; ``lse`` holds each new query row's softmax
    log-sum-exp from `extend_attention_with_stats`, so attention probabilities can be recomputed
    for a few queries without a second full softmax. ``keys`` bounds the requests' keys (each
    key's request and position computed once per forward, `Segments`). ``sentences`` numbers each
    key's sentence (`sglang_kvsparse.policies.sentences.sentence_numbers`); None where the server
    has no token ids (no tokenizer), and policies then score without sentences.
    """

    q: torch.Tensor  # [num_q_tokens, H_q, D]
    k_buf: torch.Tensor  # [num_slots, H_kv, D]
    lse: torch.Tensor  # [num_q_tokens, H_q] float32
    qo_indptr: torch.Tensor  # int32 [B+1]
    keys: Segments  # the requests' keys, [B+1] bounds, aligned with kv_indices
    kv_indices: torch.Tensor  # [total_kv] slot ids, request-major, in sequence order
    sm_scale: float
    window: int  # observation window alpha
    sink: int  # the first keys every selection keeps (attention sinks)
    sentences: torch.Tensor | None = None  # [total_kv] int64, aligned with kv_indices
    k_scale: float = 1.0  # an FP8 `k_buf`'s scale: a stored key times it is the real one

    def attention_from_last(self, queries: int) -> torch.Tensor:
        """[total_kv, H_kv] float32: each key's attention from its request's last `queries` new
        queries (all of them when fewer), summed over them and over its KV head's query heads
        (`window_scores`, one pass)."""
        return window_scores(
            self.q,
            self.k_buf,
            self.lse,
            self.qo_indptr,
            self.keys.indptr,
            self.kv_indices,
            queries,
            self.sm_scale,
            k_scale=self.k_scale,
            max_kv_len=self.keys.max_len,
        )


class ScoringPolicy(ABC):
    """Scores keys at prefill; higher means more worth keeping."""

    #: Name used in the configuration (`policy`), unique across policies.
    name: ClassVar[str]

    #: What each decode step does with a kept key's attention probability (summed over the
    #: query heads of its KV head): "add" it to the score, "replace" the score by it, or "none".
    score_update: ClassVar[ScoreUpdate] = "add"

    #: The score a decoded token's key starts with, before its step's attention updates it
    #: (`kernels.first_scores`): "zero" (its own attention then gives it its first score), minus
    #: its norm, its position, or a hash of its position.
    first_score: ClassVar[FirstScore] = "zero"

    @abstractmethod
    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        """[total_kv, H_kv] float32 scores aligned with ``inputs.kv_indices``."""

    def decodes_like(self, other: ScoringPolicy) -> bool:
        """Whether a decode step treats this policy's keys as `other`'s: the same score update and
        the same first score. Then the step needs no per-request rules for them (their evictions
        rank by each policy's own `eviction_scores`, and those run before the step)."""
        return self.score_update == other.score_update and self.first_score == other.first_score

    def decode_rule(self) -> tuple[int, int]:
        """(`score_update`, `first_score`) as the kernels' indices (`SCORE_UPDATES`, `FIRST_SCORES`):
        a row of a decode plan's `row_kinds`."""
        return SCORE_UPDATES.index(self.score_update), FIRST_SCORES.index(self.first_score)

    def eviction_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """What a decode eviction ranks, from the stored scores [R, n, H_kv] of R requests' n
        entries each (a request's entries in one layer, in position order; an evicting request's
        entries are all there). Default: the scores as stored."""
        return scores

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
