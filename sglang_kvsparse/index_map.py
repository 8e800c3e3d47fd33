"""Slot pools and per-request index maps of the sparse layers (bookkeeping only, no K/V data).

Each sparse layer has its own `SlotPool` (the slots of that layer's compact K/V buffer) and its
own `LayerIndexMap` (for every running request row, the slots it keeps in that layer, in order).
Full layers are not here: they use SGLang's own `req_to_token` and pool.

Conventions, chosen to match SGLang's paged token pools:
  * Slots are handed out in whole pages of `page_size` consecutive slot ids; page p owns slots
    p * page_size .. p * page_size + page_size - 1.
  * Page 0 is reserved as padding and never handed out: a K/V buffer for a pool of `num_slots`
    usable slots has `num_slots + page_size` rows (`SlotPool.buffer_slots`), and table entries
    past a row's pages are 0, so a kernel that reads a padded entry reads harmless data.
  * Position i of a row is always slot `pages[i // page_size] * page_size + i % page_size`: a
    row's slot ids never move. Compaction and eviction move K/V *data* into the first positions
    and then `shrink` the row; only whole trailing pages are freed.

Failure policy: `SlotPool.alloc_pages` returns None when the pool cannot serve the request (as
SGLang's allocators do), so an admission path can test and back off. `LayerIndexMap` operations
raise `SlotPoolExhausted` instead, leaving the state unchanged: admission must have reserved the
room before a request is assigned or decoded, so running out there is a bug, not back-pressure.
Use `pages_needed_to_append` / `SlotPool.available_pages` to check first. Misuse (unknown or
already released row, length beyond capacity, freeing slots not in use) raises `IndexMapError`.

State is authoritative on the CPU (a host copy of the table and Python lengths, so bookkeeping
never waits on a device); `table` and `lengths` are the device tensors kernels read, updated by
the same operations.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from sglang_kvsparse.config import ResolvedSparsity


class IndexMapError(RuntimeError):
    """Misuse of a pool or an index map (a bookkeeping bug in the caller)."""


class SlotPoolExhausted(IndexMapError):
    """An index-map operation needed more pages than its layer's pool had free."""


