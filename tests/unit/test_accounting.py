"""The heap layout and byte accounting, with hand-checked numbers.

SmolLM2-135M: 30 layers, 3 KV heads, dim 64, fp32 (64 entries' scores per row). Llama-3.1-8B:
32 layers, 8 KV heads, dim 128, bf16 (64 entries' scores per row).
"""

import dataclasses

import pytest

from sglang_kvsparse.config import PRESETS, PyramidBudget, SparsityConfig
from sglang_kvsparse.server.accounting import (
    dense_kv_bytes,
    footprint_table,
    format_footprint_table,
    kv_bytes_per_token,
    row_bytes,
)
from sglang_kvsparse.state.layout import HeapLayout, capacity_ratio, heap_rows, scores_per_row

BPT = 1536  # 2 (K, V) * 3 heads * 64 dims * 4 bytes, per layer
SPR = scores_per_row(head_dim=64, dtype_bytes=4)


def layout(config: SparsityConfig, layers: int = 30, context: int = 8192, page: int = 1, spr: int = SPR) -> HeapLayout:
    return HeapLayout.from_resolved(config.resolve(layers, context), spr, page)


TWO_FULL = dataclasses.replace(PRESETS["default"], full_layers=(0, 1))
PAIRED = layout(TWO_FULL)  # full 0,1; budget 1024; evict 16
LLAMA = layout(TWO_FULL, layers=32, context=131072, spr=scores_per_row(128, 2))


def test_bytes_per_token():
    assert kv_bytes_per_token(num_kv_heads=3, head_dim=64, dtype_bytes=4) == BPT
    assert 30 * BPT == 46_080
    assert row_bytes(PAIRED, BPT) == 2 * 1536
    assert SPR == 64 and scores_per_row(128, 2) == 64 and scores_per_row(64, 2) == 32


def test_the_default_keeps_layer_0_full_on_the_one_lane_of_sglangs_ids():
    default = layout(PRESETS["default"])
    assert default.lanes == 1 and default.full_layers == (0,)
    [group] = default.groups
    assert (group.budget, len(group.columns), group.score_rows) == (1024, 29, 17)
    # 4096 tokens: SGLang's ids (layer 0's K/V) + 29 columns * (1040 entries + 17 score rows).
    assert default.rows_held(4096) == 4096 + 29 * (1040 + 17)
    assert default.rows_held(1040) == default.dense_rows(1040) == 1040 * 30


def test_one_full_layer_holds_the_most_requests_at_every_length():
    """Why the default keeps one full layer: with none, SGLang's id rows store nothing (below stock
    at short prompts); each full layer after the first holds a whole sequence per request."""
    llama = {
        full: layout(dataclasses.replace(PRESETS["default"], full_layers=full), 32, 131072, spr=scores_per_row(128, 2))
        for full in ((), (0,), (0, 1))
    }
    for length in (256, 1040, 4096, 32768, 131072):
        none, one, two = (capacity_ratio(llama[full], length) for full in ((), (0,), (0, 1)))
        assert one >= none and one >= two and one >= 1.0, length
    assert capacity_ratio(llama[()], 256) < 1.0
    assert capacity_ratio(llama[(0,)], 32768) > 1.4 * capacity_ratio(llama[(0, 1)], 32768)


def test_two_full_layers_pair_the_sparse_layers_on_two_lanes():
    assert PAIRED.lanes == 2 and PAIRED.full_layers == (0, 1)
    [group] = PAIRED.groups
    assert (group.budget, group.max_entries, len(group.columns)) == (1024, 1040, 14)
    assert group.score_rows == 17  # ceil(1040 / 64)
    assert group.columns[0].layers == (2, 3) and group.columns[-1].layers == (28, 29)
    assert PAIRED.layer_places[5].column == 1 and PAIRED.layer_places[5].lane == 1
    assert PAIRED.idle_lanes == 0 and 0 not in PAIRED.layer_places


