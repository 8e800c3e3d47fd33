"""The frozen long-output suite: prompts whose answers run to thousands of tokens.

Why: every accuracy figure before it was retrieval from a long prompt with a short answer, where
decode-time eviction hardly runs. Here the output is long (1,024, 4,096 or 8,000 tokens, EOS
ignored) and faithfulness is checked against the prompt while the cache evicts: copying a passage
given in the prompt, writing out a sentence for each record of a list given in it, counting, and
continuing an essay. Each prompt is plain text that starts the pattern (the passage's first
sentences written again, the first records written out, the first numbers): asked as instructions
through the chat template, the default model copied nothing and counted to 30 even with the full
cache. Four tasks, new seeds (no knob was chosen on them), frozen by the hash of every prompt
(`LONG_OUTPUT_SUITE`).

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
from typing import Any

from kvsparse_testbed.texts import essay_text

TASKS: tuple[str, ...] = ("copy", "records", "count", "continue")
#: Characters of essay text per output token a copied passage gets: its copy fills about 85% of
#: the output (SmolLM2 writes about 4.2 characters a token of essay text).
_COPY_CHARS_PER_TOKEN = 3.6
#: The essay passage a continuation starts from, in characters (about 1,000 tokens).
_CONTINUE_CHARS = 4_200
#: Output tokens one written-out record takes ("12. Name Surname lives in City and has 482 points.").
_TOKENS_PER_RECORD = 19

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
    """A text to continue for `output_len` tokens, and what its task score checks."""

    prompt_id: str
    task: str
    output_len: int
    #: Plain text the model continues (no chat template: a small model follows a started pattern
    #: far longer than an instruction).
    text: str
    #: copy: the passage's sentences still to write; records: "name|city|points" of the records
    #: still to write; count: the first number to write;
    #: continue: nothing. Scores: copy, the sentences written verbatim; records, the city and
    #: points right on the first line naming each record; count, the output's lines that hold
    #: the number one above the line before (a slip costs one line, not the rest).
    reference: tuple[str, ...]

    def score(self, output: str) -> float | None:
        """The task score of an output in [0, 1]; None where the task has none (`continue`)."""
        if self.task == "copy":
            text = _squash(output)
            return sum(sentence in text for sentence in self.reference) / len(self.reference)
        if self.task == "records":
            lines = output.splitlines()
            right = 0.0
            for record in self.reference:
                name, *fields = record.split("|")
                line = next((line for line in lines if name in line), "")
                right += sum(bool(re.search(rf"\b{re.escape(f)}\b", line)) for f in fields) / len(fields)
            return right / len(self.reference)
        if self.task == "count":
            lines = [line.strip() for line in output.splitlines() if line.strip()]
            if not lines:
                return 0.0
            before = [int(self.reference[0]) - 1, *(int(n) if n.isdigit() else None for n in lines)]
            return sum(b is not None and b + 1 == int(n) for b, n in zip(before, lines) if n.isdigit()) / len(lines)
        return None


def _squash(text: str) -> str:
    return " ".join(text.split())


def _sentences(text: str) -> list[str]:
    """The passage's sentences of at least 20 characters, whitespace squashed."""
    return [s for s in (_squash(p) for p in re.split(r"(?<=[.!?])\s+", text)) if len(s) >= 20]


def _passage(essays: str, chars: int, rng: random.Random) -> str:
    """About `chars` characters of essay text starting at a paragraph, whole sentences."""
    starts = [m.end() for m in re.finditer(r"\n\n", essays) if m.end() + chars < len(essays)]
    start = rng.choice(starts)
    cut = essays[start : start + chars]
    return cut[: max(cut.rfind(". "), cut.rfind(".\n")) + 1].strip()


#: Sentences or records of a copy or records prompt written out in the prompt, to start the pattern.
_SHOWN = 2
#: Numbers a count prompt writes out.
_COUNT_SHOWN = 10


def _copy(essays: str, output_len: int, rng: random.Random) -> tuple[str, tuple[str, ...]]:
    """A passage, then the same passage again from its start: the model copies it from the prompt."""
    passage = _passage(essays, int(output_len * _COPY_CHARS_PER_TOKEN), rng)
    sentences = _sentences(passage)
    text = f"{passage}\n\nThe same text once more, word for word:\n\n" + " ".join(sentences[:_SHOWN])
    return text, tuple(sentences[_SHOWN:])


def _records(output_len: int, rng: random.Random) -> tuple[str, tuple[str, ...]]:
    """A list of records, then the same records as sentences, the first ones written out."""
    count = output_len // _TOKENS_PER_RECORD
    records: list[tuple[str, str, str]] = []
    names: set[str] = set()
    while len(records) < count:
        name = f"{rng.choice(_FIRST)} {rng.choice(_LAST)}"
        if name not in names:
            names.add(name)
            records.append((name, rng.choice(_CITIES), str(rng.randint(100, 999))))
    listed = "\n".join(f"{i}. {name} - {city} - {points}" for i, (name, city, points) in enumerate(records, 1))
    written = "\n".join(
        f"{i}. {name} lives in {city} and has {points} points."
        for i, (name, city, points) in enumerate(records[:_SHOWN], 1)
    )
    text = f"People, their cities and their scores:\n\n{listed}\n\nThe same people, one sentence each:\n\n{written}\n"
    return text, tuple("|".join(record) for record in records[_SHOWN:])


