"""What a client can make the server do is bounded (the evicting server: its requests may choose
h2o, snapkv, span and tova, at most `max_distinct_settings` 4 own settings run at once).

More distinct settings than the limit, sent together, are all answered, with no more scoring
passes per prefill and evictions per decode step than the limit allows, `/health` answering
throughout; and (extended tier) a seeded fuzz of `custom_params` and OpenAI fields beside plain
traffic gets nothing but 400s and answers, and leaves every row free."""

from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from .prompts import long_prompt
from .servers import assert_at_rest

pytestmark = pytest.mark.e2e

#: ~550 tokens: every own budget below compresses it at prefill, and 40 new tokens evict.
PROMPT = long_prompt(2400)
MAX_DISTINCT_SETTINGS = 4  # the configuration's default

#: Eight own settings, all allowed: four budgets of the server's policy, four policies.
SETTINGS = [
    {"budget": 64},
    {"budget": 80},
    {"budget": 96},
    {"budget": 112},
    {"budget": 128, "policy": "tova"},
    {"budget": 128, "policy": "h2o"},
    {"budget": 128, "policy": {"name": "snapkv", "pool_kind": "avg", "pool_kernel": 127}},
    {"budget": 128, "policy": {"name": "span", "long_follow": 256}},
]


def generate(server, custom_params: Any, max_new_tokens: int = 40) -> requests.Response:
    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True, "custom_params": custom_params}
    return requests.post(f"{server.url}/generate", json={"text": PROMPT, "sampling_params": sampling}, timeout=900)


class HealthWatch:
    """Polls `/health` every second while it runs; `slowest` is the longest answer in seconds,
    `failures` the polls that did not answer 200 within 60 s."""

    def __init__(self, url: str) -> None:
        self.url, self.slowest, self.failures, self.polls = url, 0.0, 0, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            start = time.monotonic()
            try:
                ok = requests.get(f"{self.url}/health", timeout=60).status_code == 200
            except requests.RequestException:
                ok = False
            self.slowest = max(self.slowest, time.monotonic() - start)
            self.failures += not ok
            self.polls += 1

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_more_distinct_settings_than_the_limit_are_served_within_it(evicting_server):
    """Eight own settings at once: all answered, some waited for others to finish, no prefill
    scored more than 1 + 4 times and no decode step ran more than 1 + 4 evictions per group."""
    before = evicting_server.stats()
    with HealthWatch(evicting_server.url) as health, ThreadPoolExecutor(len(SETTINGS)) as pool:
        answers = list(pool.map(lambda s: generate(evicting_server, {"kvsparse": s}), SETTINGS))
    assert [a.status_code for a in answers] == [200] * len(SETTINGS), [a.text for a in answers]
    assert all(len(a.json()["output_ids"]) == 40 for a in answers)
    assert health.polls and health.failures == 0, vars(health)
    stats = assert_at_rest(evicting_server)
    groups = len(stats["heap"]["groups"])
    assert stats["setting_waits"] > before["setting_waits"]
    assert stats["scoring_passes_peak"] <= 1 + MAX_DISTINCT_SETTINGS
    assert 1 <= stats["evictions_per_step_peak"] <= groups * (1 + MAX_DISTINCT_SETTINGS)


#: The fuzz's size: cases sent, of which a third are plain requests.
FUZZ_CASES = 90
FUZZ_SEED = 20261204


def _value(rng: random.Random, depth: int = 0) -> Any:
    """A JSON value of any type, sometimes huge, long or deeply nested."""
    kind = rng.choice(["int", "huge", "float", "str", "long", "bool", "null", "list", "dict", "deep"])
    if kind == "int":
        return rng.choice([-1, 0, 1, 7, 15, 64, 127, 129, 256, 1024, 1025, 4096])
    if kind == "huge":
        return rng.choice([10**30, -(10**30), 2**63, 2**64 + 1, 1e308, -1e308])
    if kind == "float":
        return rng.choice([0.0, 0.25, 0.5, 1.0, 1.5, -0.5, 3.14])
    if kind == "str":
        return rng.choice(["", "span", "h2o", "snapkv", "tova", "keynorm", "avg", "max", "off", "256"])
    if kind == "long":
        return "x" * rng.choice([1_000, 100_000])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "null":
        return None
    if kind == "deep":
        value: Any = 1
        for _ in range(rng.choice([10, 60])):
            value = {"a": value}
        return value
    if depth > 2:
        return 0
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(["budget", "policy", "enabled", "x"]): _value(rng, depth + 1) for _ in range(rng.randint(0, 3))}


