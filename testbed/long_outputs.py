"""The frozen long-output suite: prompts whose answers run to thousands of tokens.

Why: every accuracy figure before it was retrieval from a long prompt with a short answer, where
decode-time eviction hardly runs. Here the output is long (1,024 or 4,096 tokens, EOS ignored) and
faithfulness is checked against the prompt while the cache evicts: copying a passage, writing out
a record for each line of a list given in the prompt, counting, and continuing an essay. Four tasks,
new seeds (no knob was chosen on them), frozen by the hash of every prompt (`LONG_OUTPUT_SUITE`).

Metrics against the full cache's greedy output of the same prompt, and a task score where one is
checkable. Plain Python (no torch, no SGLang).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvsparse_testbed.texts import essay_text

TASKS: tuple[str, ...] = ("copy", "records", "count", "continue")
#: Characters of essay text per output token a copied passage gets: its copy fills about 85% of
#: the output (SmolLM2 writes about 4.2 characters a token of essay text).
_COPY_CHARS_PER_TOKEN = 3.6
#: The essay passage a continuation starts from, in characters (about 1,000 tokens).
_CONTINUE_CHARS = 4_200
#: Output tokens one written-out record takes ("12. Name Surname lives in City and has 482 points.").
_TOKENS_PER_RECORD = 19
#: Output tokens one counted number takes (its digits and a newline).
_TOKENS_PER_NUMBER = 4

_FIRST = (
    "Alice",
    "Bruno",
    "Chen",
    "Dara",
    "Emil",
    "Fatima",
    "Goran",
    "Hana",
    "Ivan",
    "Julia",
    "Kofi",
    "Lena",
    "Marco",
    "Nadia",
    "Omar",
    "Priya",
    "Quinn",
    "Rosa",
    "Sven",
    "Tara",
    "Umar",
    "Vera",
    "Wei",
    "Yusuf",
)
_LAST = (
    "Brown",
    "Costa",
    "Dubois",
    "Eriksen",
    "Fischer",
    "Garcia",
    "Haddad",
    "Ito",
    "Jensen",
    "Kowalski",
    "Larsen",
    "Moreau",
    "Novak",
    "Okafor",
    "Petrov",
    "Rossi",
    "Silva",
    "Tanaka",
    "Weber",
    "Young",
)
_CITIES = (
    "Paris",
    "Lima",
    "Oslo",
    "Cairo",
    "Delhi",
    "Quito",
    "Rome",
    "Seoul",
    "Tunis",
    "Vienna",
    "Accra",
    "Berlin",
    "Dakar",
    "Hanoi",
    "Kyoto",
    "Lagos",
    "Milan",
    "Porto",
    "Sofia",
    "Zagreb",
)


@dataclass(frozen=True)
class LongOutputPrompt:
    """One user message asking for about `output_len` tokens, and what its task score checks."""

    prompt_id: str
    task: str
    output_len: int
    user_message: str
    #: copy: the passage's sentences; records: "name|city|points" per record; count: the last
    #: number; continue: nothing (no checkable answer).
    reference: tuple[str, ...]

    def score(self, output: str) -> float | None:
        """The task score of an output in [0, 1]; None where the task has none (`continue`)."""
        if self.task == "copy":
            text = _squash(output)
            return sum(sentence in text for sentence in self.reference) / len(self.reference)
        if self.task == "records":
            lines = output.splitlines()
            found = 0
            for record in self.reference:
                fields = record.split("|")
                found += any(all(f in line for f in fields) for line in lines)
            return found / len(self.reference)
        if self.task == "count":
            last = int(self.reference[0])
            counted = 0
            for line in output.splitlines():
                number = re.match(r"\s*(\d+)", line)
                if number is None or int(number.group(1)) != counted + 1:
                    break
                counted += 1
            return min(counted, last) / last
        return None


def _squash(text: str) -> str:
    return " ".join(text.split())


def _sentences(text: str) -> tuple[str, ...]:
    """The passage's sentences of at least 20 characters, whitespace squashed."""
    return tuple(s for s in (_squash(p) for p in re.split(r"(?<=[.!?])\s+", text)) if len(s) >= 20)


def _passage(essays: str, chars: int, rng: random.Random) -> str:
    """About `chars` characters of essay text starting at a paragraph, whole sentences."""
    starts = [m.end() for m in re.finditer(r"\n\n", essays) if m.end() + chars < len(essays)]
    start = rng.choice(starts)
    cut = essays[start : start + chars]
    return cut[: max(cut.rfind(". "), cut.rfind(".\n")) + 1].strip()


def _copy(essays: str, output_len: int, rng: random.Random) -> tuple[str, tuple[str, ...]]:
    passage = _passage(essays, int(output_len * _COPY_CHARS_PER_TOKEN), rng)
    message = f"Copy the following text exactly, word for word, from its first word to its last.\n\n{passage}"
    return message, _sentences(passage)


