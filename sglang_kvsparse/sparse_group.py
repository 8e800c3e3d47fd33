"""One lane of the heap's K/V buffers, and one group of sparse columns: its requests' entry and
score tables, their device mirrors and pending evictions (no SGLang imports)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_kvsparse.entry_table import EntryTable
from sglang_kvsparse.layout import GroupSpec


@dataclass(frozen=True)
class LaneBuffers:
    """One lane of the heap: a layer position's K/V in every row, and the float32 score view of
    its K bytes (score slot s of row r: s in [r * per_row, (r + 1) * per_row)).

    With full layers, lane i *is* full layer i's buffer in SGLang's pool."""

    k: torch.Tensor  # [rows + page, H_kv, D]
    v: torch.Tensor
    scores: torch.Tensor  # [(rows + page) * per_row, H_kv] float32, a view of k

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> LaneBuffers:
        """The lane of these K/V buffers, with the score view of `k`."""
        return cls(k, v, k.view(torch.float32).view(-1, k.shape[1]))


@dataclass
class SparseGroup:
    """One group of sparse columns: its spec, its requests' entries and pending evictions."""

    spec: GroupSpec
    table: EntryTable
    #: First global column index of the group (columns are numbered across groups).
    first_column: int
    #: Request index -> heap rows of its scores, [columns, score rows of the widest request]
    #: (0: none; a request holds those of its own `max_entries`, the rest stay 0).
    score_table: torch.Tensor
    #: What the decode kernels read, on the lanes' device (int32): `table.table` and
    #: `score_table`, brought up to date by the next forward's plan wherever the host tables
    #: changed what a reader sees (a new request's entries and score rows, a page appended), so a
    #: step copies only those few entries, in the plan's one upload (`stale_entries`).
    device_table: torch.Tensor
    device_scores: torch.Tensor
    #: Request index -> its entries before this step's eviction, [its max_entries, columns].
    evictions: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Host-table changes the device tables do not have yet: requests (indices) whose entries
    #: and score rows changed, and (request indices, first positions) of pages appended.
    stale_requests: list[torch.Tensor] = field(default_factory=list)
    stale_pages: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def mirror_requests(self, req_indices: torch.Tensor) -> None:
        """These requests' entries and score rows changed (a prefill): the next plan copies them."""
        if req_indices.numel():
            self.stale_requests.append(req_indices.clone())

    def mirror_pages(self, req_indices: torch.Tensor, starts: torch.Tensor) -> None:
        """Request req_indices[i] got the page starting at position starts[i]: the next plan
        copies it."""
        if req_indices.numel():
            self.stale_pages.append((req_indices.clone(), starts.clone()))

    def stale_entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(flat indices into `device_table`, their values, flat indices into `device_scores`,
        their values), all host, from the host tables as they are now (a place changed twice is
        copied once, at its last value); the pending changes are forgotten."""
        table, page = self.table, self.table.page_size
        width = table.capacity * self.columns
        entry_parts = []
        for req_indices in self.stale_requests:
            lengths = (table.lengths[req_indices] + page - 1) // page * page
            entry_parts.append(_line_spans(req_indices, lengths * self.columns, width))
        for req_indices, starts in self.stale_pages:
            first = req_indices * width + starts * self.columns
            entry_parts.append((first[:, None] + torch.arange(page * self.columns)).reshape(-1))
        entries = torch.cat(entry_parts).unique() if entry_parts else torch.empty(0, dtype=torch.int64)
        scores = torch.empty(0, dtype=torch.int64)
        if self.stale_requests:
            score_width = self.score_table[0].numel()
            req_indices = torch.cat(self.stale_requests).unique()
            scores = (req_indices[:, None] * score_width + torch.arange(score_width)).reshape(-1)
        self.stale_requests.clear()
        self.stale_pages.clear()
        return entries, table.table.view(-1)[entries], scores, self.score_table.view(-1)[scores]

    @property
    def columns(self) -> int:
        return len(self.spec.columns)


def _line_spans(lines: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """Flat indices of the first counts[i] elements of line lines[i] of a [*, width] table."""
    starts = (lines * width).repeat_interleave(counts)
    offsets = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
    return starts + offsets
