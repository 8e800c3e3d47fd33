"""Language-model fidelity on real text: does decoding over a sparse cache still predict what the
full cache predicts?

Passages of Paul Graham essays are cut into a context (prefilled, so the sparse layers compress
it) and a continuation that is *teacher-forced*: fed token by token through the server's decode
path, where the sparse layers attend over their kept entries and evict as they grow. Each step
records the log-probability of the forced token and the model's own top token
(`kvsparse_testbed.teacher_forcing`). Two references are forced:

- the essay's real next tokens: perplexity and top-1 accuracy of real text;
- the full cache's own greedy continuation: next-token agreement with the full cache (1 for the
  full cache itself, by construction).

Why not the prompt's logprobs: a prefill attends over every key of the prompt in every layer, and
sparse layers compress only after it, so prompt logprobs are the full cache's whatever the budget.

Plain Python (no torch, no SGLang), so any environment can build the same passages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvsparse_testbed.texts import essay_text

#: Context lengths in tokens, passages per length, and the forced continuation's length.
DEFAULT_CONTEXT_LENS: tuple[int, ...] = (2_000, 4_000)
DEFAULT_PASSAGES_PER_LEN = 3
DEFAULT_CONTINUATION_LEN = 128
#: Characters of essays fetched per token needed (SmolLM2 averages ~4.2; the rest is margin).
_CHARS_PER_TOKEN = 5


@dataclass(frozen=True)
class Passage:
    """A context to prefill and the real text that follows it."""

    passage_id: str
    context_ids: tuple[int, ...]
    continuation_ids: tuple[int, ...]


def essay_passages(
    token_ids: Sequence[int],
    context_lens: Sequence[int] = DEFAULT_CONTEXT_LENS,
    per_len: int = DEFAULT_PASSAGES_PER_LEN,
    continuation_len: int = DEFAULT_CONTINUATION_LEN,
) -> list[Passage]:
    """`per_len` passages per context length, cut from disjoint spans of `token_ids`.

    Passages are laid end to end, so no two share text and none is a prefix of another.
    Raises ValueError when the tokens are too few.
    """
    if per_len < 1 or continuation_len < 1 or not context_lens or min(context_lens) < 1:
        raise ValueError("need per_len >= 1, continuation_len >= 1 and positive context lengths")
    need = per_len * sum(n + continuation_len for n in context_lens)
    if need > len(token_ids):
        raise ValueError(f"{len(token_ids)} tokens are fewer than the {need} the passages need")
    passages = []
    start = 0
    for length in context_lens:
        for index in range(per_len):
            context = tuple(token_ids[start : start + length])
            continuation = tuple(token_ids[start + length : start + length + continuation_len])
            passages.append(Passage(f"essay-{length}-{index}", context, continuation))
            start += length + continuation_len
    return passages


def tokenized_essay_passages(
    tokenizer: Any,
    context_lens: Sequence[int] = DEFAULT_CONTEXT_LENS,
    per_len: int = DEFAULT_PASSAGES_PER_LEN,
    continuation_len: int = DEFAULT_CONTINUATION_LEN,
) -> list[Passage]:
    """`essay_passages` of the Paul Graham essays, tokenised by `tokenizer` (a Hugging Face
    tokenizer of the served model: the server and kvpress see the same ids)."""
    need = per_len * sum(n + continuation_len for n in context_lens)
    ids = tokenizer(essay_text(need * _CHARS_PER_TOKEN), add_special_tokens=False)["input_ids"]
    return essay_passages(ids, context_lens, per_len, continuation_len)


@dataclass(frozen=True)
class ForcedScore:
    """Totals of teacher-forced steps: summed negative log-likelihood and top-1 matches."""

    tokens: int
    nll: float
    top1_matches: int

    @classmethod
    def of(cls, records: Sequence[Sequence[float]], forced_ids: Sequence[int]) -> ForcedScore:
        """From the per-step records [logprob of the forced token, model's top id]."""
        if len(records) != len(forced_ids):
            raise ValueError(f"{len(records)} records for {len(forced_ids)} forced tokens")
        nll = -sum(float(logprob) for logprob, _ in records)
        matches = sum(int(top) == int(token) for (_, top), token in zip(records, forced_ids))
        return cls(len(records), nll, matches)

    @classmethod
    def from_json(cls, record: dict[str, float]) -> ForcedScore:
        """Back from `to_json` (the derived rates are recomputed)."""
        return cls(int(record["tokens"]), float(record["nll"]), int(record["top1_matches"]))

    def to_json(self) -> dict[str, float]:
        return {
            "tokens": self.tokens,
            "nll": self.nll,
            "top1_matches": self.top1_matches,
            "perplexity": self.perplexity,
            "top1_rate": self.top1_rate,
        }

    def __add__(self, other: ForcedScore) -> ForcedScore:
        return ForcedScore(self.tokens + other.tokens, self.nll + other.nll, self.top1_matches + other.top1_matches)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll / self.tokens) if self.tokens else math.nan

    @property
    def top1_rate(self) -> float:
        return self.top1_matches / self.tokens if self.tokens else math.nan


def total(scores: Sequence[ForcedScore]) -> ForcedScore:
    """Token-weighted sum of several passages' scores."""
    result = ForcedScore(0, 0.0, 0)
    for score in scores:
        result = result + score
    return result
