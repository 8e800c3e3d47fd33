"""SnapKV: keys the observation window attends to, pooled so that spans survive together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from sglang_kvsparse.kernels import pool_scores
from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy

#: Pooling applied to per-key scores before top-k selection.
POOL_KINDS: tuple[str, ...] = ("max", "avg")

#: The upper bounds of the knobs, for the server's configuration and a request's own policy
#: alike: the pooling and spreading widths cost a few operations per doubling of their width, and
#: every knob is a tensor index or comparison somewhere, where an unbounded integer overflows. Far
#: above any value measured to help.
WIDEST_POOL = 127


def require_count(knob: str, value: object, minimum: int = 0, maximum: int = 1 << 20) -> None:
    """ValueError("<knob>: ...") unless `value` is an integer in [`minimum`, `maximum`] (not a
    bool)."""
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= maximum:
        raise ValueError(f"{knob}: expected an integer from {minimum} to {maximum}, got {value!r}")


def require_share(knob: str, value: object) -> None:
    """ValueError("<knob>: ...") unless `value` is a number in [0, 1] (not a bool)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 <= value <= 1:
        raise ValueError(f"{knob}: expected a number in [0, 1], got {value!r}")


@dataclass(frozen=True)
class SnapKVPolicy(ScoringPolicy):
    """Sum of the last ``window`` queries' attention probabilities, max- or average-pooled over
    ``pool_kernel`` keys (odd; 1 = no pooling).

    Pooling matters on retrieval: the question's attention lands on the first token of an answer
    span, and pooling keeps its neighbours, which the model needs to copy the rest of the span
    (`docs/experiments/2026-12-04-default-knobs.md` says why 15). While decoding, each step's
    attention is added to the kept keys' scores (H2O-style), in the same units as the window's.
    """

    pool_kind: Literal["max", "avg"] = "max"
    pool_kernel: int = 15
    name = "snapkv"

    def __post_init__(self) -> None:
        if self.pool_kind not in POOL_KINDS:
            raise ValueError(f"pool_kind: unknown pool kind {self.pool_kind!r} (known: {', '.join(POOL_KINDS)})")
        require_count("pool_kernel", self.pool_kernel, 1, WIDEST_POOL)
        if self.pool_kernel % 2 == 0:
            raise ValueError(f"pool_kernel: must be odd, got {self.pool_kernel}")

    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        raw = inputs.attention_from_last(inputs.window)
        return pool_scores(raw, inputs.keys, self.pool_kernel, self.pool_kind)
