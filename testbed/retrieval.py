"""Retrieval prompts and their scorer: does a sparse KV cache still hold what the answer needs?

Two suites, built deterministically from a seed, so that the project's server and the external
reference (NVIDIA kvpress, ``bench/fidelity_kvpress.py``) are asked exactly the same questions:

- ``passkey``: repetitive filler ("The grass is green. The sky is blue. ...") with one sentence
  "The pass key is NNNNN. Remember it." at a chosen depth. The filler carries no information, so
  the only thing a cache must keep is the key itself.
- ``needle``: real text (Paul Graham essays, passed in by the caller: see
  ``kvsparse_testbed.texts.essay_text``) with one needle sentence naming a word that the essays never
  use, at a chosen depth. Harder for eviction: the filler looks like content.

This module only builds the user message and the expected answer; the runner applies the model's
chat template and records the real token count. Lengths are set in characters from a measured
characters-per-token ratio of the default model's tokenizer, so token counts are approximate.
It imports nothing heavy (no torch, no SGLang), so any environment can build the same prompts.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

#: Approximate prompt lengths in tokens (the haystack; the question and chat template add ~60).
DEFAULT_LENGTHS: tuple[int, ...] = (2_100, 3_300, 4_500, 5_700)
#: Where the needle goes, as the fraction of haystack characters before it.
DEFAULT_DEPTHS: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)

#: Characters per token of SmolLM2's tokenizer, measured on each suite's filler (3.75 and 4.19).
PASSKEY_CHARS_PER_TOKEN = 3.75
NEEDLE_CHARS_PER_TOKEN = 4.2

_PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
_PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it.\n\n"
)
_PASSKEY_QUESTION = "\n\nWhat is the pass key?"

_NEEDLE_INTRO = "Read the following essays carefully.\n\n"
_NEEDLE_SENTENCE = "The secret ingredient in the soup is {word}."
_NEEDLE_QUESTION = "\n\nWhat is the secret ingredient in the soup? Answer with one word from the text above."
#: Needle answers: single common words that the essay corpus never contains (a test checks).
NEEDLE_WORDS: tuple[str, ...] = (
    "saffron", "turquoise", "walnut", "cinnamon", "lavender", "kangaroo",
    "avocado", "origami", "pelican", "paprika", "flamingo", "harmonica",
    "marmalade", "trombone", "okapi", "pistachio", "nutmeg", "iguana", "accordion", "zucchini",
)  # fmt: skip


@dataclass(frozen=True)
class RetrievalPrompt:
    """One question: the user message to send, the answer that must come back, and its layout."""

    suite: str
    prompt_id: str
    user_message: str
    answer: str
    depth: float
    target_tokens: int
    needle_char_offset: int
    haystack_chars: int

    def correct(self, output: str) -> bool:
        return is_correct(self.answer, output)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _sentence_start_at_or_after(text: str, position: int) -> int:
    """The first sentence start at or after `position`, so the needle never splits a sentence."""
    if position <= 0:
        return 0
    match = re.compile(r"(?<=[.!?])\s+").search(text, position - 1)
    return match.end() if match else len(text)


def _insert(haystack: str, depth: float, sentence: str) -> tuple[str, int]:
    """Put `sentence` at the sentence boundary nearest past ``depth * len(haystack)``."""
    at = _sentence_start_at_or_after(haystack, round(depth * len(haystack)))
    before, after = haystack[:at].rstrip(), haystack[at:].lstrip()
    joined = f"{before} {sentence} {after}" if before else f"{sentence} {after}"
    return joined, (len(before) + 1 if before else 0)


def _hidden_prompt(
    suite: str,
    intro: str,
    haystack: str,
    question: str,
    sentence: str,
    answer: str,
    depth: float,
    length: int,
) -> RetrievalPrompt:
    """`sentence` hidden at `depth` of `haystack`, between the suite's intro and its question."""
    body, offset = _insert(haystack, depth, sentence)
    return RetrievalPrompt(
        suite=suite,
        prompt_id=f"{suite}-{length}-d{round(depth * 100):02d}",
        user_message=intro + body + question,
        answer=answer,
        depth=depth,
        target_tokens=length,
        needle_char_offset=len(intro) + offset,
        haystack_chars=len(body),
    )


def passkey_prompts(
    seed: int = 0,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
) -> list[RetrievalPrompt]:
    """One passkey prompt per (length, depth), each with its own 5-digit key drawn from `seed`."""
    rng = random.Random(f"passkey-{seed}")
    prompts = []
    for length in lengths:
        chars = round(length * PASSKEY_CHARS_PER_TOKEN)
        haystack = (_PASSKEY_FILLER * (chars // len(_PASSKEY_FILLER) + 1))[:chars]
        haystack = haystack[: haystack.rfind(".") + 1]
        for depth in depths:
            key = str(rng.randint(10_000, 99_999))
            prompts.append(
                _hidden_prompt(
                    "passkey",
                    _PASSKEY_INTRO,
                    haystack,
                    _PASSKEY_QUESTION,
                    f"The pass key is {key}. Remember it.",
                    key,
                    depth,
                    length,
                )
            )
    return prompts


def needle_prompts(
    essays: str,
    seed: int = 0,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    depths: Sequence[float] = DEFAULT_DEPTHS,
) -> list[RetrievalPrompt]:
    """One needle-in-essays prompt per (length, depth).

    Each prompt reads its haystack from a seed-chosen paragraph of `essays` (so prompts do not all
    share one opening) and hides a different word from `NEEDLE_WORDS`.
    """
    rng = random.Random(f"needle-{seed}")
    paragraph_starts = [0] + [m.end() for m in re.finditer(r"\n\s*\n", essays)]
    prompts = []
    index = 0
    for length in lengths:
        chars = round(length * NEEDLE_CHARS_PER_TOKEN)
        starts = [s for s in paragraph_starts if s + chars <= len(essays)]
        if not starts:
            raise ValueError(f"the essays ({len(essays)} chars) are shorter than {chars} chars")
        for depth in depths:
            start = rng.choice(starts)
            haystack = essays[start : start + chars]
            haystack = haystack[: max(haystack.rfind("."), 0) + 1]
            word = NEEDLE_WORDS[index % len(NEEDLE_WORDS)]
            index += 1
            prompts.append(
                _hidden_prompt(
                    "needle",
                    _NEEDLE_INTRO,
                    haystack,
                    _NEEDLE_QUESTION,
                    _NEEDLE_SENTENCE.format(word=word),
                    word,
                    depth,
                    length,
                )
            )
    return prompts


def min_essay_chars(lengths: Sequence[int] = DEFAULT_LENGTHS) -> int:
    """How much essay text `needle_prompts` needs: several times the longest haystack, for variety."""
    return 4 * round(max(lengths) * NEEDLE_CHARS_PER_TOKEN)


def is_correct(expected: str, output: str) -> bool:
    """True iff `expected` appears in `output` as a whole token (case-insensitive).

    The answer must not be the tail of a longer word or number, nor the head of a longer number:
    "12345" does not count inside "912345" or "123456". A trailing letter is allowed, because
    "walnuts" still names the ingredient.
    """
    pattern = rf"(?<![0-9A-Za-z]){re.escape(expected)}(?![0-9])"
    return re.search(pattern, output, flags=re.IGNORECASE) is not None