def _records(output_len: int, rng: random.Random) -> tuple[str, tuple[str, ...]]:
    count = output_len // _TOKENS_PER_RECORD
    lines, reference, names = [], [], set()
    while len(lines) < count:
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        if name in names:
            continue
        names.add(name)
        city, points = rng.choice(_CITIES), str(rng.randint(100, 999))
        lines.append(f"{len(lines) + 1}. {name} - {city} - {points}")
        reference.append(f"{name}|{city}|{points}")
    message = (
        f"Here are {count} people, each with a city and a score:\n\n" + "\n".join(lines) + "\n\nFor every person, in "
        'the order given, write one line: "<number>. <name> lives in <city> and has <score> points." '
        f"Write all {count} lines."
    )
    return message, tuple(reference)


def _count(output_len: int) -> tuple[str, tuple[str, ...]]:
    last = output_len // _TOKENS_PER_NUMBER
    return f"Count from 1 to {last}, writing each number on its own line and nothing else.", (str(last),)


def _continue(essays: str, rng: random.Random) -> tuple[str, tuple[str, ...]]:
    passage = _passage(essays, _CONTINUE_CHARS, rng)
    return f"Continue the following essay in the same style, for as long as you can.\n\n{passage}", ()


def long_output_prompts(
    seeds: Sequence[int], output_lens: Sequence[int], tasks: Sequence[str] = TASKS
) -> list[LongOutputPrompt]:
    """One prompt per seed, task and output length (ids `long-s<seed>-<task>-<len>`)."""
    essays = essay_text(int(max(output_lens) * _COPY_CHARS_PER_TOKEN) * 40)
    prompts = []
    for output_len in output_lens:
        for task in tasks:
            for seed in seeds:
                rng = random.Random(f"{seed}-{task}-{output_len}")
                if task == "copy":
                    message, reference = _copy(essays, output_len, rng)
                elif task == "records":
                    message, reference = _records(output_len, rng)
                elif task == "count":
                    message, reference = _count(output_len)
                elif task == "continue":
                    message, reference = _continue(essays, rng)
                else:
                    raise ValueError(f"unknown task {task!r} (tasks: {', '.join(TASKS)})")
                prompts.append(
                    LongOutputPrompt(f"long-s{seed}-{task}-{output_len}", task, output_len, message, reference)
                )
    return prompts


def prompts_hash(prompts: Sequence[LongOutputPrompt]) -> str:
    """sha256 of the prompts' ids, messages and references, in order."""
    canonical = [[p.prompt_id, p.user_message, list(p.reference)] for p in prompts]
    return hashlib.sha256(json.dumps(canonical, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class LongOutputSuite:
    """The `long_output_prompts` arguments of a suite, and the hash its prompts must have."""

    name: str
    seeds: tuple[int, ...]
    output_lens: tuple[int, ...]
    sha256: str

    def prompts(self, output_lens: Sequence[int] | None = None) -> list[LongOutputPrompt]:
        """The suite's prompts (of these output lengths; all by default); ValueError if the suite's
        prompts are not the frozen ones."""
        prompts = long_output_prompts(self.seeds, self.output_lens)
        found = prompts_hash(prompts)
        if found != self.sha256:
            raise ValueError(f"suite {self.name}: its prompts hash to {found}, not the frozen {self.sha256}")
        wanted = self.output_lens if output_lens is None else tuple(output_lens)
        return [p for p in prompts if p.output_len in wanted]


#: Seeds 21-23: no knob or default was chosen on them.
LONG_OUTPUT_SUITE = LongOutputSuite(
    name="long-2026-12-06",
    seeds=(21, 22, 23),
    output_lens=(1024, 4096),
    sha256="47617e041d80fb544a288a4b570761adb952d27631b9816985c90f5eaecf007d",
)


# --- metrics against the full cache's greedy output (token ids) ---


def first_divergence(output: Sequence[int], reference: Sequence[int]) -> int:
    """The position of the first output token that differs from the reference's (the shorter
    one's length when one is a prefix of the other)."""
    for i, (a, b) in enumerate(zip(output, reference)):
        if a != b:
            return i
    return min(len(output), len(reference))


def agreement(output: Sequence[int], reference: Sequence[int]) -> float:
    """The share of the reference's positions where the output has the same token."""
    if not reference:
        return 1.0
    return sum(a == b for a, b in zip(output, reference)) / len(reference)


#: The n of the repeated n-grams a loop is counted by.
LOOP_NGRAM = 16


def repeated_share(tokens: Sequence[int], n: int = LOOP_NGRAM) -> float:
    """The share of the n-grams of `tokens` that already occurred earlier in them."""
    seen: set[tuple[int, ...]] = set()
    repeated = total = 0
    for i in range(len(tokens) - n + 1):
        gram = tuple(tokens[i : i + n])
        repeated += gram in seen
        total += 1
        seen.add(gram)
    return repeated / total if total else 0.0


#: An output loops when its repeated n-grams exceed the full cache's by this share of the output.
LOOP_EXCESS = 0.2


def loop_excess(output: Sequence[int], reference: Sequence[int]) -> float:
    """How much more of the output repeats itself than the full cache's output does (0 when no
    more): repetition the full cache does not have."""
    return max(0.0, repeated_share(output) - repeated_share(reference))
