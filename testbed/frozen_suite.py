"""The frozen evaluation suite: RULER-style prompts that no knob of the project was chosen on.

Why: every knob of the default was chosen on seeds 0-2 of `kvsparse_testbed.ruler`; a measurement
on those prompts says how well the knobs fit them, not how well they transfer. This suite uses
new seeds, all four tasks (multi-value and variable tracking back in) and prompts of up to 7,500
tokens, where the guide engages at budget 1,024 as well. It is frozen: `FROZEN_SUITE.sha256` is
the hash of every prompt's id, text and expected answer, so a change to the generator or the
essays shows as a failed check (`check`) rather than as a silently different suite. Reports
record its name and hash.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from kvsparse_testbed import ruler
from kvsparse_testbed.texts import essay_text


@dataclass(frozen=True)
class FrozenSuite:
    """The `ruler.ruler_suite` arguments of a suite, and the hash its prompts must have."""

    name: str
    seeds: tuple[int, ...]
    tasks: tuple[str, ...]
    lengths: tuple[int, ...]
    per_length: int
    sha256: str

    def prompts(self) -> list[ruler.RulerPrompt]:
        """The suite's prompts; ValueError if they are not the frozen ones."""
        essays = essay_text(ruler.min_essay_chars(self.lengths))
        prompts = ruler.ruler_suite(essays, self.seeds, self.tasks, self.lengths, self.per_length)
        found = prompts_hash(prompts)
        if found != self.sha256:
            raise ValueError(f"suite {self.name}: its prompts hash to {found}, not the frozen {self.sha256}")
        return prompts


def prompts_hash(prompts: Sequence[ruler.RulerPrompt]) -> str:
    """sha256 of the prompts' ids, texts and expected answers, in order."""
    canonical = [[p.prompt_id, p.user_message, list(p.expected)] for p in prompts]
    return hashlib.sha256(json.dumps(canonical, ensure_ascii=False).encode()).hexdigest()


#: Seeds 3-5 (0-2 chose the knobs), every task, two prompts per task and length.
FROZEN_SUITE = FrozenSuite(
    name="frozen-2026-12-04",
    seeds=(3, 4, 5),
    tasks=ruler.TASKS,
    lengths=(2_000, 3_000, 6_000, 7_500),
    per_length=2,
    sha256="de90ea2174c701a3bdd5573a0f7fde6c0f71ce39940fe3c9099435e4c4b7b929",
)

#: The tightest budget (64), where the default was seen to answer fewer than before three knobs
#: were removed: a setting for it is chosen on these prompts (multi-key and UUID, the tasks this
#: model answers at 2,000 and 3,000 tokens; seeds 40-43, never used before) ...
TIGHT_CHOOSE_SUITE = FrozenSuite(
    name="tight-choose-2026-12-06",
    seeds=(40, 41, 42, 43),
    tasks=("multikey", "uuid"),
    lengths=(2_000, 3_000),
    per_length=3,
    sha256="67c738a4b35e94754dc7207302041ef7ffa9dca225e94d825544364d4b9f965e",
)
#: ... and judged on these (seeds 44-49), beside the frozen suite.
TIGHT_JUDGE_SUITE = FrozenSuite(
    name="tight-judge-2026-12-06",
    seeds=(44, 45, 46, 47, 48, 49),
    tasks=("multikey", "uuid"),
    lengths=(2_000, 3_000),
    per_length=3,
    sha256="ce92140d9f1d7ae3b5d808aaabedf994cfd4fb812e79f56c8fbe6e0c6015fc18",
)
#: Every frozen retrieval suite, by name.
RETRIEVAL_SUITES = {suite.name: suite for suite in (FROZEN_SUITE, TIGHT_CHOOSE_SUITE, TIGHT_JUDGE_SUITE)}
