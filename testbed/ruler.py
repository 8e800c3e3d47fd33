"""A harder retrieval suite, RULER-style: look-alike facts, long answers, chains to follow.

The passkey and needle suites (``kvsparse_testbed.retrieval``) ask for one short answer that
nothing in the text resembles, and every policy finds it from a budget of 256 on. These tasks
are built so a cache that keeps isolated tokens fails where it drops a span or keeps the wrong
one of several similar facts (all in Paul Graham essays, at seed-chosen depths):

- ``multikey``: four sentences "The special magic number for <word> is <7 digits>.", one asked;
- ``uuid``: three such sentences with UUIDs (about 25 tokens each), one asked;
- ``multivalue``: three numbers for one word among two other words' numbers; all three asked;
- ``vartrack``: "VAR ABCDE = 1234567." then four hops "VAR FGHIJ = VAR ABCDE." beside a
  distractor chain of its own value; every variable of the asked value wanted.

An answer counts when every expected string is in the output as a whole token
(`retrieval.is_correct`). Lengths are in the essays' characters per token, so token counts are
approximate; the runner records the real ones. Imports nothing heavy, like `retrieval`.
"""

from __future__ import annotations

import random
import re
import uuid as uuid_module
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvsparse_testbed.retrieval import NEEDLE_CHARS_PER_TOKEN, NEEDLE_WORDS, is_correct

TASKS: tuple[str, ...] = ("multikey", "uuid", "multivalue", "vartrack")
#: Approximate haystack lengths in tokens (the question and chat template add ~80).
DEFAULT_LENGTHS: tuple[int, ...] = (2_000, 3_500, 5_000, 8_000)
#: Prompts per (task, length): 4 tasks x 4 lengths x 3 = 48 prompts.
DEFAULT_PER_LENGTH = 3
#: Enough new tokens for the longest answer (three numbers, or five variable names, with words).
MAX_NEW_TOKENS = 48
#: Look-alike facts per prompt. With six numbers or four UUIDs the test bed's full cache (SmolLM2
#: 135M) answered 5 of 8 and 2 of 8, mostly giving another fact's value: too few solved prompts
#: to compare policies on.
MULTIKEY_FACTS, UUID_FACTS = 4, 3

_INTRO = "Read the following text carefully. Some special facts are hidden in it.\n\n"
_NUMBER = "The special magic number for {key} is {value}."
_UUID = "The special magic UUID for {key} is {value}."
_ONE_OF = "One of the special magic numbers for {key} is {value}."
_VAR = "VAR {name} = {value}."


@dataclass(frozen=True)
class RulerPrompt:
    """One question: the user message, every string the answer must hold, and its layout."""

    suite: str  # the task
    prompt_id: str
    user_message: str
    expected: tuple[str, ...]
    target_tokens: int
    fact_char_offsets: tuple[int, ...]

    @property
    def answer(self) -> str:
        return ", ".join(self.expected)

    def correct(self, output: str) -> bool:
        return all(is_correct(value, output) for value in self.expected)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "answer": self.answer}


def _sentence_starts(text: str) -> list[int]:
    return [0] + [m.end() for m in re.finditer(r"(?<=[.!?])\s+", text)]


def _hide(haystack: str, sentences: Sequence[str], rng: random.Random) -> tuple[str, tuple[int, ...]]:
    """Each of `sentences` at its own seed-chosen sentence boundary (in their order through the
    text, spread from 5% to 95% of it); the text and where each one starts."""
    starts = _sentence_starts(haystack)
    inside = [s for s in starts if 0.05 * len(haystack) <= s <= 0.95 * len(haystack)]
    picks = sorted(rng.sample(inside, len(sentences)))
    parts, offsets, previous, length = [], [], 0, 0
    for at, sentence in zip(picks, sentences):
        chunk = haystack[previous:at]
        parts.append(chunk)
        length += len(chunk)
        offsets.append(length)
        parts.append(sentence + " ")
        length += len(sentence) + 1
        previous = at
    parts.append(haystack[previous:])
    return "".join(parts), tuple(offsets)


def _digits(rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randint(1_000_000, 9_999_999))
        if value not in taken:
            taken.add(value)
            return value


def _name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name


def _multikey(rng: random.Random) -> tuple[list[str], str, tuple[str, ...]]:
    keys, taken = rng.sample(NEEDLE_WORDS, MULTIKEY_FACTS), set()
    facts = [(key, _digits(rng, taken)) for key in keys]
    asked = rng.choice(facts)
    sentences = [_NUMBER.format(key=k, value=v) for k, v in facts]
    return sentences, f"What is the special magic number for {asked[0]}?", (asked[1],)


def _uuid(rng: random.Random) -> tuple[list[str], str, tuple[str, ...]]:
    keys = rng.sample(NEEDLE_WORDS, UUID_FACTS)
    facts = [(key, str(uuid_module.UUID(int=rng.getrandbits(128), version=4))) for key in keys]
    asked = rng.choice(facts)
    sentences = [_UUID.format(key=k, value=v) for k, v in facts]
    return sentences, f"What is the special magic UUID for {asked[0]}?", (asked[1],)


