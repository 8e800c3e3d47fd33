"""The RULER-style suite: reproducible from its seed, every fact where it says, every expected
answer findable exactly once and derivable from the text, and a scorer that wants all of them."""

from __future__ import annotations

import dataclasses
import re

import pytest

from kvsparse_testbed import ruler

from .test_retrieval import SYNTHETIC_ESSAYS

LENGTHS = (600, 900)


def prompts(seed: int = 1) -> list[ruler.RulerPrompt]:
    return ruler.ruler_prompts(SYNTHETIC_ESSAYS, seed=seed, lengths=LENGTHS, per_length=2)


def test_deterministic_from_seed_and_one_prompt_per_task_length_and_index():
    assert prompts() == prompts()
    assert [p.expected for p in prompts(2)] != [p.expected for p in prompts()]
    ids = [p.prompt_id for p in prompts()]
    assert len(ids) == len(set(ids)) == len(ruler.TASKS) * len(LENGTHS) * 2
    assert {p.suite for p in prompts()} == set(ruler.TASKS)


def test_facts_sit_at_their_offsets_in_order_inside_the_haystack():
    for prompt in prompts():
        message = prompt.user_message
        offsets = prompt.fact_char_offsets
        assert list(offsets) == sorted(offsets)
        for offset in offsets:
            assert re.match(r"(The special magic|One of the special magic|VAR [A-Z]{5} = )", message[offset:])
            assert 0.04 * len(message) < offset < 0.96 * len(message)
        haystack_tokens = len(message) / ruler.NEEDLE_CHARS_PER_TOKEN
        assert 0.8 * prompt.target_tokens < haystack_tokens < 1.3 * prompt.target_tokens


@pytest.mark.parametrize("task", ["multikey", "uuid", "multivalue"])
def test_the_asked_values_are_the_asked_keys_and_appear_once(task):
    for prompt in (p for p in prompts() if p.suite == task):
        key = re.search(r"for (\w+)\?$", prompt.user_message).group(1)
        facts = dict.fromkeys(prompt.expected)
        found = re.findall(rf"magic (?:number|numbers|UUID) for {key} is ([0-9a-f-]+)\.", prompt.user_message)
        assert sorted(found) == sorted(facts), prompt.prompt_id
        for value in prompt.expected:
            assert prompt.user_message.count(value) == 1
        others = re.findall(r"magic (?:number|numbers|UUID) for (\w+) is", prompt.user_message)
        assert len(set(others)) >= 3  # look-alike facts for other keys beside the asked one


def test_variable_chains_resolve_to_the_expected_names():
    for prompt in (p for p in prompts() if p.suite == "vartrack"):
        value = re.search(r"assigned the value (\d+)", prompt.user_message).group(1)
        assignments = re.findall(r"VAR ([A-Z]{5}) = (VAR [A-Z]{5}|\d+)\.", prompt.user_message)
        resolved: dict[str, str] = {}
        for name, source in assignments:  # each variable is assigned after its source
            resolved[name] = resolved[source[4:]] if source.startswith("VAR ") else source
        assert sorted(n for n, v in resolved.items() if v == value) == sorted(prompt.expected)
        assert len(resolved) == 10 and len(set(resolved.values())) == 2


def test_an_answer_counts_only_with_every_expected_value():
    prompt = next(p for p in prompts() if p.suite == "multivalue")
    everything = " and ".join(prompt.expected)
    assert prompt.correct(f"They are {everything}.")
    assert not prompt.correct(" and ".join(prompt.expected[:2]))
    assert not prompt.correct(everything.replace(prompt.expected[0], prompt.expected[0][:-1]))  # a digit dropped
    uuid = next(p for p in prompts() if p.suite == "uuid")
    assert uuid.correct(f"The UUID is {uuid.expected[0]}.") and not uuid.correct(uuid.expected[0][:-4])
    assert uuid.to_json()["answer"] == uuid.expected[0]


def test_unknown_task_and_short_essays_are_refused():
    with pytest.raises(ValueError, match="unknown tasks"):
        ruler.ruler_prompts(SYNTHETIC_ESSAYS, tasks=("needle",))
    with pytest.raises(ValueError, match="shorter than"):
        ruler.ruler_prompts("Too short. Really.", lengths=(100,))


def test_a_suite_grows_by_a_seed_keeping_the_earlier_prompts_and_their_ids():
    def suite(seeds: tuple[int, ...]) -> list[ruler.RulerPrompt]:
        return ruler.ruler_suite(SYNTHETIC_ESSAYS, seeds, lengths=LENGTHS, per_length=2)

    first, both = suite((0,)), suite((0, 1))
    assert both[: len(first)] == first and len(both) == 2 * len(first)
    assert first[0].prompt_id == f"ruler-{ruler.TASKS[0]}-{LENGTHS[0]}-0"  # seed 0: the ids of earlier reports
    assert all(p.prompt_id.startswith("ruler-s1-") for p in both[len(first) :])
    assert len({p.prompt_id for p in both}) == len(both)
    assert all(ruler.task_of(p.prompt_id) == p.suite for p in both)
    with pytest.raises(ValueError, match="not a ruler prompt id"):
        ruler.task_of("needle-3300-d50")
    assert {p.user_message for p in both[len(first) :]}.isdisjoint(p.user_message for p in first)
    for seeds in ((0, 0), ()):
        with pytest.raises(ValueError, match="distinct and at least one"):
            suite(seeds)


def test_the_frozen_suite_is_the_one_frozen_and_holds_only_prompts_no_knob_was_chosen_on():
    """Its prompts hash to the frozen hash (a changed generator or essay text fails here), come
    from seeds the knobs were never chosen on (0-2), and cover every task and the long lengths."""
    from kvsparse_testbed.frozen_suite import FROZEN_SUITE, prompts_hash

    prompts = FROZEN_SUITE.prompts()
    assert prompts_hash(prompts) == FROZEN_SUITE.sha256 and len(prompts) == 96
    assert not set(FROZEN_SUITE.seeds) & {0, 1, 2}
    assert {ruler.task_of(p.prompt_id) for p in prompts} == set(ruler.TASKS)
    assert max(p.target_tokens for p in prompts) == 7_500
    with pytest.raises(ValueError, match="not the frozen"):
        dataclasses.replace(FROZEN_SUITE, per_length=1).prompts()


def test_the_tight_budget_suites_are_frozen_and_share_no_seed():
    """The suite a tight-budget setting is chosen on and the one it is judged on hash to their
    frozen hashes, and no two retrieval suites (nor the knobs' seeds 0-2) share a seed: a setting
    chosen on one is judged on prompts it never saw."""
    from kvsparse_testbed.frozen_suite import RETRIEVAL_SUITES, TIGHT_CHOOSE_SUITE, TIGHT_JUDGE_SUITE, prompts_hash

    for suite in (TIGHT_CHOOSE_SUITE, TIGHT_JUDGE_SUITE):
        prompts = suite.prompts()
        assert prompts_hash(prompts) == suite.sha256
        assert len(prompts) == len(suite.seeds) * len(suite.tasks) * len(suite.lengths) * suite.per_length
    seeds = [seed for suite in RETRIEVAL_SUITES.values() for seed in suite.seeds] + [0, 1, 2]
    assert len(seeds) == len(set(seeds))
