"""Span: the observation window's attention, and a request's best peaks keep the keys that
follow them, so many-token answers survive."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.kernels import peaks, spread_scores
from sglang_kvsparse.kernels.common import Segments
from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy
from sglang_kvsparse.policies.sentences import raise_to_sentence_best
from sglang_kvsparse.policies.snapkv import require_count, require_share

#: Upper bound of `long_follow` (as `snapkv.WIDEST_POOL`): a follow costs a few operations per
#: doubling of its length.
LONGEST_FOLLOW = 256
#: Places followed per request and KV head: the best one (two answered fewer on the frozen suite,
#: `bench/results/ablation-final-2026-12-04.md`).
LONG_PEAKS = 1


@dataclass(frozen=True)
class SpanPolicy(ScoringPolicy):
    """The observation window's attention (SnapKV's scores without its pooling); the best peak of a
    request's text (per KV head: the best of the keys scoring highest within `long_follow` keys
    either side, past the sink and at least `long_follow` keys before the observation window, whose
    own text draws local attention) raises the `long_follow` keys after it to its score: a
    question's attention lands on the first token of an answer (a UUID, a number) and the tokens
    after it come along. Decode adds each step's attention (H2O-style). Last, where the server knows
    the prompt's tokens, each key is raised to `sentence` times the best score of its sentence
    (`sglang_kvsparse.policies.sentences`; sentences longer than `SENTENCE_KEYS` keys are cut), so that a
    fact is kept with the words that say what it is.

    Defaults: `long_follow` 40 covers a UUID (in SmolLM2's tokenizer, digit by digit) where a long
    follow everywhere crowds other answers out; `sentence` 0.5 keeps a fact with its sentence. They
    were chosen on the RULER-style prompts of seeds 0-2, in SmolLM2's token counts
    (`docs/experiments/2026-12-04-default-knobs.md`); what each earns on prompts it was not chosen
    on: `docs/config.md`.
    """

    long_follow: int = 40
    sentence: float = 0.5
    name = "span"

    def __post_init__(self) -> None:
        require_count("long_follow", self.long_follow, 0, LONGEST_FOLLOW)
        require_share("sentence", self.sentence)

    def score(self, inputs: PrefillScoringInputs) -> torch.Tensor:
        attention = inputs.attention_from_last(inputs.window)
        spread = self.spread(attention, inputs.keys, inputs.sink, inputs.window)
        return self.by_sentence(spread, inputs.sentences)

    def by_sentence(self, scores: torch.Tensor, sentences: torch.Tensor | None) -> torch.Tensor:
        """`scores` [total_kv, H_kv], each key raised to `sentence` times its sentence's best
        (`sentences`: each key's sentence number); unchanged when `sentence` is 0 or the sentences
        are unknown (None)."""
        if not self.sentence or sentences is None:
            return scores
        return raise_to_sentence_best(scores, sentences, self.sentence)

    def spread(self, attention: torch.Tensor, keys: Segments, sink: int, window: int) -> torch.Tensor:
        """`span`'s scores from the window's attention [total_kv, H_kv] (requests bounded by
        `keys`; `sink` and `window` as the selection protects them)."""
        if not self.long_follow:
            return attention
        best = peaks(attention, keys, LONG_PEAKS, self.long_follow, sink, window + self.long_follow)
        # Attention mass is >= 0, so 0 leaves every other key to its own score.
        longer = spread_scores(torch.where(best, attention, 0.0), keys, self.long_follow)
        return torch.maximum(attention, longer)
