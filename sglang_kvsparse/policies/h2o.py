"""H2O: heavy hitters, the keys that have drawn the most attention from every query so far."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy

#: A window longer than any prompt: every query of the forward scores.
EVERY_QUERY = 1 << 30


@dataclass(frozen=True)
class H2OPolicy(ScoringPolicy):
    """Score = the attention a key received, summed over every query that sees it (Zhang et al.,
    2023); each decode step adds its own.

    Costs a second pass over the prompt's attention (the window-score kernel over all queries,
    not the last `window`), and favours early keys, which more queries see. Under chunked prefill
    the queries are those of the prompt's last chunk (earlier chunks keep nothing).
    """

    name = "h2o"

    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        return inputs.attention_from_last(EVERY_QUERY)
