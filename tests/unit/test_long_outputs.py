"""The long-output suite (`kvsparse_testbed.long_outputs`): frozen prompts, task scores that check
what each task asks, the metrics against the full cache, and the benchmark's summary and report
(`bench/long_outputs.py`) on a made-up run."""

from __future__ import annotations

import dataclasses

import pytest

from kvsparse_testbed.long_outputs import (
    LONG_OUTPUT_SUITE,
    LONG_OUTPUT_SUITES,
    TASKS,
    agreement,
    first_divergence,
    long_output_prompts,
    loop_excess,
    measure,
    repeated_share,
)
from tests.unit.test_bench_helpers import _fidelity_module

long_outputs = _fidelity_module("long_outputs.py")


def _prompt(task: str, output_len: int = 1024):
    [prompt] = [p for p in LONG_OUTPUT_SUITE.prompts([output_len]) if p.task == task and "-s21-" in p.prompt_id]
    return prompt


def test_the_suite_is_frozen_uses_new_seeds_and_fits_the_default_models_context():
    prompts = LONG_OUTPUT_SUITE.prompts()
    assert len(prompts) == len(TASKS) * 3 * 2
    assert not set(LONG_OUTPUT_SUITE.seeds) & {0, 1, 2, 3, 4, 5}  # the knobs' and the frozen suite's
    assert {p.output_len for p in prompts} == {1024, 4096}
    assert len({p.text for p in prompts}) == len(prompts)
    # Characters, about four a token: a prompt and its output fit SmolLM2's 8,192 positions.
    assert all(len(p.text) / 4 + p.output_len < 8_192 for p in prompts)
    changed = dataclasses.replace(LONG_OUTPUT_SUITE, seeds=(21, 22, 24))
    with pytest.raises(ValueError, match="not the frozen"):
        changed.prompts()


def test_the_count_suite_is_frozen_on_seeds_no_other_suite_uses():
    """The second suite's count prompts start at numbers of their own, and its seeds are new."""
    count = LONG_OUTPUT_SUITES["long-count-2026-12-06"]
    assert not set(count.seeds) & (set(LONG_OUTPUT_SUITE.seeds) | {0, 1, 2, 3, 4, 5})
    starts = [p.text.splitlines()[1] for p in count.prompts() if p.task == "count"]
    assert len(starts) == 8 and len(set(starts)) == 8
    with pytest.raises(ValueError, match="not the frozen"):
        dataclasses.replace(count, seeds=(31, 32)).prompts()


def test_the_8k_suite_counts_within_the_default_models_context_on_seeds_of_its_own():
    suite = LONG_OUTPUT_SUITES["long-8k-2026-12-07"]
    others = set(LONG_OUTPUT_SUITE.seeds) | set(LONG_OUTPUT_SUITES["long-count-2026-12-06"].seeds)
    assert not set(suite.seeds) & (others | {0, 1, 2, 3, 4, 5})
    prompts = suite.prompts()
    assert [p.task for p in prompts] == ["count"] * 3 and {p.output_len for p in prompts} == {8000}
    assert all(len(p.text) + p.output_len < 8_192 for p in prompts)  # a token holds a character or more
    with pytest.raises(ValueError, match="not the frozen"):
        dataclasses.replace(suite, seeds=(51, 52)).prompts()


def test_copy_starts_the_passage_again_and_scores_the_rest_written_verbatim():
    prompt = _prompt("copy")
    passage, again = prompt.text.split("\n\nThe same text once more, word for word:\n\n")
    assert " ".join(passage.split()).startswith(again)
    rest = " ".join(passage.split())[len(again) :]
    assert prompt.score(rest) == 1.0
    half = len(prompt.reference) // 2
    assert prompt.score(" ".join(prompt.reference[:half])) == half / len(prompt.reference)
    assert prompt.score(again) == 0.0


def test_records_score_the_city_and_points_on_the_first_line_naming_a_record():
    prompt = _prompt("records")
    assert prompt.text.endswith(" points.\n")  # the first records written out start the pattern
    lines = []
    for number, record in enumerate(prompt.reference, 3):
        name, city, points = record.split("|")
        lines.append(f"{number}. {name} lives in {city} and has {points} points.")
        assert f"{name} - {city} - {points}" in prompt.text
    assert prompt.score("\n".join(lines)) == 1.0
    name, city, points = prompt.reference[0].split("|")
    one = 1 / len(prompt.reference)
    assert prompt.score(f"3. {name} lives in {city} and has 1{points} points.") == one / 2
    assert prompt.score(f"3. {name} lives in {city}.\n{name} has {points}") == one / 2  # the first line naming it
    assert prompt.score(f"3. {city} {points}") == 0.0