def _count(rng: random.Random) -> tuple[str, tuple[str, ...]]:
    """The first numbers from a seeded start, one a line: the model counts on."""
    start = rng.randint(100, 900)
    shown = range(start, start + _COUNT_SHOWN)
    text = "Counting, one number a line:\n" + "".join(f"{n}\n" for n in shown)
    return text, (str(shown.stop),)


def _continue(essays: str, rng: random.Random) -> tuple[str, tuple[str, ...]]:
    """An essay's passage: the model writes on."""
    return _passage(essays, _CONTINUE_CHARS, rng) + "\n\n", ()


def long_output_prompts(
    seeds: Sequence[int], output_lens: Sequence[int], tasks: Sequence[str] = TASKS
) -> list[LongOutputPrompt]:
    """One prompt per seed, task and output length (ids `long-s<seed>-<task>-<len>`)."""
    needs_essays = {"copy", "continue"} & set(tasks)
    essays = essay_text(int(max(output_lens) * _COPY_CHARS_PER_TOKEN) * 40) if needs_essays else ""
    prompts = []
    for output_len in output_lens:
        for task in tasks:
            for seed in seeds:
                rng = random.Random(f"{seed}-{task}-{output_len}")
                if task == "copy":
                    text, reference = _copy(essays, output_len, rng)
                elif task == "records":
                    text, reference = _records(output_len, rng)
                elif task == "count":
                    text, reference = _count(rng)
                elif task == "continue":
                    text, reference = _continue(essays, rng)
                else:
                    raise ValueError(f"unknown task {task!r} (tasks: {', '.join(TASKS)})")
                prompts.append(LongOutputPrompt(f"long-s{seed}-{task}-{output_len}", task, output_len, text, reference))
    return prompts


def prompts_hash(prompts: Sequence[LongOutputPrompt]) -> str:
    """sha256 of the prompts' ids, texts and references, in order."""
    canonical = [[p.prompt_id, p.text, list(p.reference)] for p in prompts]
    return hashlib.sha256(json.dumps(canonical, ensure_ascii=False).encode()).hexdigest()


@dataclass(frozen=True)
class LongOutputSuite:
    """The `long_output_prompts` arguments of a suite, and the hash its prompts must have."""

    name: str
    seeds: tuple[int, ...]
    output_lens: tuple[int, ...]
    sha256: str
    tasks: tuple[str, ...] = TASKS

    def prompts(self, output_lens: Sequence[int] | None = None) -> list[LongOutputPrompt]:
        """The suite's prompts (of these output lengths; all by default); ValueError if the suite's
        prompts are not the frozen ones."""
        prompts = long_output_prompts(self.seeds, self.output_lens, self.tasks)
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
    sha256="9316f17630c8ab3a898acdfaf906ff84b3eea56aced8ff01da8b80a647659d9d",
)

#: Seeds 31-38 at 1,024 tokens, frozen after the first suite's report: more prompts for the task
#: that isolates decode-time eviction (count: the prompt within every budget), where the first
#: suite's three could not rank the default against random eviction.
LONG_COUNT_SUITE = LongOutputSuite(
    name="long-count-2026-12-06",
    seeds=tuple(range(31, 39)),
    output_lens=(1024,),
    sha256="0f292d7b13a3a9b218d33ba56d30a9b521b93b69a99732b109ec9bb47e886cd1",
)

#: Seeds 51-53, counting for 8,000 tokens: the longest output the default model's 8,192 positions
#: hold after a count prompt (the other tasks' prompts do not leave room for it).
LONG_8K_SUITE = LongOutputSuite(
    name="long-8k-2026-12-07",
    seeds=(51, 52, 53),
    output_lens=(8000,),
    sha256="78d25cdeeda47ad82a4111d14efde3e9fc30a451a0dede36fffbcab79d525e96",
    tasks=("count",),
)

#: Every frozen long-output suite by name.
LONG_OUTPUT_SUITES = {suite.name: suite for suite in (LONG_OUTPUT_SUITE, LONG_COUNT_SUITE, LONG_8K_SUITE)}


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


def measure(prompt: LongOutputPrompt, output: Sequence[int], text: str, reference: Sequence[int]) -> dict[str, Any]:
    """One output's metrics against the full cache's output of the same prompt (token ids; `text`
    is the output's, for the task score): the record a long-output report keeps per answer."""
    return {
        "first_divergence": first_divergence(output, reference),
        "agreement": agreement(output, reference),
        "score": prompt.score(text),
        "loop_excess": loop_excess(output, reference),
    }
