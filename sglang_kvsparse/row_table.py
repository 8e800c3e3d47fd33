"""Each request's heap rows in one group of sparse layers (no SGLang imports).

A group's requests hold the same number of entries in every column of the group (its layers
advance in lockstep), so one table serves them all: `table[row, j, c]` is the heap row holding
entry j of request row `row` in column c. Rows come in whole heap pages: entries j..j+P-1 of a
column share one page. The table only records rows; taking them from the heap and giving them
back is the caller's job (`SparseState`), so every owner of heap rows goes through one free list.

State is on the host: the scheduler plans from it without waiting on a device, and each forward
gets the few index tensors it needs (`planning.py`).
"""

from __future__ import annotations

import torch

from sglang_kvsparse.layout import round_up


class HeapError(RuntimeError):
    """Misuse of the heap's bookkeeping (a bug in the caller, not back-pressure)."""


class HeapExhausted(HeapError):
    """The heap could not give rows that admission had promised."""


class RowTable:
    """Per request row: its entries' heap rows in each column, in position order.

    Invariant: an active row of length L holds exactly ceil(L / page_size) pages per column.
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
        self.lengths = torch.zeros(max_requests, dtype=torch.int64)
        self.active = torch.zeros(max_requests, dtype=torch.bool)

    # -- queries ---------------------------------------------------------------------------
    def is_active(self, row: int) -> bool:
        self._check_row(row)
        return bool(self.active[row])

    def length(self, row: int) -> int:
        self._require_active(row)
        return int(self.lengths[row])

    def entries(self, row: int) -> torch.Tensor:
        """The row's heap rows [length, columns], in position order (a copy)."""
        self._require_active(row)
        return self.table[row, : int(self.lengths[row])].clone()

    def active_rows(self) -> torch.Tensor:
        return torch.nonzero(self.active).flatten()

    def pages_for(self, length: int) -> int:
        """Heap pages a row of `length` entries holds, over all columns."""
        return round_up(length, self.page_size) // self.page_size * self.columns

    def rows_held(self) -> int:
        """Heap rows every active row holds together."""
        pages = (self.lengths[self.active] + self.page_size - 1) // self.page_size
        return int(pages.sum()) * self.page_size * self.columns

    # -- updates ---------------------------------------------------------------------------
    def assign(self, row: int, length: int, rows: torch.Tensor) -> None:
        """Give an idle row `length` entries held in `rows` (`pages_for(length)` pages, page by
        page, columns of one page position side by side)."""
        self._check_row(row)
        if self.active[row]:
            raise HeapError(f"row {row} already holds entries; release it first")
        if not 0 <= length <= self.max_entries:
            raise HeapError(f"assign of {length} entries to row {row}: must be in 0..{self.max_entries}")
        held = round_up(length, self.page_size)
        if rows.numel() != held * self.columns:
            raise HeapError(f"assign of {length} entries needs {held * self.columns} rows, got {rows.numel()}")
        self.table[row, :held] = self._as_entries(rows)
        self.lengths[row] = length
        self.active[row] = True

    def rows_needing_page(self, rows: torch.Tensor) -> torch.Tensor:
        """Of `rows` (about to append one entry each), those whose last page is full."""
        return rows[self.lengths[rows] % self.page_size == 0]

    def append(self, rows: torch.Tensor, new_rows: torch.Tensor) -> None:
        """Append one entry to each of `rows` (distinct, active); `new_rows` holds a fresh page
        per column for each of `rows_needing_page(rows)`, in that order."""
        if rows.numel() == 0:
            return
        if rows.unique().numel() != rows.numel():
            raise HeapError("append: a row is listed twice")
        if not bool(self.active[rows].all()):
            raise HeapError("append to a row that holds no entries")
        if bool((self.lengths[rows] >= self.max_entries).any()):
            raise HeapError(f"append to a full row ({self.max_entries} entries): evict first")
        growing = self.rows_needing_page(rows)
        if new_rows.numel() != growing.numel() * self.page_size * self.columns:
            raise HeapError(f"append needs {growing.numel()} pages per column, got {new_rows.numel()} rows")
        if growing.numel():
            positions = self.lengths[growing][:, None] + torch.arange(self.page_size)
            pages = new_rows.view(growing.numel(), self.page_size * self.columns)
            self.table[growing[:, None], positions] = pages.view(-1, self.columns, self.page_size).transpose(1, 2)
        self.lengths[rows] += 1

    def last_entries(self, rows: torch.Tensor) -> torch.Tensor:
        """The newest entry's heap row of each of `rows`, [len(rows), columns]."""
        return self.table[rows, self.lengths[rows] - 1]

    def shrink(self, row: int, length: int) -> torch.Tensor:
        """Cut the row to its first `length` entries; returns the heap rows of the whole pages
        past them (for the caller to give back)."""
        self._require_active(row)
        old = int(self.lengths[row])
        if not 0 <= length <= old:
            raise HeapError(f"shrink of row {row} to {length}: must be in 0..{old}")
        keep, held = round_up(length, self.page_size), round_up(old, self.page_size)
        freed = self._as_pages(self.table[row, keep:held])
        self.table[row, keep:held] = 0
        self.lengths[row] = length
        return freed

    def release(self, row: int) -> torch.Tensor:
        """Every heap row the row holds; the row becomes idle."""
        freed = self.shrink(row, 0)
        self.active[row] = False
        return freed

    # -- internals -------------------------------------------------------------------------
    def _as_entries(self, rows: torch.Tensor) -> torch.Tensor:
        """Page-major rows (a page per column for each page position) as [entries, columns]."""
        pages = rows.view(-1, self.columns, self.page_size)
        return pages.transpose(1, 2).reshape(-1, self.columns)

    def _as_pages(self, entries: torch.Tensor) -> torch.Tensor:
        """The inverse of `_as_entries`: [entries, columns] as page-major rows."""
        pages = entries.view(-1, self.page_size, self.columns).transpose(1, 2)
        return pages.reshape(-1).clone()

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_requests:
            raise HeapError(f"row {row} is outside 0..{self.max_requests - 1}")

    def _require_active(self, row: int) -> None:
        self._check_row(row)
        if not self.active[row]:
            raise HeapError(f"row {row} holds no entries (never assigned or already released)")