def test_count_scores_each_number_one_above_the_one_before():
    prompt = _prompt("count")
    first = int(prompt.reference[0])
    assert prompt.text.endswith(f"\n{first - 1}\n")
    assert prompt.score("".join(f"{n}\n" for n in range(first, first + 300))) == 1.0
    # A slip costs its own line only: first, first + 1, first + 3 (wrong), first + 4.
    assert prompt.score(f"{first}\n{first + 1}\n{first + 3}\n{first + 4}\n") == 3 / 4
    assert prompt.score(f"Sure!\n{first}\n{first + 1}") == 1 / 3
    assert prompt.score("") == 0.0


def test_continue_has_no_task_score():
    assert _prompt("continue").score("anything") is None


def test_an_unknown_task_is_refused():
    with pytest.raises(ValueError, match="unknown task"):
        long_output_prompts((21,), (1024,), ("poems",))


def test_metrics_against_the_full_caches_output():
    full = [1, 2, 3, 4, 5, 6]
    assert first_divergence(full, full) == 6
    assert first_divergence([1, 2, 9, 4, 5, 6], full) == 2
    assert first_divergence([1, 2], full) == 2
    assert agreement([1, 2, 9, 4, 5, 6], full) == 5 / 6
    assert agreement([], []) == 1.0


def test_a_loop_is_repetition_the_full_cache_does_not_have():
    varied = list(range(100))
    looping = list(range(20)) * 5
    assert repeated_share(varied) == 0.0
    assert repeated_share(looping) == pytest.approx((100 - 15 - 20) / (100 - 15))
    assert loop_excess(looping, varied) == repeated_share(looping)
    assert loop_excess(looping, looping) == 0.0
    assert loop_excess(varied, looping) == 0.0


def test_an_answers_record_holds_every_metric_against_the_full_caches_output():
    prompt = _prompt("count")
    start = int(prompt.reference[0])
    full = list(range(200))
    got = measure(prompt, [*range(50), *range(20)] * 2, f"{start}\n{start + 1}\n{start + 5}\n", full)
    assert got == {
        "first_divergence": 50,
        "agreement": 50 / 200,
        "score": 2 / 3,
        "loop_excess": loop_excess([*range(50), *range(20)] * 2, full),
    }
    assert got["loop_excess"] > 0


def _answer(first: int, agree: float, score: float | None, loop: float) -> dict:
    return {
        "output_ids": [],
        "text": "",
        "first_divergence": first,
        "agreement": agree,
        "score": score,
        "loop_excess": loop,
    }


def test_the_report_summarizes_each_system_per_length_and_task_and_plots(tmp_path):
    systems = long_outputs.systems_for([128, 256], ["random"], [256])
    assert [s.label for s in systems] == ["full", "full (again)", "default@128", "default@256", "random@256"]
    assert systems[0].setting == {"enabled": False} and systems[4].setting == {"policy": "random", "budget": 256}
    data = {
        "date": "2026-12-06",
        "provenance": {"commit": "0" * 40, "dirty": False, "command": ["bench/long_outputs.py"]},
        "machine": "test",
        "suite": {"name": LONG_OUTPUT_SUITE.name, "sha256": LONG_OUTPUT_SUITE.sha256},
        "server_args": [],
        "systems": [dataclasses.asdict(s) for s in systems],
        "prompts": {
            "a": {"task": "copy", "output_len": 1024, "prompt_len": 900},
            "b": {"task": "continue", "output_len": 1024, "prompt_len": 1000},
        },
        "answers": {
            "a": {"full": _answer(1024, 1.0, 0.5, 0.0), "default@128": _answer(100, 0.5, 0.25, 0.3)},
            "b": {"full": _answer(1024, 1.0, None, 0.0), "default@128": _answer(300, 0.7, None, 0.0)},
        },
    }
    row = long_outputs.summary(data, "default@128", 1024)
    assert row == {"prompts": 2, "first_divergence": 200, "agreement": 0.6, "score": 0.25, "loops": 1}
    assert long_outputs.summary(data, "random@256", 1024) is None
    text = long_outputs.markdown(data)
    assert "| default@128 | 2 | 200 | 0.60 | 0.25 | 1 | 0.25 |" in text
    assert "`full (again)` is the full cache asked again" in text
    assert "prompt tokens: copy 900, continue 1,000" in text and "| default@128 | 100 | 300 |" in text
    long_outputs.plot(data, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0


def test_without_the_noise_floor_the_full_cache_is_asked_once_and_the_report_says_so():
    systems = long_outputs.systems_for([256], ["random"], [256], noise_floor=False)
    assert [s.label for s in systems] == ["full", "default@256", "random@256"]
    data = {"systems": [dataclasses.asdict(s) for s in systems]}
    assert "asked once" in long_outputs.noise_floor_line(data)