def round_up(value: int, multiple: int) -> int:
    """Smallest multiple of `multiple` that is >= value."""
    return -(-value // multiple) * multiple


class SlotPool:
    """Free list of one sparse layer's slots, handed out and returned in whole pages.

    Pages 1..num_slots // page_size are allocatable; page 0 is padding (see module doc).
    Invariant: every allocatable page is either on the free stack or marked in use, never both.
    """

    def __init__(self, num_slots: int, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if num_slots < 0 or num_slots % page_size:
            raise ValueError(f"num_slots must be a non-negative multiple of page_size {page_size}, got {num_slots}")
        self.page_size = page_size
        self.num_pages = num_slots // page_size
        # Stack of free page ids; the top is at index _top - 1. Reversed so low ids go first.
        self._free = torch.arange(self.num_pages, 0, -1, dtype=torch.int64)
        self._top = self.num_pages
        self._in_use = torch.zeros(self.num_pages + 1, dtype=torch.bool)

    @property
    def num_slots(self) -> int:
        """Usable slots (excluding the padding page)."""
        return self.num_pages * self.page_size

    @property
    def buffer_slots(self) -> int:
        """Rows the layer's K/V buffer needs: usable slots plus the padding page."""
        return (self.num_pages + 1) * self.page_size

    def available_pages(self) -> int:
        return self._top

    def available_slots(self) -> int:
        return self._top * self.page_size

    def slots_in_use(self) -> int:
        return self.num_slots - self.available_slots()

    def alloc_pages(self, n_pages: int) -> torch.Tensor | None:
        """Slots of `n_pages` free pages (int64, page by page, ascending within a page).

        Returns None, changing nothing, when fewer than `n_pages` pages are free.
        """
        if n_pages < 0:
            raise ValueError(f"n_pages must be >= 0, got {n_pages}")
        if n_pages > self._top:
            return None
        pages = self._free[self._top - n_pages : self._top].flip(0)  # top of stack first
        self._top -= n_pages
        self._in_use[pages] = True
        return self._page_slots(pages)

    def free(self, slots: torch.Tensor) -> None:
        """Return whole pages, given as their slots in page order (as alloc_pages gave them).

        Raises IndexMapError, changing nothing, for a partial page, the padding page, or a page
        that is not in use (double free).
        """
        pages = self._pages_of(slots)
        if pages.numel() == 0:
            return
        if not bool(self._in_use[pages].all()) or pages.unique().numel() != pages.numel():
            raise IndexMapError("freeing a page that is not in use (double free?)")
        self._in_use[pages] = False
        self._free[self._top : self._top + pages.numel()] = pages
        self._top += pages.numel()

    def _page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        offsets = torch.arange(self.page_size, dtype=torch.int64)
        return (pages[:, None] * self.page_size + offsets).reshape(-1)

    def _pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        slots = slots.to(device="cpu", dtype=torch.int64).reshape(-1)
        if slots.numel() % self.page_size:
            raise IndexMapError(f"{slots.numel()} slots is not a whole number of pages of {self.page_size}")
        pages = slots[:: self.page_size] // self.page_size
        if pages.numel() and not bool(((pages >= 1) & (pages <= self.num_pages)).all()):
            raise IndexMapError("slot outside the pool (or in the padding page 0)")
        if not torch.equal(self._page_slots(pages), slots):
            raise IndexMapError("slots do not form whole pages in page order")
        return pages


class LayerIndexMap:
    """For each request row, the slots it keeps in one sparse layer, in position order.

    `table` is an int32 tensor [max_requests, row_capacity] on `device` and `lengths` an int32
    tensor [max_requests]: a kernel builds kv_indices as table[row, :lengths[row]]. Entries of the
    row's last, partly filled page past its length hold that page's reserved slots; entries past
    its pages are 0, the padding slot. `max_entries` (budget + evict_page, from
    ResolvedSparsity.max_entries) bounds every row; row_capacity is it rounded up to pages.
    Invariant: an active row of length L holds exactly ceil(L / page_size) pages.
    """

    def __init__(self, pool: SlotPool, max_requests: int, max_entries: int, device: str | torch.device = "cpu") -> None:
        if max_requests < 1 or max_entries < 1:
            raise ValueError(f"max_requests and max_entries must be >= 1, got {max_requests}, {max_entries}")
        self.pool = pool
        self.page_size = pool.page_size
        self.max_requests = max_requests
        self.max_entries = max_entries
        self.row_capacity = round_up(max_entries, self.page_size)
        self.device = torch.device(device)
        self._table = torch.zeros(max_requests, self.row_capacity, dtype=torch.int32)
        self._lengths = [0] * max_requests
        self._active = [False] * max_requests
        on_cpu = self.device.type == "cpu"
        self.table = self._table if on_cpu else self._table.to(self.device)
        self.lengths = torch.zeros(max_requests, dtype=torch.int32, device=self.device)

    # -- queries ---------------------------------------------------------------------------
    def is_active(self, row: int) -> bool:
        self._check_row(row)
        return self._active[row]

    def length(self, row: int) -> int:
        self._require_active(row)
        return self._lengths[row]

    def slots(self, row: int) -> torch.Tensor:
        """The row's slots in position order (int64, CPU; a copy)."""
        self._require_active(row)
        return self._table[row, : self._lengths[row]].to(torch.int64)

    def active_rows(self) -> list[int]:
        return [row for row, active in enumerate(self._active) if active]

    def slots_in_use(self) -> int:
        return self.pool.slots_in_use()

    def pages_needed_to_append(self, row: int) -> int:
        """1 when the next append must allocate a page, else 0."""
        self._require_active(row)
        return 1 if self._lengths[row] % self.page_size == 0 else 0

    # -- updates ---------------------------------------------------------------------------
    def assign(self, row: int, n: int) -> torch.Tensor:
        """Give an idle row its first n entries (after prefill compaction); returns their slots.

        n may be 0 (the row becomes active and holds nothing). Raises IndexMapError if the row
        is active or n > max_entries, SlotPoolExhausted if the pool lacks the pages.
        """
        self._check_row(row)
        if self._active[row]:
            raise IndexMapError(f"row {row} already holds slots; release it first")
        if not 0 <= n <= self.max_entries:
            raise IndexMapError(f"assign of {n} entries to row {row}: must be in 0..{self.max_entries}")
        slots = self._alloc(round_up(n, self.page_size) // self.page_size)
        self._table[row, : slots.numel()] = slots.to(torch.int32)
        self._active[row] = True
        self._lengths[row] = n
        self._publish([row])
        return slots[:n]

    def append(self, row: int) -> int:
        """Add one decode token to the row; returns its slot, allocating a page when needed."""
        return int(self.append_rows([row])[0])

    def append_rows(self, rows: Sequence[int]) -> torch.Tensor:
        """Append one token to each of `rows` (distinct) at once; returns their slots (int64).

        The batched form of append for a decode step: one allocation and one device update for
        the whole batch. All-or-nothing: on any error nothing changes.
        """
        if len(set(rows)) != len(rows):
            raise IndexMapError("append_rows: a row is listed twice")
        for row in rows:
            self._require_active(row)
            if self._lengths[row] >= self.max_entries:
                raise IndexMapError(f"row {row} is full ({self.max_entries} entries): evict before appending")
        growing = [row for row in rows if self._lengths[row] % self.page_size == 0]
        new_slots = self._alloc(len(growing))
        page_starts = dict(zip(growing, new_slots[:: self.page_size].tolist()))
        result = torch.empty(len(rows), dtype=torch.int64)
        for i, row in enumerate(rows):
            pos = self._lengths[row]
            if row in page_starts:
                start = page_starts[row]
                self._table[row, pos : pos + self.page_size] = torch.arange(start, start + self.page_size, dtype=torch.int32)
            result[i] = int(self._table[row, pos])
            self._lengths[row] = pos + 1
        self._publish(rows)
        return result

    def shrink(self, row: int, new_len: int) -> torch.Tensor:
        """Cut the row to its first new_len entries and free the whole pages past them.

        Call after eviction or compaction has moved the survivors' data into positions
        0..new_len-1. Returns the freed slots (int64).
        """
        self._require_active(row)
        old_len = self._lengths[row]
        if not 0 <= new_len <= old_len:
            raise IndexMapError(f"shrink of row {row} to {new_len}: must be in 0..{old_len}")
        keep = round_up(new_len, self.page_size)
        held = round_up(old_len, self.page_size)
        freed = self._table[row, keep:held].to(torch.int64)
        self.pool.free(freed)
        self._table[row, keep:held] = 0
        self._lengths[row] = new_len
        self._publish([row])
        return freed

    def release(self, row: int) -> int:
        """Return every slot of the row (request finished, aborted or retracted); returns count.

        Raises IndexMapError for a row that holds nothing (double release).
        """
        self._require_active(row)
        n_slots = round_up(self._lengths[row], self.page_size)
        self.shrink(row, 0)
        self._active[row] = False
        return n_slots

    # -- internals -------------------------------------------------------------------------
    def _alloc(self, n_pages: int) -> torch.Tensor:
        slots = self.pool.alloc_pages(n_pages)
        if slots is None:
            raise SlotPoolExhausted(
                f"needs {n_pages} pages, {self.pool.available_pages()} free: admission let in more than fits"
            )
        return slots

    def _publish(self, rows: Iterable[int]) -> None:
        """Copy the rows' table entries and lengths to the device tensors."""
        rows = list(rows)
        index = torch.tensor(rows, dtype=torch.int64)
        lengths = torch.tensor([self._lengths[row] for row in rows], dtype=torch.int32)
        self.lengths[index.to(self.device)] = lengths.to(self.device)
        if self.table is not self._table:
            self.table[index.to(self.device)] = self._table[index].to(self.device)

    def _check_row(self, row: int) -> None:
        if not 0 <= row < self.max_requests:
            raise IndexMapError(f"row {row} is outside 0..{self.max_requests - 1}")

    def _require_active(self, row: int) -> None:
        self._check_row(row)
        if not self._active[row]:
            raise IndexMapError(f"row {row} holds no slots (never assigned or already released)")


class SparseIndexMaps:
    """The index maps of all sparse layers of one model, by layer id."""

    def __init__(self, maps: Mapping[int, LayerIndexMap]) -> None:
        self.maps = dict(sorted(maps.items()))

    @classmethod
    def build(
        cls,
        resolved: ResolvedSparsity,
        slots_per_layer: Mapping[int, int],
        *,
        max_requests: int,
        page_size: int = 1,
        device: str | torch.device = "cpu",
    ) -> SparseIndexMaps:
        """One pool and map per sparse layer of `resolved`, pools sized by `slots_per_layer`
        (e.g. accounting.split_pool(...).sparse_slots), rows bounded by max_entries(layer)."""
        missing = set(resolved.sparse_layers) - set(slots_per_layer)
        if missing:
            raise ValueError(f"no pool size for sparse layers {sorted(missing)}")
        return cls(
            {
                layer: LayerIndexMap(
                    SlotPool(slots_per_layer[layer], page_size),
                    max_requests,
                    resolved.max_entries(layer),
                    device,
                )
                for layer in resolved.sparse_layers
            }
        )

    def __getitem__(self, layer: int) -> LayerIndexMap:
        return self.maps[layer]

    def __contains__(self, layer: object) -> bool:
        return layer in self.maps

    @property
    def layers(self) -> tuple[int, ...]:
        return tuple(self.maps)

    def release(self, row: int) -> int:
        """Release the row in every layer where it holds slots; returns the slots freed.

        A request may be aborted before every layer was assigned, so inactive layers are skipped;
        a row active in no layer is a double release and raises IndexMapError.
        """
        active = [m for m in self.maps.values() if m.is_active(row)]
        if not active:
            raise IndexMapError(f"row {row} holds no slots in any sparse layer (double release?)")
        return sum(m.release(row) for m in active)

    def slots_in_use(self) -> dict[int, int]:
        return {layer: m.slots_in_use() for layer, m in self.maps.items()}

    def slots_total(self) -> dict[int, int]:
        return {layer: m.pool.num_slots for layer, m in self.maps.items()}
