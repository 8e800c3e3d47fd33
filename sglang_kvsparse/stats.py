"""What the sparse layers hold, as typed records: `/kvsparse/stats`, the gauges and the tests read
these (`SparseStats.to_dict()` is the wire format). No SGLang imports.

Heap rows by owner: every row of the one KV heap is free, or held by exactly one of SGLang's
full-pool ids (a running request's token, or a token the radix tree caches), a sparse group's
request entries, the prefix store, or an eviction whose forward is still in flight.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from sglang_kvsparse.accounting import dense_kv_bytes, kv_bytes_per_token, row_bytes
from sglang_kvsparse.sparse_state import SparseState


@dataclass(frozen=True)
class LayerStats:
    """One layer: entries its running requests hold, and the most it could hold (the heap's rows)."""

    layer: int
    kind: str  # "full" or "sparse"
    budget: int | None
    slots_in_use: int
    slots_total: int


@dataclass(frozen=True)
class GroupStats:
    """One group of sparse columns."""

    budget: int
    max_entries: int
    columns: int
    layers: list[int]
    rows: int  # heap rows its requests hold (entries and scores)
    score_rows: int  # of which score rows


@dataclass(frozen=True)
class HeapStats:
    """The heap's rows by owner (they add up to `rows_total`)."""

    rows_total: int
    lanes: int
    free: int
    full_running: int  # SGLang ids of running requests' tokens
    full_cached: int  # SGLang ids the radix tree caches (or otherwise holds)
    sparse: int  # all groups' request entries
    prefix_store: int
    evicting: int  # evicted rows given back once their forward has been issued
    groups: list[GroupStats]


@dataclass(frozen=True)
class SparseStats:
    """The state of the sparse layers in one scheduler process."""

    config: dict[str, Any]
    layout: str
    layers: list[LayerStats]
    heap: HeapStats
    kv_bytes_in_use: int
    kv_bytes_if_dense: int
    prefix_cache: bool
    prefix_hits: int
    prefix_tokens_reused: int
    chunks_stored: int  # prefill chunks before a prompt's last, kept whole in the prefix store
    store_entries_adopted: int  # prompt tokens' entries moved to the radix tree's ids (conversations)
    requests_running: int
    requests_running_peak: int
    forward_plans: int
    evictions: int
    enabled: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def collect(state: SparseState, heap_free_rows: int) -> SparseStats:
    """Stats of `state`, with the heap's free rows as SGLang's allocator counts them."""
    layout, page = state.layout, state.page_size
    running = state.running_rows()
    full_running = int(((state.logical[running] + page - 1) // page).sum()) * page
    group_stats = [
        GroupStats(
            g.spec.budget, g.spec.max_entries, g.columns, list(g.spec.layers), state.sparse_rows(g), state.score_rows(g)
        )
        for g in state.groups
    ]
    sparse = sum(g.rows for g in group_stats)
    store = state.store.rows() if state.store is not None else 0
    evicting = state.deferred_rows()
    total = state.dense_capacity
    heap = HeapStats(
        rows_total=total,
        lanes=layout.lanes,
        free=heap_free_rows,
        full_running=full_running,
        full_cached=total - heap_free_rows - full_running - sparse - store - evicting,
        sparse=sparse,
        prefix_store=store,
        evicting=evicting,
        groups=group_stats,
    )
    layers = []
    for layer in range(layout.num_layers):
        slot = layout.sparse_slots.get(layer)
        if slot is None:
            layers.append(LayerStats(layer, "full", None, full_running, total))
        else:
            group = group_stats[slot.group]
            entries = (group.rows - group.score_rows) // group.columns
            layers.append(LayerStats(layer, "sparse", group.budget, entries, total))
    lane = state.lanes[0]
    num_kv_heads, head_dim = lane.k.shape[1], lane.k.shape[2]
    bpt = kv_bytes_per_token(num_kv_heads, head_dim, lane.k.element_size())
    unit = row_bytes(layout, bpt)
    dense = sum(dense_kv_bytes(int(n), layout.num_layers, bpt, page) for n in state.logical[running])
    return SparseStats(
        config=state.config.to_dict(),
        layout=layout.describe(),
        layers=layers,
        heap=heap,
        kv_bytes_in_use=(full_running + sparse) * unit,
        kv_bytes_if_dense=dense,
        prefix_cache=state.store is not None,
        prefix_hits=state.counters.prefix_hits,
        prefix_tokens_reused=state.counters.prefix_tokens_reused,
        chunks_stored=state.counters.chunks_stored,
        store_entries_adopted=state.counters.store_entries_adopted,
        requests_running=len(running),
        requests_running_peak=state.counters.requests_running_peak,
        forward_plans=state.counters.forward_plans,
        evictions=state.counters.evictions,
    )


__all__ = ["GroupStats", "HeapStats", "LayerStats", "SparseStats", "collect"]