def test_rows_held_hand_checked():
    # 4096 tokens: SGLang's ids 4096 rows + 14 columns * (1040 entries + 17 score rows).
    assert PAIRED.rows_held(4096) == 4096 + 14 * (1040 + 17) == 18_894
    assert PAIRED.dense_rows(4096) == 4096 * 15
    # Up to budget + page nothing is dropped and nothing evicts: the same bytes as stock.
    assert PAIRED.rows_held(1040) == PAIRED.dense_rows(1040) == 1040 * 15
    assert PAIRED.rows_held(1041) == 1041 + 14 * (1040 + 17)
    paged = layout(TWO_FULL, page=16)
    assert paged.rows_held(700) == 704 * 15
    assert paged.groups[0].score_rows == 32 and paged.rows_held(4096) == 4096 + 14 * (1040 + 32)


def test_capacity_follows_the_equal_bytes_bound_at_every_length():
    """The bound of issue 11 (Llama-3.1-8B, layers 0-1 full, budget 1,024), scores included."""
    # 4096: 4096 + 15 columns * (1040 entries + 17 score rows) = 19,951 rows against 4096 * 16.
    bound = {1024: 1.0, 2048: 1.83, 4096: 3.285, 8192: 5.45, 16384: 8.13, 32768: 10.78}
    for length, ratio in bound.items():
        assert capacity_ratio(LLAMA, length) == pytest.approx(ratio, abs=0.005), length
    for length in (1, 256, 512, 1000, 1040):
        assert capacity_ratio(LLAMA, length) == 1.0  # never below stock, whatever the length


def test_heap_rows_are_the_bytes_of_stocks_pool():
    total = 16384 * 30 * BPT  # --max-total-tokens 16384 in stock SGLang
    rows = heap_rows(total, PAIRED.lanes, BPT)
    assert rows == 16384 * 15
    assert heap_rows(total + 1000, PAIRED.lanes, BPT, page_size=16) == 16384 * 15
    # A request that fits stock's pool fits the heap too.
    longest = PAIRED.longest_fitting(rows)
    assert longest >= 8192 and PAIRED.rows_held(longest) <= rows < PAIRED.rows_held(longest + 1)


def test_no_full_layer_means_one_lane_and_sglangs_ids_cost_a_row():
    one = layout(PRESETS["snapkv"])
    assert one.lanes == 1 and len(one.groups[0].columns) == 30
    assert one.rows_held(4096) == 4096 + 30 * (1040 + 17)
    assert one.dense_rows(4096) == 4096 * 30


def test_pyramid_columns_take_their_larger_budget():
    config = SparsityConfig(full_layers=(0, 1), budget=PyramidBudget(tokens=512, min_ratio=0.1))
    resolved = config.resolve(10, 8192)
    paired = HeapLayout.from_resolved(resolved, SPR)
    budgets = sorted((resolved.budget(layer) for layer in resolved.sparse_layers), reverse=True)
    assert [g.budget for g in reversed(paired.groups)] == budgets[::2]  # pairs share the larger
    assert paired.idle_lanes == 0 and paired.num_columns == 4
    alone = SparsityConfig(budget=PyramidBudget(tokens=512, min_ratio=0.1)).resolve(10, 8192)
    assert [g.budget for g in HeapLayout.from_resolved(alone, SPR).groups] == sorted(
        alone.budget(layer) for layer in range(10)
    )  # one lane: every layer its exact budget


def test_a_last_column_with_fewer_layers_than_lanes_is_reported():
    assert layout(SparsityConfig(full_layers=(0, 1, 2))).idle_lanes == 0  # 27 sparse layers in 9 columns
    uneven = layout(SparsityConfig(full_layers=(0, 1, 2)), layers=31)
    assert uneven.idle_lanes == 2 and "lane(s) idle" in uneven.describe()


def test_footprint_table_lines():
    rows = footprint_table(PAIRED, BPT, context_len=8192, lengths=(1024, 4096, 100_000))
    assert [r.seq_len for r in rows] == [1024, 4096, 8192]
    assert rows[1].kv_bytes == 18_894 * 2 * BPT and rows[1].dense_bytes == dense_kv_bytes(4096, 30, BPT)
    assert rows[0].ratio == 1.0
    text = format_footprint_table(rows)
    assert "4096 tokens:" in text and "3.25x the requests" in text
