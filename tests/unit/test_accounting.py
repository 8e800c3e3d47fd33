"""The heap layout and byte accounting, with hand-checked numbers.

SmolLM2-135M: 30 layers, 3 KV heads, dim 64, fp32. Llama-3.1-8B: 32 layers, 8 KV heads, dim 128.
"""

import pytest

from sglang_kvsparse.accounting import (
    dense_kv_bytes,
    footprint_table,
    format_footprint_table,
    kv_bytes_per_token,
    row_bytes,
    score_bytes,
)
from sglang_kvsparse.config import PRESETS, PyramidBudget, SparsityConfig
from sglang_kvsparse.layout import HeapLayout, capacity_ratio, heap_rows

BPT = 1536  # 2 (K, V) * 3 heads * 64 dims * 4 bytes, per layer
DEFAULT = HeapLayout.from_resolved(PRESETS["default"].resolve(num_layers=30, context_len=8192))
LLAMA = HeapLayout.from_resolved(PRESETS["default"].resolve(num_layers=32, context_len=131072))


def test_bytes_per_token():
    assert kv_bytes_per_token(num_kv_heads=3, head_dim=64, dtype_bytes=4) == BPT
    assert 30 * BPT == 46_080
    assert score_bytes(3) == 12 and row_bytes(DEFAULT, BPT, 12) == 2 * (1536 + 12)


def test_default_layout_pairs_sparse_layers_on_the_full_layers_lanes():
    assert DEFAULT.lanes == 2 and DEFAULT.full_layers == (0, 1)
    [group] = DEFAULT.groups
    assert (group.budget, group.max_entries, len(group.columns)) == (1024, 1040, 14)
    assert group.columns[0].layers == (2, 3) and group.columns[-1].layers == (28, 29)
    assert DEFAULT.sparse_slots[5].column == 1 and DEFAULT.sparse_slots[5].lane == 1
    assert DEFAULT.idle_lanes == 0 and DEFAULT.budget(5) == 1024 and DEFAULT.budget(0) is None


def test_rows_held_hand_checked():
    # 4096 tokens: SGLang's ids 4096 rows + 14 columns * 1040 entries = 18,656 rows of 2 lanes.
    assert DEFAULT.rows_held(4096) == 4096 + 14 * 1040 == 18_656
    assert DEFAULT.dense_rows(4096) == 4096 * 15
    # Up to budget + page nothing is dropped: the same bytes as stock.
    assert DEFAULT.rows_held(1040) == DEFAULT.dense_rows(1040) == 1040 * 15
    assert DEFAULT.rows_held(700, page_size=16) == 704 * 15
    assert DEFAULT.rows_held(4096, page_size=64) == 4096 + 14 * 1088


def test_capacity_follows_the_equal_bytes_bound_at_every_length():
    """The bound of issue 11 (Llama-3.1-8B, layers 0-1 full, budget 1,024), before score bytes."""
    bound = {1024: 1.0, 2048: 1.86, 4096: 3.33, 8192: 5.51, 16384: 8.2, 32768: 10.8}
    for length, ratio in bound.items():
        assert capacity_ratio(LLAMA, length) == pytest.approx(ratio, abs=0.01 if ratio < 5 else 0.06), length
    assert capacity_ratio(LLAMA, 512) == 1.0  # never below stock, whatever the length
    # With the scores' bytes (one float32 per KV head beside each 2*8*128*2-byte entry).
    overhead = score_bytes(8) / kv_bytes_per_token(8, 128, 2)
    assert capacity_ratio(LLAMA, 4096, score_overhead=overhead) == pytest.approx(3.30, abs=0.01)


def test_heap_rows_are_the_bytes_of_stocks_pool():
    total = 16384 * 30 * BPT  # --max-total-tokens 16384 in stock SGLang
    rows = heap_rows(total, DEFAULT.lanes, BPT, 12)
    assert rows == total // (2 * 1548) == 243_854
    assert heap_rows(total, DEFAULT.lanes, BPT, 12, page_size=16) == 243_840
    # A request that fits stock's pool fits the heap too (up to the scores' 0.8%).
    assert DEFAULT.longest_fitting(rows) >= 8192
    assert DEFAULT.rows_held(DEFAULT.longest_fitting(rows)) <= rows < DEFAULT.rows_held(DEFAULT.longest_fitting(rows) + 1)


def test_no_full_layer_means_one_lane_and_sglangs_ids_cost_a_row():
    layout = HeapLayout.from_resolved(PRESETS["snapkv"].resolve(30, 8192))
    assert layout.lanes == 1 and len(layout.groups[0].columns) == 30
    assert layout.rows_held(4096) == 4096 + 30 * 1040
    assert layout.dense_rows(4096) == 4096 * 30


def test_pyramid_columns_take_their_larger_budget():
    config = SparsityConfig(full_layers=(0, 1), budget=PyramidBudget(tokens=512, min_ratio=0.1))
    resolved = config.resolve(10, 8192)
    layout = HeapLayout.from_resolved(resolved)
    budgets = sorted((resolved.budget(layer) for layer in resolved.sparse_layers), reverse=True)
    assert [g.budget for g in reversed(layout.groups)] == budgets[::2]  # pairs share the larger
    assert layout.idle_lanes == 0 and sum(len(g.columns) for g in layout.groups) == 4
    uniform_pyramid = HeapLayout.from_resolved(
        SparsityConfig(budget=PyramidBudget(tokens=512, min_ratio=0.1)).resolve(10, 8192)
    )
    assert [g.budget for g in uniform_pyramid.groups] == sorted(
        SparsityConfig(budget=PyramidBudget(tokens=512, min_ratio=0.1)).resolve(10, 8192).budget(layer)
        for layer in range(10)
    )  # one lane: every layer its exact budget


def test_a_last_column_with_fewer_layers_than_lanes_is_reported():
    layout = HeapLayout.from_resolved(SparsityConfig(full_layers=(0, 1, 2)).resolve(30, 8192))
    assert layout.lanes == 3 and layout.idle_lanes == 0  # 27 sparse layers in 9 columns
    layout = HeapLayout.from_resolved(SparsityConfig(full_layers=(0, 1, 2)).resolve(31, 8192))
    assert layout.idle_lanes == 2 and "lane(s) idle" in layout.describe()


def test_footprint_table_lines():
    rows = footprint_table(DEFAULT, BPT, 0, context_len=8192, lengths=(1024, 4096, 100_000))
    assert [r.seq_len for r in rows] == [1024, 4096, 8192]
    assert rows[1].kv_bytes == 18_656 * 2 * BPT and rows[1].dense_bytes == dense_kv_bytes(4096, 30, BPT)
    assert rows[0].ratio == 1.0
    text = format_footprint_table(rows)
    assert "4096 tokens:" in text and "3.29x the requests" in text
