"""The long-output suite (`kvsparse_testbed.long_outputs`): frozen prompts, task scores that check
what each task asks, the metrics against the full cache, and the benchmark's summary and report
(`bench/long_outputs.py`) on a made-up run."""

from __future__ import annotations

import dataclasses

import pytest

from kvsparse_testbed.long_outputs import (
    LONG_OUTPUT_SUITE,
    TASKS,
    agreement,
    first_divergence,
    long_output_prompts,
    loop_excess,
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
    # Characters, about four a token: a prompt and its output fit SmolLM2's 8,192 positions.
    assert all(len(p.user_message) / 4 + p.output_len < 8_192 for p in prompts)
    changed = dataclasses.replace(LONG_OUTPUT_SUITE, seeds=(21, 22, 24))
    with pytest.raises(ValueError, match="not the frozen"):
        changed.prompts()


def test_copy_scores_the_passages_sentences_written_verbatim():
    prompt = _prompt("copy")
    passage = prompt.user_message.split("\n\n", 1)[1]
    assert prompt.score(passage) == 1.0
    half = len(prompt.reference) // 2
    assert prompt.score(" ".join(prompt.reference[:half])) == half / len(prompt.reference)
    assert prompt.score("") == 0.0


def test_records_score_a_record_only_with_its_name_city_and_score_on_one_line():
    prompt = _prompt("records")
    lines = []
    for number, record in enumerate(prompt.reference, 1):
        name, city, points = record.split("|")
        lines.append(f"{number}. {name} lives in {city} and has {points} points.")
    assert prompt.score("\n".join(lines)) == 1.0
    name, city, points = prompt.reference[0].split("|")
    assert prompt.score(f"1. {name} lives in {city} and has 1{points} points.") == 1 / len(prompt.reference)
    assert prompt.score(f"1. {name} lives in {city}.\n{points}") == 0.0


def test_count_scores_the_numbers_counted_right_from_one():
    prompt = _prompt("count")
    last = int(prompt.reference[0])
    assert prompt.score("\n".join(str(n) for n in range(1, last + 50))) == 1.0
    assert prompt.score("1\n2\n3\n5\n6") == 3 / last
    assert prompt.score("Sure!\n1\n2") == 0.0


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
        "prompts": {"a": {"task": "copy", "output_len": 1024}, "b": {"task": "continue", "output_len": 1024}},
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
    long_outputs.plot(data, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 0