def _multivalue(rng: random.Random) -> tuple[list[str], str, tuple[str, ...]]:
    asked, *others = rng.sample(NEEDLE_WORDS, 3)
    taken: set[str] = set()
    mine = [_digits(rng, taken) for _ in range(3)]
    facts = [(asked, v) for v in mine] + [(k, _digits(rng, taken)) for k in others]
    rng.shuffle(facts)
    sentences = [(_ONE_OF if k == asked else _NUMBER).format(key=k, value=v) for k, v in facts]
    return sentences, f"What are all the special magic numbers for {asked}?", tuple(mine)


def _vartrack(rng: random.Random) -> tuple[list[str], str, tuple[str, ...]]:
    taken: set[str] = set()
    values: set[str] = set()

    def chain() -> tuple[list[str], list[str]]:
        names = [_name(rng, taken) for _ in range(5)]
        lines = [_VAR.format(name=names[0], value=_digits(rng, values))]
        lines += [_VAR.format(name=b, value=f"VAR {a}") for a, b in zip(names, names[1:])]
        return names, lines

    names, asked_lines = chain()
    _, other_lines = chain()
    value = asked_lines[0].rsplit(" ", 1)[1].rstrip(".")
    # Hop by hop, the two chains' lines in a drawn order: each chain is assigned before it is used.
    order = sorted(((c, i) for c in (0, 1) for i in range(5)), key=lambda item: (item[1], rng.random()))
    sentences = [(asked_lines, other_lines)[c][i] for c, i in order]
    question = (
        f"Find all variables that are assigned the value {value} in the text above, "
        "directly or through another variable."
    )
    return sentences, question, tuple(names)


_BUILDERS = {"multikey": _multikey, "uuid": _uuid, "multivalue": _multivalue, "vartrack": _vartrack}


def ruler_prompts(
    essays: str,
    seed: int = 0,
    tasks: Sequence[str] = TASKS,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    per_length: int = DEFAULT_PER_LENGTH,
) -> list[RulerPrompt]:
    """`per_length` prompts per (task, length), each on its own seed-chosen stretch of `essays`.
    Their ids carry the seed (`ruler-s1-multikey-2000-0`), except seed 0's (`ruler-multikey-2000-0`),
    which keep the ids of the reports made before seeds could be combined."""
    unknown = [task for task in tasks if task not in _BUILDERS]
    if unknown:
        raise ValueError(f"unknown tasks {unknown}; known: {', '.join(TASKS)}")
    rng = random.Random(f"ruler-{seed}")
    id_prefix = "ruler-" if seed == 0 else f"ruler-s{seed}-"
    paragraph_starts = [0] + [m.end() for m in re.finditer(r"\n\s*\n", essays)]
    prompts = []
    for task in tasks:
        for length in lengths:
            chars = round(length * NEEDLE_CHARS_PER_TOKEN)
            starts = [s for s in paragraph_starts if s + chars <= len(essays)]
            if not starts:
                raise ValueError(f"the essays ({len(essays)} chars) are shorter than {chars} chars")
            for index in range(per_length):
                start = rng.choice(starts)
                haystack = essays[start : start + chars]
                haystack = haystack[: max(haystack.rfind("."), 0) + 1]
                sentences, question, expected = _BUILDERS[task](rng)
                body, offsets = _hide(haystack, sentences, rng)
                prompts.append(
                    RulerPrompt(
                        suite=task,
                        prompt_id=f"{id_prefix}{task}-{length}-{index}",
                        user_message=f"{_INTRO}{body}\n\n{question}",
                        expected=expected,
                        target_tokens=length,
                        fact_char_offsets=tuple(len(_INTRO) + offset for offset in offsets),
                    )
                )
    return prompts


def ruler_suite(
    essays: str,
    seeds: Sequence[int] = (0,),
    tasks: Sequence[str] = TASKS,
    lengths: Sequence[int] = DEFAULT_LENGTHS,
    per_length: int = DEFAULT_PER_LENGTH,
) -> list[RulerPrompt]:
    """`ruler_prompts` of every seed in turn: a suite grows by a seed without changing the prompts
    earlier reports measured (one seed's prompts depend on its `per_length`, `tasks` and `lengths`)."""
    if len(set(seeds)) != len(seeds) or not seeds:
        raise ValueError(f"seeds must be distinct and at least one, got {list(seeds)}")
    return [prompt for seed in seeds for prompt in ruler_prompts(essays, seed, tasks, lengths, per_length)]


def task_of(prompt_id: str) -> str:
    """The task of a prompt by its id (`ruler-multikey-2000-0`, `ruler-s1-uuid-3000-7`)."""
    found = re.fullmatch(r"ruler-(?:s\d+-)?([a-z]+)-\d+-\d+", prompt_id)
    if found is None:
        raise ValueError(f"not a ruler prompt id: {prompt_id!r}")
    return found.group(1)


def min_essay_chars(lengths: Sequence[int] = DEFAULT_LENGTHS) -> int:
    """How much essay text `ruler_prompts` needs: several times the longest haystack, for variety."""
    return 4 * round(max(lengths) * NEEDLE_CHARS_PER_TOKEN)
