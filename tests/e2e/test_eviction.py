"""Sparse layers with a real budget (256): they evict, stay bounded, and give every slot back.

The "evicting" server keeps layers 0 and 1 full and 256 entries (plus one eviction page of 16)
in layers 2..29. Its KV pool is small enough that concurrent requests force SGLang to retract.
"""

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kvsparse_testbed.texts import essay_text

from .conftest import EVICTING_BUDGET
from .prompts import SHORT_PROMPTS, long_prompt
from .servers import assert_at_rest

pytestmark = pytest.mark.e2e

EVICT_PAGE = 16  # SparsityConfig.evict_page default


def test_sparse_layers_hold_at_most_budget_plus_a_page_while_decoding(evicting_server):
    """A ~2,000-token prompt prefilled in chunks of 512, then 80 decoded tokens: at every sampled
    step the full layers hold the whole sequence, the sparse ones the budget and at most one
    eviction page more."""
    payload = {
        "text": long_prompt(8600),
        "sampling_params": {"max_new_tokens": 80, "temperature": 0, "ignore_eos": True},
        "stream": True,
    }
    evictions_before = evicting_server.stats()["evictions"]
    samples = []
    with requests.post(f"{evicting_server.url}/generate", json=payload, stream=True, timeout=600) as response:
        for i, _ in enumerate(line for line in response.iter_lines() if line):
            if i % 10 == 2:
                samples.append(evicting_server.stats())
    assert len(samples) >= 5
    for stats in samples:
        assert stats["requests_running"] == 1
        full = [row for row in stats["layers"] if row["kind"] == "full"]
        sparse = [row for row in stats["layers"] if row["kind"] == "sparse"]
        assert [row["layer"] for row in full] == [0, 1] and len(sparse) == 28
        assert all(row["slots_in_use"] > 1900 for row in full)  # the whole ~2,000-token sequence
        assert all(EVICTING_BUDGET <= row["slots_in_use"] <= EVICTING_BUDGET + EVICT_PAGE for row in sparse)
        assert stats["kv_bytes_in_use"] < 0.2 * stats["kv_bytes_if_dense"]
    final = assert_at_rest(evicting_server)
    assert final["evictions"] - evictions_before >= 80 // EVICT_PAGE - 1  # one per page of decode


def test_short_requests_below_the_budget_match_stock(evicting_server, stock_server):
    """Nothing is evicted from a sequence shorter than the budget, so greedy output is stock's."""
    ours = evicting_server.generate_all(SHORT_PROMPTS, 32)
    for prompt, mine in zip(SHORT_PROMPTS, ours):
        assert mine["output_ids"] == stock_server.generate(prompt, 32)["output_ids"], prompt


def test_retractions_forced_by_a_small_heap_return_every_slot(evicting_server):
    """Twelve requests of ~100 + 140 tokens cannot all reach their end in the heap (`EVICTING_ARGS`):
    below the budget every layer keeps every token, so each decoded token takes a row in every
    column. SGLang admits a batch by the requests' full lengths, but charges running requests only
    the part of their output it expects (`RETRACTING_ENV`; `min_new_tokens` makes them run to the
    end without `ignore_eos`, which SGLang would plan for). So three are sent first and three more
    once those run: too many get in, SGLang retracts some mid-decode and re-runs them, and every
    request completes with all its rows back."""
    text = essay_text(40000)
    prompts = [text[i * 380 : (i + 1) * 380] + "\n\nSummarize the text above." for i in range(12)]
    admitted_before = sum(evicting_server.stats()["requests_by_setting"].values())
    with ThreadPoolExecutor(len(prompts)) as pool:
        ask = lambda p: evicting_server.generate(p, 140, min_new_tokens=140)  # noqa: E731
        first = [pool.submit(ask, p) for p in prompts[:6]]
        deadline = time.monotonic() + 300
        while evicting_server.stats()["requests_running"] < 6 and time.monotonic() < deadline:
            time.sleep(0.5)
        results = [f.result() for f in [*first, *(pool.submit(ask, p) for p in prompts[6:])]]
    assert all(len(result["output_ids"]) == 140 for result in results)
    assert all(result["meta_info"]["prompt_tokens"] + 140 < EVICTING_BUDGET for result in results)
    # A retracted request is given rows again when it is readmitted: more admissions than requests.
    admitted = sum(evicting_server.stats()["requests_by_setting"].values()) - admitted_before
    assert admitted > len(prompts), admitted
    assert_at_rest(evicting_server)


def test_aborted_stream_returns_every_slot(evicting_server):
    """A ~900-token prompt (compressed to the budget at prefill) aborted after two decode evictions."""
    evictions_before = evicting_server.stats()["evictions"]
    stats = evicting_server.abort_mid_stream(long_prompt(4000), chunks=3 * EVICT_PAGE)
    assert stats["requests_running"] == 1 and stats["evictions"] - evictions_before >= 2
    assert_at_rest(evicting_server)


def test_prometheus_gauges_sit_beside_sglangs(evicting_server):
    evicting_server.generate(SHORT_PROMPTS[0], 8)  # a prefill makes the scheduler log its metrics
    metrics = requests.get(f"{evicting_server.url}/metrics", timeout=60).text
    assert "sglang:num_running_reqs{" in metrics
    for name in ("kv_bytes_in_use", "kv_bytes_if_dense", "requests_running"):
        assert f"sglang_kvsparse:{name}{{" in metrics, name
    slots_total = [line for line in metrics.splitlines() if line.startswith("sglang_kvsparse:slots_total{")]
    assert len(slots_total) == 30 and any('layer="29"' in line for line in slots_total)
    owners = [line for line in metrics.splitlines() if line.startswith("sglang_kvsparse:heap_rows{")]
    assert {line.split('owner="')[1].split('"')[0] for line in owners} == {
        "free",
        "full_running",
        "full_cached",
        "sparse",
        "prefix_store",
        "evicting",
    }
