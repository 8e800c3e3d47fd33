"""SnapKV: keys the observation window attends to, pooled so that spans survive together."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from sglang_kvsparse.kernels import pool_scores
from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy

#: Pooling applied to per-key scores before top-k selection.
POOL_KINDS: tuple[str, ...] = ("max", "avg")


@dataclass(frozen=True)
class SnapKVPolicy(ScoringPolicy):
    """Sum of the last ``window`` queries' attention probabilities, max- or average-pooled over
    ``pool_kernel`` keys (odd; 1 = no pooling).

    Pooling matters on retrieval: the question's attention lands on the first token of an answer
    span, and pooling keeps its neighbours, which the model needs to copy the rest of the span
    (docs/config.md says why 15). While decoding, each step's attention is added to the kept
    keys' scores (H2O-style), in the same units as the window's.
    """

    pool_kind: Literal["max", "avg"] = "max"
    pool_kernel: int = 15
    name = "snapkv"

    def __post_init__(self) -> None:
        if self.pool_kind not in POOL_KINDS:
            raise ValueError(f"pool_kind: unknown pool kind {self.pool_kind!r} (known: {', '.join(POOL_KINDS)})")
        kernel = self.pool_kernel
        if not isinstance(kernel, int) or isinstance(kernel, bool) or kernel < 1:
            raise ValueError(f"pool_kernel: expected an odd integer >= 1, got {kernel!r}")
        if kernel % 2 == 0:
            raise ValueError(f"pool_kernel: must be odd, got {kernel}")

    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        raw = inputs.attention_from_last(inputs.window)
        return pool_scores(raw, inputs.kv_indptr, self.pool_kernel, self.pool_kind)
