"""Per-request sparsity (`custom_params` {"kvsparse": ...}) on the evicting server: budget 256,
and a request may ask for any budget up to 1,024 or turn sparsity off (`EVICTING_ARGS`).

Requests with different settings (budget, policy, off) run in one batch, each keeps what its own setting says (the
stats while it runs, its output: sparsity off gives stock's tokens), and bad values are refused
with a 400 naming the field, on `/generate` and on the OpenAI endpoints."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from .conftest import EVICTING_MAX_REQUEST_BUDGET
from .prompts import long_prompt
from .servers import assert_at_rest

pytestmark = pytest.mark.e2e

#: ~550 tokens: compressed at prefill by a budget of 64 or 256, whole with sparsity off.
PROMPT = long_prompt(2400)
OFF = {"kvsparse": {"enabled": False}}


def generate(server, custom_params: dict, max_new_tokens: int = 32) -> dict:
    payload = {
        "text": PROMPT,
        "sampling_params": {
            "max_new_tokens": max_new_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": custom_params,
        },
    }
    response = requests.post(f"{server.url}/generate", json=payload, timeout=600)
    response.raise_for_status()
    return response.json()


def complete(server, custom_params: dict, max_tokens: int = 32) -> requests.Response:
    """The OpenAI completions endpoint, `custom_params` as the OpenAI client's `extra_body` sends it."""
    body = {"model": "default", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    return requests.post(f"{server.url}/v1/completions", json={**body, "custom_params": custom_params}, timeout=600)


def test_requests_with_their_own_settings_share_a_batch(evicting_server, stock_server):
    """Sparsity off, a budget of 64 and (through the OpenAI endpoint) one of 128 scored by H2O,
    sent together: the one with sparsity off answers stock's tokens, and the stats count each
    setting once."""
    before = evicting_server.stats()["requests_by_setting"]
    with ThreadPoolExecutor(3) as pool:
        off = pool.submit(generate, evicting_server, OFF)
        small = pool.submit(generate, evicting_server, {"kvsparse": {"budget": 64}})
        openai = pool.submit(complete, evicting_server, {"kvsparse": {"budget": 128, "policy": "h2o"}})
        off, small, openai = off.result(), small.result(), openai.result()
    openai.raise_for_status()
    assert off["output_ids"] == stock_server.generate(PROMPT, 32, ignore_eos=True)["output_ids"]
    assert len(small["output_ids"]) == 32 and openai.json()["usage"]["completion_tokens"] == 32
    after = assert_at_rest(evicting_server)["requests_by_setting"]
    added = {setting: count - before.get(setting, 0) for setting, count in after.items()}
    assert {setting: n for setting, n in added.items() if n} == {"off": 1, "budget 64": 1, "budget 128, policy h2o": 1}


def sparse_entries_while_running(server, custom_params: dict) -> tuple[set[int], int]:
    """(the entries the sparse layers hold, the tokens a full layer holds) a few decode steps
    into a streamed request with this setting, the only one running."""
    payload = {
        "text": PROMPT,
        "sampling_params": {"max_new_tokens": 40, "temperature": 0, "ignore_eos": True, "custom_params": custom_params},
        "stream": True,
    }
    with requests.post(f"{server.url}/generate", json=payload, stream=True, timeout=600) as response:
        lines = (line for line in response.iter_lines() if line)
        for _ in range(24):
            next(lines)
        stats = server.stats()
    assert stats["requests_running"] == 1
    sparse = {row["slots_in_use"] for row in stats["layers"] if row["kind"] == "sparse"}
    full = {row["slots_in_use"] for row in stats["layers"] if row["kind"] == "full"}
    assert len(full) == 1
    return sparse, full.pop()


def test_a_running_request_holds_what_its_own_setting_keeps(evicting_server):
    """Mid-decode (past one eviction): a budget of 64 holds 64..80 entries in every sparse
    layer, the server's 256..272, and sparsity off every token a full layer holds."""
    evict_page = 16
    for custom, budget in (({"kvsparse": {"budget": 64}}, 64), ({}, 256)):
        sparse, full = sparse_entries_while_running(evicting_server, custom)
        assert len(sparse) == 1 and budget <= sparse.pop() <= budget + evict_page < full
    sparse, full = sparse_entries_while_running(evicting_server, OFF)
    assert sparse == {full} and full > 256 + evict_page
    assert_at_rest(evicting_server)


@pytest.mark.parametrize(
    "custom_params, message",
    [
        ({"kvsparse": {"budget": EVICTING_MAX_REQUEST_BUDGET + 1}}, "custom_params.kvsparse.budget: 1025 is above"),
        ({"kvsparse": {"budget": 8}}, "custom_params.kvsparse.budget: 8 is smaller than the server's sink + window"),
        ({"kvsparse": {"budgets": 64}}, "custom_params.kvsparse: unknown key 'budgets'"),
        ({"kvsparse": "off"}, "custom_params.kvsparse: expected an object"),
        ({"kvsparse": {"policy": "lru"}}, "custom_params.kvsparse.policy: unknown policy 'lru'"),
        (
            {"kvsparse": {"policy": "keynorm"}},
            "custom_params.kvsparse.policy: 'keynorm' is not one a request may choose on this server (allowed: h2o,",
        ),
        (
            {"kvsparse": {"policy": {"name": "snapkv", "pool_kind": "avg", "pool_kernel": 20001}}},
            "custom_params.kvsparse.policy.pool_kernel: expected an integer from 1 to 127, got 20001",
        ),
        (
            {"kvsparse": {"policy": {"name": "span", "long_follow": 10**30}}},
            "custom_params.kvsparse.policy.long_follow: expected an integer from 0 to 256, got 1",  # 1e+30 over HTTP
        ),
    ],
)
def test_a_bad_setting_is_a_400_naming_the_field(evicting_server, custom_params, message):
    payload = {"text": PROMPT, "sampling_params": {"max_new_tokens": 8, "custom_params": custom_params}}
    native = requests.post(f"{evicting_server.url}/generate", json=payload, timeout=120)
    assert native.status_code == 400 and message in native.text, native.text
    openai = complete(evicting_server, custom_params, max_tokens=8)
    assert openai.status_code == 400 and message in openai.text, openai.text


def test_sparsity_off_is_refused_for_a_request_longer_than_the_largest_budget(evicting_server):
    response = complete(evicting_server, OFF, max_tokens=EVICTING_MAX_REQUEST_BUDGET)
    assert response.status_code == 400, response.text
    assert "custom_params.kvsparse.enabled: false keeps at most 1024 tokens on this server" in response.text
