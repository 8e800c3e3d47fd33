"""Byte accounting with hand-checked numbers for SmolLM2-135M (30 layers, 3 KV heads, dim 64, fp32)."""

import pytest

from sglang_kvsparse.accounting import (
    dense_kv_bytes,
    footprint_table,
    format_footprint_table,
    held_tokens,
    kv_bytes_in_use,
    kv_bytes_per_token,
    request_kv_bytes,
    split_pool,
)
from sglang_kvsparse.config import PRESETS, SparsityConfig

BPT = 1536  # 2 (K, V) * 3 heads * 64 dims * 4 bytes, per layer
DEFAULT = PRESETS["default"].resolve(num_layers=30, context_len=8192)  # full 0,1; budget 1024; evict 16


def test_bytes_per_token():
    assert kv_bytes_per_token(num_kv_heads=3, head_dim=64, dtype_bytes=4) == BPT
    assert 30 * BPT == 46_080


def test_held_tokens_per_layer():
    assert held_tokens(DEFAULT, 0, 4096) == 4096
    assert held_tokens(DEFAULT, 2, 4096) == 1040  # budget + one eviction page
    assert held_tokens(DEFAULT, 2, 700) == 700
    assert held_tokens(DEFAULT, 2, 700, page_size=16) == 704
    assert held_tokens(DEFAULT, 2, 4096, page_size=64) == 1088


def test_request_bytes_hand_checked():
    # 4096 tokens: 2 full layers * 4096 + 28 sparse layers * 1040 = 37,312 layer-tokens.
    assert request_kv_bytes(4096, DEFAULT, BPT) == 37_312 * 1536 == 57_311_232
    assert dense_kv_bytes(4096, 30, BPT) == 4096 * 46_080 == 188_743_680
    # Shorter than budget + page: everything is kept, same as dense.
    assert request_kv_bytes(1040, DEFAULT, BPT) == dense_kv_bytes(1040, 30, BPT)
    assert request_kv_bytes(1041, DEFAULT, BPT) == (2 * 1041 + 28 * 1040) * BPT
    assert dense_kv_bytes(1000, 30, BPT, page_size=16) == 1008 * 46_080


def test_disabled_and_keep_all_equal_dense():
    off = PRESETS["off"].resolve(30, 8192)
    keep_all = SparsityConfig(budget=100_000).resolve(30, 8192)
    for n in (1, 4096, 8192):
        assert request_kv_bytes(n, off, BPT) == dense_kv_bytes(n, 30, BPT)
        assert request_kv_bytes(n, keep_all, BPT) == dense_kv_bytes(n, 30, BPT)


def test_kv_bytes_in_use():
    sparse = {layer: 100 for layer in DEFAULT.sparse_layers}
    assert kv_bytes_in_use(500, sparse, DEFAULT, BPT) == (500 * 2 + 100 * 28) * BPT


def test_split_pool_hand_checked():
    total = 10_000 * 30 * BPT  # --max-total-tokens 10000 in stock SGLang
    split = split_pool(total, DEFAULT, BPT, target_len=4096)
    # per request at 4096: 2 * 4096 + 28 * 1040 = 37,312 layer-tokens out of 300,000.
    assert split.full_tokens == 300_000 * 4096 // 37_312 == 32_933
    assert set(split.sparse_slots.values()) == {300_000 * 1040 // 37_312} == {8361}
    assert sorted(split.sparse_slots) == list(range(2, 30))
    assert split.dense_tokens == 10_000
    assert split.requests_at_target == 8 and split.dense_requests_at_target == 2
    assert split.used_bytes == 299_974 * BPT <= total
    assert "8 requests of 4096 tokens" in split.describe()


def test_split_pool_charges_the_score_bytes_of_sparse_slots():
    total = 10_000 * 30 * BPT
    slot_bytes = BPT + BPT // 64  # fp32 scores of a bf16, D=128 layer: 1/64 of its K+V bytes
    split = split_pool(total, DEFAULT, BPT, target_len=4096, sparse_slot_bytes=slot_bytes)
    plain = split_pool(total, DEFAULT, BPT, target_len=4096)
    assert split.full_tokens < plain.full_tokens and split.sparse_slots[2] < plain.sparse_slots[2]
    assert total - slot_bytes * 29 <= split.used_bytes <= total
    with pytest.raises(ValueError, match="below bytes_per_token"):
        split_pool(total, DEFAULT, BPT, sparse_slot_bytes=BPT - 1)


def test_split_pool_rounds_to_pages_and_defaults_to_context():
    total = 10_000 * 30 * BPT
    paged = split_pool(total, DEFAULT, BPT, target_len=4096, page_size=16)
    assert paged.full_tokens == 32_928 and set(paged.sparse_slots.values()) == {8352}
    by_context = split_pool(total, DEFAULT, BPT)
    assert by_context.target_len == 8192
    configured = SparsityConfig(full_layers=(0, 1), pool_target_len=4096).resolve(30, 8192)
    assert split_pool(total, configured, BPT).full_tokens == 32_933
    assert split_pool(total, DEFAULT, BPT, target_len=100_000).target_len == 8192
    with pytest.raises(ValueError):
        split_pool(total, DEFAULT, BPT, target_len=0)


def test_split_pool_degenerate_configs():
    total = 1_000 * 30 * BPT
    dense = split_pool(total, PRESETS["off"].resolve(30, 8192), BPT)
    assert dense.full_tokens == dense.dense_tokens == 1_000 and dense.sparse_slots == {}
    all_sparse = split_pool(total, PRESETS["snapkv"].resolve(30, 8192), BPT, target_len=4096)
    assert all_sparse.full_tokens == 0 and set(all_sparse.sparse_slots.values()) == {1_000}
    assert all_sparse.requests_at_target == 0  # 1,000 slots cannot hold one 1,040-entry request


def test_footprint_table():
    rows = footprint_table(DEFAULT, BPT)
    assert [row.seq_len for row in rows] == [1024, 4096, 8192]  # 16k, 32k beyond context: context shown
    assert rows[1].kv_bytes == 57_311_232 and rows[1].dense_bytes == 188_743_680
    assert rows[0].ratio == 1.0
    text = format_footprint_table(rows)
    assert text.splitlines()[1] == "4096 tokens: 54.7 MiB vs 180.0 MiB dense (30.4%)"
    assert [r.seq_len for r in footprint_table(PRESETS["default"].resolve(30, 32768), BPT)] == [1024, 4096, 16384, 32768]
