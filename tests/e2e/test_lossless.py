"""Sparse layers with budgets above every length are lossless: greedy outputs equal stock's.

The sparse server runs layers 2..29 through the project's path (own slot pools and index maps,
attention through `sglang_kvsparse.kernels`), layers 0 and 1 through the stock backend. With
nothing to evict, any difference from stock SGLang is a plumbing bug. Afterwards every sparse
pool must be back to its initial free count (`/kvsparse/stats`).
"""

import pytest

from .prompts import SHORT_PROMPTS, long_prompt

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 24


def test_sparse_layers_with_full_budgets_match_stock(sparse_server, stock_server):
    before = sparse_server.stats()
    assert before["enabled"] and [row["layer"] for row in before["layers"] if row["kind"] == "full"] == [0, 1]
    prompts = [*SHORT_PROMPTS, long_prompt(10000)]
    ours = sparse_server.generate_all(prompts, MAX_NEW_TOKENS)
    stock = stock_server.generate_all(prompts, MAX_NEW_TOKENS)
    assert max(o["meta_info"]["prompt_tokens"] for o in ours) > 2000
    for prompt, mine, theirs in zip(prompts, ours, stock):
        assert len(mine["output_ids"]) > 0
        assert mine["output_ids"] == theirs["output_ids"], prompt[:60]

    after = sparse_server.stats()
    assert after["requests_running"] == 0 and after["requests_running_peak"] >= 2
    assert after["forward_plans"] > before["forward_plans"] + MAX_NEW_TOKENS
    for pool in after["pools"]:
        assert pool["free_slots"] == pool["initial_free_slots"], pool
    assert all(row["slots_in_use"] == 0 for row in after["layers"] if row["kind"] == "sparse")


def test_aborted_streams_return_their_slots(sparse_server):
    """A client that disconnects mid-stream aborts its request; its slots must all come back."""
    assert sparse_server.abort_mid_stream(long_prompt(4000), chunks=4)["requests_running"] == 1
    stats = sparse_server.idle_stats()
    assert stats["requests_running"] == 0
    for pool in stats["pools"]:
        assert pool["free_slots"] == pool["initial_free_slots"], pool
