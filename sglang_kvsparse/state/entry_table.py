"""Each request's entries in one group of sparse layers: the heap rows they are in (no SGLang
imports).

A group's requests hold the same number of entries in every column of the group (its layers
advance in lockstep), so one table serves them all: `table[req_idx, j, c]` is the heap row holding
entry j of the request at `req_idx` in column c. Entries come in whole heap pages: entries
j..j+P-1 of a column share one page. The table only records heap rows; taking them from the heap
and giving them back is the caller's job (`SparseState`), so every owner of heap rows goes
through one free list.

State is on the host: the scheduler plans from it without waiting on a device, and each forward
gets the few index tensors it needs (`planning.py`).
"""

from __future__ import annotations

import torch

from sglang_kvsparse.state.layout import round_up


class HeapError(RuntimeError):
    """Misuse of the heap's bookkeeping (a bug in the caller, not back-pressure)."""


class HeapExhausted(HeapError):
    """The heap could not give rows that admission had promised."""


class EntryTable:
    """Per request index: its entries' heap rows in each column, in position order.

    Invariant: an active request of `count` entries holds exactly ceil(count / page_size) pages per column.
    """

    def __init__(self, max_requests: int, max_entries: int, columns: int, page_size: int) -> None:
        if max_requests < 1 or max_entries < 1 or columns < 1 or page_size < 1:
            raise ValueError(f"need positive sizes, got {max_requests}, {max_entries}, {columns}, {page_size}")
        self.max_requests = max_requests
        self.max_entries = max_entries
        self.columns = columns
        self.page_size = page_size
        self.capacity = round_up(max_entries, page_size)
        self.table = torch.zeros(max_requests, self.capacity, columns, dtype=torch.int64)
        self.counts = torch.zeros(max_requests, dtype=torch.int64)
        self.active = torch.zeros(max_requests, dtype=torch.bool)

    # -- queries ---------------------------------------------------------------------------
    def is_active(self, req_idx: int) -> bool:
        self._check(req_idx)
        return bool(self.active[req_idx])

    def count(self, req_idx: int) -> int:
        self._require_active(req_idx)
        return int(self.counts[req_idx])

    def entries(self, req_idx: int) -> torch.Tensor:
        """The request's entries' heap rows [count, columns], in position order (a copy)."""
        self._require_active(req_idx)
        return self.table[req_idx, : int(self.counts[req_idx])].clone()

    def active_requests(self) -> torch.Tensor:
        """The request indices holding entries."""
        return torch.nonzero(self.active).flatten()

    def pages_for(self, count: int) -> int:
        """Heap pages a request of `count` entries holds, over all columns."""
        return round_up(count, self.page_size) // self.page_size * self.columns

    def rows_held(self) -> int:
        """Heap rows every active request holds together."""
        pages = (self.counts[self.active] + self.page_size - 1) // self.page_size
        return int(pages.sum()) * self.page_size * self.columns

    # -- updates ---------------------------------------------------------------------------
    def assign(self, req_idx: int, count: int, rows: torch.Tensor) -> None:
        """Give an idle request `count` entries held in heap `rows` (`pages_for(count)` pages,
        page by page, columns of one page position side by side)."""
        self._check(req_idx)
        if self.active[req_idx]:
            raise HeapError(f"request {req_idx} already holds entries; release it first")
        if not 0 <= count <= self.max_entries:
            raise HeapError(f"assign of {count} entries to request {req_idx}: must be in 0..{self.max_entries}")
        held = round_up(count, self.page_size)
        if rows.numel() != held * self.columns:
            raise HeapError(f"assign of {count} entries needs {held * self.columns} rows, got {rows.numel()}")
        self.table[req_idx, :held] = self._as_entries(rows)
        self.counts[req_idx] = count
        self.active[req_idx] = True

    def needing_page(self, req_indices: torch.Tensor) -> torch.Tensor:
        """Of these requests (about to append one entry each), those whose last page is full."""
        return req_indices[self.counts[req_indices] % self.page_size == 0]

    def append(self, req_indices: torch.Tensor, new_rows: torch.Tensor) -> None:
        """Append one entry to each of these requests (distinct, active); heap `new_rows` holds a
        fresh page per column for each of `needing_page(req_indices)`, in that order."""
        if req_indices.numel() == 0:
            return
        if req_indices.unique().numel() != req_indices.numel():
            raise HeapError("append: a request is listed twice")
        if not bool(self.active[req_indices].all()):
            raise HeapError("append to a request that holds no entries")
        if bool((self.counts[req_indices] >= self.max_entries).any()):
            raise HeapError(f"append to a full request ({self.max_entries} entries): evict first")
        growing = self.needing_page(req_indices)
        if new_rows.numel() != growing.numel() * self.page_size * self.columns:
            raise HeapError(f"append needs {growing.numel()} pages per column, got {new_rows.numel()} rows")
        if growing.numel():
            positions = self.counts[growing][:, None] + torch.arange(self.page_size)
            pages = new_rows.view(growing.numel(), self.page_size * self.columns)
            self.table[growing[:, None], positions] = pages.view(-1, self.columns, self.page_size).transpose(1, 2)
        self.counts[req_indices] += 1

    def last_entries(self, req_indices: torch.Tensor) -> torch.Tensor:
        """The newest entry's heap row of each of these requests, [len(req_indices), columns]."""
        return self.table[req_indices, self.counts[req_indices] - 1]

    def shrink(self, req_idx: int, count: int) -> torch.Tensor:
        """Cut the request to its first `count` entries; returns the heap rows of the whole pages
        past them (for the caller to give back)."""
        self._require_active(req_idx)
        old = int(self.counts[req_idx])
        if not 0 <= count <= old:
            raise HeapError(f"shrink of request {req_idx} to {count}: must be in 0..{old}")
        keep, held = round_up(count, self.page_size), round_up(old, self.page_size)
        freed = self._as_pages(self.table[req_idx, keep:held])
        self.table[req_idx, keep:held] = 0
        self.counts[req_idx] = count
        return freed

    def release(self, req_idx: int) -> torch.Tensor:
        """Every heap row the request holds; its line becomes idle."""
        freed = self.shrink(req_idx, 0)
        self.active[req_idx] = False
        return freed

    # -- internals -------------------------------------------------------------------------
    def _as_entries(self, rows: torch.Tensor) -> torch.Tensor:
        """Page-major heap rows (a page per column for each page position) as [entries, columns]."""
        pages = rows.view(-1, self.columns, self.page_size)
        return pages.transpose(1, 2).reshape(-1, self.columns)

    def _as_pages(self, entries: torch.Tensor) -> torch.Tensor:
        """The inverse of `_as_entries`: [entries, columns] as page-major heap rows."""
        pages = entries.view(-1, self.page_size, self.columns).transpose(1, 2)
        return pages.reshape(-1).clone()

    def _check(self, req_idx: int) -> None:
        if not 0 <= req_idx < self.max_requests:
            raise HeapError(f"request index {req_idx} is outside 0..{self.max_requests - 1}")

    def _require_active(self, req_idx: int) -> None:
        self._check(req_idx)
        if not self.active[req_idx]:
            raise HeapError(f"request {req_idx} holds no entries (never assigned or already released)")
