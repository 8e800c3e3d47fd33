"""What the sparse layers hold, as typed records: `/kvsparse/stats`, the gauges and the tests read
these (`SparseStats.to_dict()` is the wire format). No SGLang imports.

Heap rows by owner: every row of the one KV heap is free, or held by exactly one of SGLang's
full-pool ids (a running request's token, or a token the radix tree caches), a sparse group's
request entries, the prefix store, or an eviction whose forward is still in flight.

Past one device (`combine_tp_ranks`, `combine_replicas`): every scheduler process collects its
own stats. The tensor-parallel ranks of one replica hold the same requests, entries and rows,
each for its own KV heads, so their counts must agree (a difference means the ranks' decisions
diverged, and is reported) and only their bytes add up; data-parallel replicas hold different
requests, so everything countable adds up over them.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any

from sglang_kvsparse.server.accounting import dense_kv_bytes, kv_bytes_per_token, row_bytes
from sglang_kvsparse.state.sparse_state import SparseState


@dataclass(frozen=True)
class LayerStats:
    """One layer: entries its running requests hold, and the most it could hold (the heap's rows)."""

    layer: int
    kind: str  # "full", "sparse" or "sliding"
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
    releasing: int  # rows SGLang freed, on their way to the host (`released_ids.py`)
    groups: list[GroupStats]
    #: What a row holds: K/V in `kv_dtype` (the KV cache's: the model's, or FP8), `row_bytes` of
    #: them over every lane (a score row holds float32 scores in those same bytes).
    kv_dtype: str = ""
    row_bytes: int = 0


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
    #: What makes the host wait for the device, counted where the sparse path could: request indices
    #: read back (`host_syncs`), SGLang's free ids copied to the host during a decode step's
    #: allocation (`decode_refills`; `heap_refills` all of them, prefills included), allocations
    #: that waited for freed ids still on their way (`release_waits`). Zero in a healthy decode.
    host_syncs: int
    decode_refills: int
    heap_refills: int
    release_waits: int
    #: The work requests' own settings cost, within `max_distinct_settings`: admission rounds a
    #: request sat out for a setting one too many, the most scoring passes of one prefill and the
    #: most evictions of one decode step (peaks: with several replicas, the first one's).
    setting_waits: int
    scoring_passes_peak: int
    evictions_per_step_peak: int
    #: The most heap rows a guided prefill's new tokens waited in during one forward (charged at
    #: admission, back after the forward; bounded by the chunked-prefill size), and admissions
    #: put off to the next round while such rows were out.
    guide_rows_peak: int
    guide_waits: int
    #: Sentence-ending tokens among the keys of the prefills that keep entries, cached prefixes
    #: included (0 without a tokenizer, `--skip-tokenizer-init`: its start-up log says so).
    prefill_sentence_ends: int
    #: Requests given rows by their own setting ("server", "budget N", "off": `RequestSparsity`).
    requests_by_setting: dict[str, int]
    enabled: bool = True

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def collect(state: SparseState, heap_free_rows: int) -> SparseStats:
    """Stats of `state`, with the heap's free rows as SGLang's allocator counts them."""
    layout, page = state.layout, state.page_size
    running = state.requests.running_requests()
    full_running = int(((state.requests.length[running] + page - 1) // page).sum()) * page
    group_stats = [
        GroupStats(g.spec.budget, g.spec.max_entries, g.columns, list(g.spec.layers), g.rows_held(), g.score_rows())
        for g in state.groups
    ]
    sparse = sum(g.rows for g in group_stats)
    store = state.store.rows() if state.store is not None else 0
    evicting = state.heap.deferred_rows()
    releasing = state.heap.released_rows()
    total = state.dense_capacity
    lane = state.lanes[0]
    bpt = kv_bytes_per_token(lane.k.shape[1], lane.k.shape[2], lane.k.element_size())
    unit = row_bytes(layout, bpt)
    heap = HeapStats(
        rows_total=total,
        lanes=layout.lanes,
        free=heap_free_rows,
        full_running=full_running,
        full_cached=total - heap_free_rows - full_running - sparse - store - evicting - releasing,
        sparse=sparse,
        prefix_store=store,
        evicting=evicting,
        releasing=releasing,
        groups=group_stats,
        kv_dtype=str(lane.k.dtype).removeprefix("torch."),
        row_bytes=unit,
    )
    layers = []
    for layer in range(layout.num_layers):
        place = layout.layer_places.get(layer)
        if place is None:
            layers.append(LayerStats(layer, "full", None, full_running, total))
        else:
            group = group_stats[place.group]
            entries = (group.rows - group.score_rows) // group.columns
            layers.append(LayerStats(layer, state.resolved.kinds[layer], group.budget, entries, total))
    dense = sum(dense_kv_bytes(int(n), layout.num_layers, bpt, page) for n in state.requests.length[running])
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
        host_syncs=state.counters.host_syncs,
        decode_refills=state.counters.decode_refills,
        heap_refills=state.heap.refills,
        release_waits=state.counters.release_waits,
        setting_waits=state.counters.setting_waits,
        scoring_passes_peak=state.counters.scoring_passes_peak,
        evictions_per_step_peak=state.counters.evictions_per_step_peak,
        guide_rows_peak=state.counters.guide_rows_peak,
        guide_waits=state.counters.guide_waits,
        prefill_sentence_ends=0 if state.sentence_marks is None else int(state.sentence_marks.counted),
        requests_by_setting=dict(state.counters.requests_by_setting),
    )


#: Fields each tensor-parallel rank holds for its own KV heads: they add up over a replica's ranks.
RANK_BYTES: tuple[str, ...] = ("kv_bytes_in_use", "kv_bytes_if_dense")

_REQUEST_COUNTS = (
    "prefix_hits",
    "prefix_tokens_reused",
    "chunks_stored",
    "store_entries_adopted",
    "requests_running",
    "requests_running_peak",
    "forward_plans",
    "evictions",
    "host_syncs",
    "decode_refills",
    "heap_refills",
    "release_waits",
    "setting_waits",
    "guide_waits",
    "prefill_sentence_ends",
)
_HEAP_COUNTS = ("rows_total", "free", "full_running", "full_cached", "sparse", "prefix_store", "evicting", "releasing")

#: Fields that add up over data-parallel replicas (each counts its own requests and rows), as
#: paths into the wire format; a list in a path means every element of that list.
REPLICA_COUNTS: tuple[tuple[str, ...], ...] = (
    *((name,) for name in (*RANK_BYTES, *_REQUEST_COUNTS)),
    *(("heap", name) for name in _HEAP_COUNTS),
    ("heap", "groups", "rows"),
    ("heap", "groups", "score_rows"),
    ("layers", "slots_in_use"),
    ("layers", "slots_total"),
)

#: Most differences between ranks a stats reply lists.
MAX_DIFFERENCES = 20

_LISTS = {"groups", "layers"}


def describe_tables(state: SparseState) -> str:
    """The entry tables' size, for the start-up log: a request's line is as wide as the largest
    budget a request may ask for (`max_request_budget`), in every group."""
    host, device, widths = _table_sizes(state)
    return (
        f"entry tables: {state.requests.size} requests x {widths} entries: "
        f"{host / 2**20:.1f} MiB on the host, {device / 2**20:.1f} MiB on the device"
    )


def _table_sizes(state: SparseState) -> tuple[int, int, str]:
    """The entry tables' bytes on the host and on the device, and each group's width."""
    host = sum(g.table.table.nbytes + g.score_table.nbytes for g in state.groups)
    device = sum(g.device_table.nbytes + g.device_scores.nbytes for g in state.groups)
    return host, device, ", ".join(str(g.table.max_entries) for g in state.groups) or "none"


#: Entry tables on the device above this share of the heap's K/V bytes draw a start-up warning:
#: they are sized request slots x the widest budget a request may ask for, and take device memory
#: SGLang's pool sizing did not count.
TABLE_WARNING_SHARE = 0.5


def table_warning(state: SparseState) -> str | None:
    """A start-up warning when the entry tables are large beside the heap (`TABLE_WARNING_SHARE`),
    naming what sizes them; None otherwise."""
    heap = sum(lane.k.nbytes + lane.v.nbytes for lane in state.lanes)
    host, device, widths = _table_sizes(state)
    if device <= TABLE_WARNING_SHARE * heap:
        return None
    return (
        f"warning: the entry tables take {device / 2**20:.0f} MiB of device memory ({device / heap:.0%} of the "
        f"heap's K/V bytes) and {host / 2**20:.0f} MiB on the host: {state.requests.size} request slots "
        f"(--max-running-requests) x {widths} entries (--kvsparse-max-request-budget and the evict page); "
        "lower either to shrink them"
    )


def _add(total: Any, part: Any, path: tuple[str, ...]) -> None:
    """Add `part`'s value at `path` into `total` (same structure), through lists element-wise."""
    head, rest = path[0], path[1:]
    if not rest:
        total[head] += part[head]
    elif head in _LISTS:
        for total_item, part_item in zip(total[head], part[head], strict=True):
            _add(total_item, part_item, rest)
    else:
        _add(total[head], part[head], rest)


def _differences(first: Any, other: Any, where: str = "") -> list[str]:
    """Where two values of the wire format disagree, as 'path: a != b'."""
    if isinstance(first, dict) and isinstance(other, dict):
        found = []
        for key in sorted(set(first) | set(other)):
            found += _differences(first.get(key), other.get(key), f"{where}.{key}" if where else key)
        return found
    if isinstance(first, list) and isinstance(other, list) and len(first) == len(other):
        return [d for i, (a, b) in enumerate(zip(first, other)) for d in _differences(a, b, f"{where}[{i}]")]
    return [] if first == other else [f"{where}: {first!r} != {other!r}"]


def _counts(stats: dict[str, Any]) -> dict[str, Any]:
    """A rank's stats without the fields that are its own KV heads' share."""
    return {key: value for key, value in stats.items() if key not in RANK_BYTES}


def combine_tp_ranks(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """One replica's stats from its tensor-parallel ranks' (rank order): rank 0's counts, the
    bytes of every rank added up, and whether every rank's counts agree with rank 0's
    (`in_step`; `differences` names the first `MAX_DIFFERENCES` fields that do not)."""
    if not ranks:
        raise ValueError("no rank stats to combine")
    total = copy.deepcopy(ranks[0])
    if not total.get("enabled", False):
        return total
    differences = []
    for i, rank in enumerate(ranks[1:], 1):
        differences += [f"tp rank {i}: {d}" for d in _differences(_counts(ranks[0]), _counts(rank))]
        for name in RANK_BYTES:
            total[name] += rank[name]
    total.update(tp_size=len(ranks), in_step=not differences, differences=differences[:MAX_DIFFERENCES], tp_ranks=ranks)
    return total


def combine_replicas(replicas: list[dict[str, Any]]) -> dict[str, Any]:
    """The server's stats from its data-parallel replicas' (`combine_tp_ranks` outputs): every
    count and byte added up, the configuration and layout of the first; each replica's own stats
    under `replicas`."""
    if not replicas:
        raise ValueError("no replica stats to combine")
    total = copy.deepcopy(replicas[0])
    if not total.get("enabled", False):
        return total
    for replica in replicas[1:]:
        for path in REPLICA_COUNTS:
            _add(total, replica, path)
        by_setting = total["requests_by_setting"]
        for setting, count in replica["requests_by_setting"].items():
            by_setting[setting] = by_setting.get(setting, 0) + count
    total.pop("tp_ranks", None)
    total.update(
        dp_size=len(replicas),
        in_step=all(replica["in_step"] for replica in replicas),
        differences=[f"dp rank {i}, {d}" for i, r in enumerate(replicas) for d in r["differences"]][:MAX_DIFFERENCES],
        replicas=replicas,
    )
    return total


__all__ = [
    "GroupStats",
    "HeapStats",
    "LayerStats",
    "SparseStats",
    "collect",
    "combine_replicas",
    "combine_tp_ranks",
]
