"""Where each layer's K/V lives in the one KV heap, and what a request costs there (no SGLang).

The heap is SGLang's own token pool, made wide enough for everyone (docs/architecture.md, "One
KV heap"). A heap *row* holds one K/V entry in each of `lanes` layer buffers; SGLang's token
allocator hands out rows, and every owner draws from it:

* **full layers** (SGLang's ids): full layer `full_layers[i]` keeps its token at row `id` of lane
  `i`, so SGLang's pool is untouched but for its size;
* **sparse layers**, in *columns* of up to `lanes` layers: entry j of a request in a column is one
  row, and the column's layer on lane m keeps its j-th kept key there. Columns with the same
  budget form a `GroupSpec`; its requests advance in lockstep, so one table serves all its columns;
* **sliding layers** (the model's sliding-window layers), in columns and groups of their own, as
  sparse layers of budget sliding window + sink whose entries are ranked by recency;
* **the prefix store**: one row per column for each cached prompt token (uncompressed K/V);
* **scores**: a request that can outgrow a group's `max_entries` (so will evict) keeps one float32
  score per KV head for each of its entries, in *score rows*: the K bytes of one row hold
  `scores_per_row` entries' scores in every lane. A request that never evicts keeps none, so below
  the budget a request holds exactly the bytes it holds in stock SGLang.

Why lanes = number of full layers: a row then costs the same bytes whoever owns it, so one free
list serves all owners with no fragmentation and no split to guess. With no full layer there is
one lane, and SGLang's ids still take a row each (they store nothing): the price of one free list.

Columns pair sparse layers of neighbouring budgets (sorted by budget, largest first); a column's
budget is its largest member's, so a pyramid over two lanes keeps its pairs' larger budget.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.config import ResolvedSparsity


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= value."""
    return -(-value // multiple) * multiple


@dataclass(frozen=True)
class Column:
    """Sparse layers sharing heap rows: `layers[m]` is on lane m."""

    layers: tuple[int, ...]


@dataclass(frozen=True)
class GroupSpec:
    """Columns with one budget: each request holds the same number of entries in all of them.

    `max_entries` (budget + evict_page, capped at the context length) bounds every request;
    `score_rows`: rows (whole pages) of one column's scores for a request that evicts.
    `sliding_window`: 0 for sparse layers; for sliding layers the keys their attention reads (the
    last W), which the group keeps for every request whatever its own budget or policy.
    """

    index: int
    budget: int
    max_entries: int
    columns: tuple[Column, ...]
    score_rows: int
    sliding_window: int = 0

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(layer for column in self.columns for layer in column.layers)

    def budgets(self, own: torch.Tensor) -> torch.Tensor:
        """The budgets in this group of requests with these own budgets (0: the group's): the
        group's in a sliding group, whose budget is what its layers' attention reads."""
        if self.sliding_window:
            return torch.full_like(own, self.budget)
        return torch.where(own > 0, own, self.budget)

    def guided(self, resolved: ResolvedSparsity, own: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """Which requests with these own budgets (`budgets`) and whole sequence lengths a
        selecting prefill keeps by the guide here (`ResolvedSparsity.guided`); None where none
        does: without guide layers, and in a sliding group, which keeps by recency."""
        return None if self.sliding_window else resolved.guided(self.budgets(own), seq_lens)

    def columns_on_lane(self, lane: int) -> int:
        """How many columns have a layer on `lane`: they are the group's first ones (only a
        group's last column can hold fewer layers than there are lanes)."""
        count = sum(1 for column in self.columns if len(column.layers) > lane)
        if any(len(column.layers) <= lane for column in self.columns[:count]):
            raise ValueError(f"group {self.index}: a short column before the last")
        return count


@dataclass(frozen=True)
class LayerPlace:
    """Where one sparse layer lives: its group, its column in the group and its lane."""

    group: int
    column: int
    lane: int


@dataclass(frozen=True)
class HeapLayout:
    """Lanes, the full layers' lanes and the sparse layers' groups of one model and config."""

    num_layers: int
    lanes: int
    full_layers: tuple[int, ...]
    groups: tuple[GroupSpec, ...]
    layer_places: dict[int, LayerPlace]
    page_size: int
    scores_per_row: int
    evict_page: int = 1
    context_len: int = 1
    #: Largest budget a request may ask for (`ResolvedSparsity.request_cap`).
    request_cap: int = 0

    @classmethod
    def from_resolved(cls, resolved: ResolvedSparsity, scores_per_row: int, page_size: int = 1) -> HeapLayout:
        """`scores_per_row`: entries whose float32 scores (one per KV head) fit in one row's K
        bytes (`scores_per_row(head_dim, dtype_bytes)`)."""
        full = resolved.full_layers
        lanes = max(len(full), 1)
        groups: list[GroupSpec] = []
        for layers, window in ((resolved.sparse_layers, 0), (resolved.sliding_layers, resolved.sliding_window)):
            ordered = sorted(layers, key=lambda layer: (-resolved.budget(layer), layer))
            chunks = [tuple(ordered[i : i + lanes]) for i in range(0, len(ordered), lanes)]
            by_budget: dict[int, list[Column]] = {}
            for chunk in chunks:
                budget = max(resolved.budget(layer) for layer in chunk)
                by_budget.setdefault(budget, []).append(Column(tuple(sorted(chunk))))
            for budget, columns in sorted(by_budget.items()):
                max_entries = min(budget + resolved.config.evict_page, resolved.context_len)
                score_rows = _score_rows(max_entries, scores_per_row, page_size)
                groups.append(GroupSpec(len(groups), budget, max_entries, tuple(columns), score_rows, window))
        slots = {
            layer: LayerPlace(group.index, c, lane)
            for group in groups
            for c, column in enumerate(group.columns)
            for lane, layer in enumerate(column.layers)
        }
        return cls(
            resolved.num_layers,
            lanes,
            full,
            tuple(groups),
            slots,
            page_size,
            scores_per_row,
            resolved.config.evict_page,
            resolved.context_len,
            resolved.request_cap,
        )

    # -- queries ---------------------------------------------------------------------------
    def is_sparse(self, layer: int) -> bool:
        return layer in self.layer_places

    @property
    def num_columns(self) -> int:
        return sum(len(group.columns) for group in self.groups)

    @property
    def idle_lanes(self) -> int:
        """Lanes the sparse columns leave unused (a last column with fewer layers than lanes)."""
        return sum(self.lanes - len(column.layers) for group in self.groups for column in group.columns)

    def sparse_rows(self, group: GroupSpec, final_len: int, budget: int = 0) -> int:
        """Most heap rows a request reaching `final_len` tokens holds in one group: per column
        min(final_len, max_entries) entries in whole pages, and its score rows if it evicts.
        `budget`: the request's own budget (`request_sparsity.py`), 0 for the group's."""
        max_entries = self.max_entries(group, budget)
        entries = round_up(min(final_len, max_entries), self.page_size)
        scores = self.score_rows(max_entries) if final_len > max_entries else 0
        return len(group.columns) * (entries + scores)

    def max_entries(self, group: GroupSpec, budget: int = 0) -> int:
        """Most entries a request with its own `budget` (0: the group's) holds in the group (a
        sliding group's whatever the request's own)."""
        if not budget or group.sliding_window:
            return group.max_entries
        return min(budget + self.evict_page, self.context_len)

    def score_rows(self, max_entries: int) -> int:
        """Rows (whole pages) of one column's scores for a request holding up to `max_entries`."""
        return _score_rows(max_entries, self.scores_per_row, self.page_size)

    def rows_held(self, seq_len: int, budget: int = 0) -> int:
        """Most heap rows a request of `seq_len` tokens holds: its SGLang ids (one row per token,
        whole pages) and its sparse rows in every group (`budget`: its own, 0 for the groups')."""
        return round_up(seq_len, self.page_size) + sum(self.sparse_rows(g, seq_len, budget) for g in self.groups)

    def guide_rows(self, tokens: int) -> int:
        """Heap rows `tokens` new tokens of a guided prefill wait in, one per sparse column (whole
        pages; sliding columns keep by recency), from the sparse layers' own attention until the
        guide has chosen."""
        return round_up(tokens, self.page_size) * self.guided_columns

    @property
    def guided_columns(self) -> int:
        """Columns of sparse layers: those a guide may choose for (sliding ones never)."""
        return sum(len(group.columns) for group in self.groups if not group.sliding_window)

    def widest_request(self, group: GroupSpec) -> int:
        """Most entries any request holds in the group: its own or the largest request budget's."""
        return max(group.max_entries, self.max_entries(group, self.request_cap))

    def dense_rows(self, seq_len: int) -> float:
        """Stock SGLang's bytes for the same request, in rows: every layer keeps every token."""
        return round_up(seq_len, self.page_size) * self.num_layers / self.lanes

    def longest_fitting(self, rows: int) -> int:
        """The longest request whose `rows_held` is at most `rows` (0 when none fits)."""
        low, high = 0, max(rows, 0)
        while low < high:  # rows_held grows with the length
            mid = (low + high + 1) // 2
            if self.rows_held(mid) <= rows:
                low = mid
            else:
                high = mid - 1
        return low

    def describe(self) -> str:
        """One line for the start-up log."""
        groups = ", ".join(_describe_group(g) for g in self.groups) or "none"
        idle = f"; {self.idle_lanes} lane(s) idle in the last column" if self.idle_lanes else ""
        return (
            f"{self.lanes} lane(s) per heap row; full layers {list(self.full_layers)}; sparse columns: {groups}{idle}"
        )


def _describe_group(group: GroupSpec) -> str:
    sliding = f" (sliding window {group.sliding_window})" if group.sliding_window else ""
    return f"{len(group.columns)} x budget {group.budget}{sliding}"


def _score_rows(max_entries: int, per_row: int, page_size: int) -> int:
    return round_up(-(-max_entries // per_row), page_size)


def scores_per_row(head_dim: int, dtype_bytes: int) -> int:
    """Entries whose scores (one float32 per KV head) fit in one row's K bytes in a lane."""
    return head_dim * dtype_bytes // 4


def heap_rows(total_kv_bytes: int, lanes: int, bytes_per_token: int, page_size: int = 1) -> int:
    """Rows of a heap with `total_kv_bytes`: each row is `lanes` K/V entries of `bytes_per_token`,
    rounded down to whole pages."""
    return total_kv_bytes // (lanes * bytes_per_token) // page_size * page_size


def capacity_ratio(layout: HeapLayout, seq_len: int) -> float:
    """Requests of `seq_len` tokens the heap admits per request stock SGLang admits, at equal bytes,
    before rounding to whole requests."""
    return layout.dense_rows(seq_len) / layout.rows_held(seq_len)


__all__ = [
    "Column",
    "GroupSpec",
    "HeapLayout",
    "LayerPlace",
    "capacity_ratio",
    "heap_rows",
    "round_up",
    "scores_per_row",
]
