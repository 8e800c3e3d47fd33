"""The regression guard: prompts of the frozen suite (`kvsparse_testbed.frozen_suite`) that the
default answers at request budgets of 128 and 256 (`bench/results/ablation-sentence-from-2026-12-04.md`
at 128: the default with sentences at every budget; `ablation-one-full-layer-2026-12-04.md` at 256,
where that is the same; earlier selections: `ablation-final-2026-12-04.md`,
`ablation-default-2026-12-04.md` and `regression-guard-2026-12-04.md`), asked again of the
"uncached" server, which runs the default preset as those runs did. Losing one fails."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from common.frozen import ask, chosen_prompts  # noqa: E402

from kvsparse_testbed.frozen_suite import FROZEN_SUITE  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.extended]

#: Answered at both budgets on 2026-12-04 (commits b4a9975, d3e123d): 8 of the 24 multi-key and UUID prompts
#: of 2,000 and 3,000 tokens of seeds 3-5 (the full cache answers 10 of them).
GUARD = (
    "ruler-s3-multikey-2000-1",
    "ruler-s3-uuid-2000-0",
    "ruler-s3-uuid-2000-1",
    "ruler-s3-uuid-3000-0",
    "ruler-s4-multikey-2000-0",
    "ruler-s4-multikey-3000-0",
    "ruler-s4-uuid-2000-1",
    "ruler-s5-multikey-3000-1",
)
BUDGETS = (128, 256)


def lost_answers(url: str, guard: dict[int, tuple[str, ...]]) -> list[tuple[str, int, str]]:
    """The guard's prompts (budget -> prompt ids) the server at `url` no longer answers: (prompt id,
    budget, output) each."""
    prompts = {p.prompt_id: p for p in chosen_prompts(list(FROZEN_SUITE.seeds), list(FROZEN_SUITE.tasks), [2000, 3000])}
    assert all(prompt_id in prompts for ids in guard.values() for prompt_id in ids)
    return [
        (prompt_id, budget, answer["output"])
        for budget, ids in guard.items()
        for prompt_id in ids
        if not (answer := ask(url, prompts[prompt_id], {"budget": budget}))["correct"]
    ]


def test_the_default_still_answers_the_guard_prompts_at_128_and_256(uncached_server):
    lost = lost_answers(uncached_server.url, dict.fromkeys(BUDGETS, GUARD))
    assert not lost, lost