def _policy(rng: random.Random) -> Any:
    """A policy: a name, or a name with knobs in and out of their ranges, or anything."""
    if rng.random() < 0.2:
        return _value(rng)
    name = rng.choice(["span", "snapkv", "h2o", "tova", "keynorm", "streamingllm", "lru"])
    if rng.random() < 0.4:
        return name
    knobs = ["pool_kind", "pool_kernel", "long_follow", "sentence", "unknown"]
    return {"name": name, **{knob: _value(rng) for knob in rng.sample(knobs, rng.randint(1, 4))}}


def _custom_params(rng: random.Random) -> Any:
    kind = rng.random()
    if kind < 0.1:
        return _value(rng)
    if kind < 0.2:
        return {"kvsparse": _value(rng)}
    setting: dict[str, Any] = {}
    for key in rng.sample(["budget", "policy", "enabled", "budgte"], rng.randint(1, 3)):
        setting[key] = _policy(rng) if key == "policy" else _value(rng)
    return {"kvsparse": setting, **({"other": _value(rng)} if rng.random() < 0.2 else {})}


def _openai_fields(rng: random.Random) -> dict[str, Any]:
    """OpenAI completion fields, some out of range."""
    fields: dict[str, Any] = {"max_tokens": rng.choice([1, 8, 16, -1, 0, 10**9])}
    if rng.random() < 0.3:
        fields["temperature"] = rng.choice([0, 0.7, -1, 1e9])
    if rng.random() < 0.3:
        fields["n"] = rng.choice([1, 2, 0])
    if rng.random() < 0.3:
        fields["stop"] = rng.choice([[".", "\n"], ["x" * 50] * 200, 7])
    if rng.random() < 0.2:
        fields["logprobs"] = rng.choice([1, 5, 1000])
    return fields


def _case(rng: random.Random, server_url: str) -> tuple[str, dict[str, Any]]:
    """(url, body) of one request: plain, native with fuzzed `custom_params`, or OpenAI."""
    roll = rng.random()
    if roll < 1 / 3:
        sampling = {"max_new_tokens": 8, "temperature": 0}
        return f"{server_url}/generate", {"text": PROMPT[: rng.randint(50, len(PROMPT))], "sampling_params": sampling}
    custom = _custom_params(rng)
    if roll < 2 / 3:
        sampling = {"max_new_tokens": rng.choice([4, 8, 16]), "temperature": 0, "custom_params": custom}
        return f"{server_url}/generate", {"text": PROMPT, "sampling_params": sampling}
    body = {"model": "default", "prompt": PROMPT, **_openai_fields(rng), "custom_params": custom}
    return f"{server_url}/v1/completions", body


@pytest.mark.extended
def test_a_fuzzed_request_surface_gets_400s_or_answers_and_leaves_the_server_healthy(evicting_server):
    """`FUZZ_CASES` seeded cases, eight at a time: every answer is 200 or 400, plain requests are
    all 200, `/health` answers throughout, and afterwards every row is free."""
    rng = random.Random(FUZZ_SEED)
    cases = [_case(rng, evicting_server.url) for _ in range(FUZZ_CASES)]

    def send(case: tuple[str, dict[str, Any]]) -> tuple[int, str]:
        url, body = case
        response = requests.post(url, data=json.dumps(body), headers={"Content-Type": "application/json"}, timeout=900)
        return response.status_code, response.text[:300]

    with HealthWatch(evicting_server.url) as health, ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(send, cases))
    statuses = [status for status, _ in answers]
    unexpected = [(case[1], answer) for case, answer in zip(cases, answers) if answer[0] not in (200, 400)]
    assert not unexpected, unexpected[:3]
    plain = [status for case, status in zip(cases, statuses) if "custom_params" not in json.dumps(case[1])]
    assert plain and set(plain) == {200}
    assert statuses.count(400) > FUZZ_CASES // 4 and statuses.count(200) > FUZZ_CASES // 3
    assert health.failures == 0, vars(health)
    assert_at_rest(evicting_server)
