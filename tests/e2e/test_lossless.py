"""Sparse layers with budgets above every length are lossless: greedy outputs equal stock's.

The sparse server has the default's layout: layers 1..29 through the project's path (own slot
pools and index maps, attention through `sglang_kvsparse.kernels`), layer 0 through the stock
backend. With nothing to evict, any difference from stock SGLang is a plumbing bug, with or
without radix-cache hits, prompts chunked (512 tokens, mixed chunks, as stock here) or not.
Afterwards no request may hold a sparse slot (`/kvsparse/stats`).
"""

import pytest

from .prompts import SHORT_PROMPTS, long_prompt
from .servers import assert_every_slot_back

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 24


def test_sparse_layers_with_full_budgets_match_stock(sparse_server, stock_server):
    before = sparse_server.stats()
    kinds = [row["kind"] for row in before["layers"]]
    assert before["enabled"] and kinds == ["full"] + ["sparse"] * 29
    prompts = [*SHORT_PROMPTS, long_prompt(10000), long_prompt(16000)[8000:]]  # two of several chunks
    ours = sparse_server.generate_all(prompts, MAX_NEW_TOKENS)
    stock = stock_server.generate_all(prompts, MAX_NEW_TOKENS)
    assert max(o["meta_info"]["prompt_tokens"] for o in ours) > 2000
    for prompt, mine, theirs in zip(prompts, ours, stock):
        assert len(mine["output_ids"]) > 0
        assert mine["output_ids"] == theirs["output_ids"], prompt[:60]

    after = sparse_server.stats()
    assert after["requests_running"] == 0 and after["requests_running_peak"] >= 2
    assert after["forward_plans"] > before["forward_plans"] + MAX_NEW_TOKENS
    assert_every_slot_back(after)


def test_prefix_hits_through_sparse_layers_match_stock(sparse_server, stock_server):
    """Prompts sharing a cached ~1,600-token prefix, sent at once: the sparse layers read the
    prefix from the prefix store, and every output is stock's, which hits its own cache."""
    prefix = long_prompt(7000)
    prompts = [prefix + suffix for suffix in ("\nIn one sentence:", "\nThe main idea is", "\nA title for it:")]
    for server in (sparse_server, stock_server):
        server.flush_cache()
        server.generate(prefix, 1)  # caches the prefix
    hits_before = sparse_server.stats()["prefix_hits"]
    ours = sparse_server.generate_all(prompts, MAX_NEW_TOKENS)
    stock = stock_server.generate_all(prompts, MAX_NEW_TOKENS)
    for prompt, mine, theirs in zip(prompts, ours, stock):
        assert mine["meta_info"]["cached_tokens"] > 1000
        assert mine["output_ids"] == theirs["output_ids"], prompt[-30:]
    assert sparse_server.stats()["prefix_hits"] - hits_before == len(prompts)


def test_aborted_streams_return_their_slots(sparse_server):
    """A client that disconnects mid-stream aborts its request; its slots must all come back."""
    assert sparse_server.abort_mid_stream(long_prompt(4000), chunks=4)["requests_running"] == 1
    assert_every_slot_back(sparse_server.idle_stats())
