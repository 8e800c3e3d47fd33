"""The soak's request mix (`bench/soak_mix.py`): seeded, every kind of request present, prompts of
exactly the drawn length from one token to the longest allowed, many on the sparse layers' edges,
groups that really share their prefix, and bad settings refused."""

from __future__ import annotations

import pytest

from .test_bench_helpers import _load

soak_mix = _load("soak_mix.py")

EDGES = soak_mix.Edges(budget=256, max_entries=272, context_len=8192)
SETTINGS = soak_mix.MixSettings(requests=500, max_prompt_tokens=7800, text_tokens=30000, seed=3)


def test_the_same_seed_gives_the_same_mix_and_another_seed_another():
    mix = soak_mix.build_mix(SETTINGS, EDGES)
    assert mix == soak_mix.build_mix(SETTINGS, EDGES)
    other = soak_mix.MixSettings(500, 7800, 30000, seed=4)
    assert mix != soak_mix.build_mix(other, EDGES)


def test_the_mix_holds_every_kind_of_request():
    mix = soak_mix.build_mix(SETTINGS, EDGES)
    assert {r.endpoint for r in mix} == set(soak_mix.ENDPOINTS)
    assert {r.interrupt for r in mix} == {None, *soak_mix.INTERRUPTS}
    assert {r.stream for r in mix} == {True, False}
    assert any(r.n > 1 for r in mix) and any(r.logprobs for r in mix) and any(r.stop for r in mix)
    assert any(r.follow_ups for r in mix) and any(r.prefix_group is not None for r in mix)
    assert all(r.endpoint == "chat" and r.interrupt is None for r in mix if r.follow_ups)
    assert all(r.stream for r in mix if r.interrupt in ("abort-prefill", "abort-decode", "disconnect-decode"))
    assert all(r.greedy is False and r.interrupt not in soak_mix.ABORTS for r in mix if r.n > 1)


def test_prompt_lengths_span_one_token_to_the_longest_with_many_on_the_edges():
    mix = soak_mix.build_mix(SETTINGS, EDGES)
    lengths = [r.prompt_tokens for r in mix]
    assert min(lengths) == 1 and max(lengths) <= SETTINGS.max_prompt_tokens
    assert max(lengths) > SETTINGS.max_prompt_tokens * 3 // 4
    edges = (EDGES.budget, EDGES.max_entries, EDGES.max_entries + EDGES.step)
    on_edge = [n for n in lengths if any(abs(n - e) <= 2 for e in edges)]
    assert len(on_edge) >= len(mix) // 10
    assert sum(n + r.max_new_tokens <= EDGES.budget for n, r in zip(lengths, mix)) >= len(mix) // 5
    assert all(r.prompt_tokens + r.max_new_tokens < EDGES.context_len for r in mix)


def test_prompts_have_their_drawn_length_and_groups_share_their_prefix():
    text_ids = list(range(SETTINGS.text_tokens))
    offsets = soak_mix.group_offsets(SETTINGS)
    mix = soak_mix.build_mix(SETTINGS, EDGES)
    prompts = {r.index: soak_mix.prompt_ids(r, text_ids, offsets) for r in mix}
    assert all(len(prompts[r.index]) == r.prompt_tokens for r in mix)
    first: dict[int, list[int]] = {}
    for r in (r for r in mix if r.prefix_group is not None):
        shared = prompts[r.index][: r.prefix_tokens]
        assert len(shared) == r.prefix_tokens < r.prompt_tokens
        assert first.setdefault(r.prefix_group, shared) == shared
    assert len(first) > 1


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (soak_mix.MixSettings(10, 8192, 30000), "below the context"),
        (soak_mix.MixSettings(10, 7800, 9000), "twice the longest"),
    ],
)
def test_bad_settings_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        soak_mix.build_mix(settings, EDGES)
