"""The one KV heap as the sparse layers take and give its rows (no SGLang imports).

Every heap row is free or held by one owner: SGLang's full-pool ids, request entries and score
rows (`EntryTable`, `SparseGroup`), prefix-store blocks. `Heap` is the one way the sparse layers
take and give rows: over the raw rows of SGLang's allocator (`contracts.HeapRows`; the project's
free rows live on the host, `HostFreeList`, so that a decode step never reads a device value),
with one order of making room for every owner (free rows, the prefix store's least recently used
blocks, SGLang's radix tree, SGLang's frees still on their way to the host), and the rows a
forward still reads given back only once it has been issued (`defer`, `finish_forward`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import torch

from sglang_kvsparse.state.contracts import HeapRows
from sglang_kvsparse.state.entry_table import HeapExhausted
from sglang_kvsparse.state.prefix_store import PrefixStore
from sglang_kvsparse.state.released_ids import ReleasedIds


class HostFreeList:
    """Free heap rows on the host, whole pages: given back in chunks, taken from the front. A
    give appends its chunk (no copy of what is already there: the list can hold millions of
    rows, the running requests' reserve); a take joins only the chunks it needs."""

    def __init__(self) -> None:
        self._chunks: deque[torch.Tensor] = deque()
        self.rows = 0

    def give(self, rows: torch.Tensor) -> None:
        if rows.numel():
            self._chunks.append(rows.reshape(-1).to(torch.int64))
            self.rows += rows.numel()

    def take(self, rows: int) -> torch.Tensor:
        """The first `rows` free rows (at most `self.rows`)."""
        parts, need = [], min(rows, self.rows)
        while need:
            chunk = self._chunks.popleft()
            if chunk.numel() > need:
                self._chunks.appendleft(chunk[need:])
                chunk = chunk[:need]
            parts.append(chunk)
            need -= chunk.numel()
        taken = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        self.rows -= taken.numel()
        return taken

    def clear(self) -> None:
        self._chunks.clear()
        self.rows = 0


class Heap:
    """Rows of the one KV heap for the sparse layers: take, give, make room, defer to the end
    of the forward."""

    def __init__(
        self,
        rows: HeapRows,
        store: PrefixStore | None,
        released: ReleasedIds | None,
        describe: Callable[[], str] = lambda: "",
    ) -> None:
        """`rows`: SGLang's allocator, raw. `store` and `released`: the prefix store and SGLang's
        frees on their way to it (None without a store). `describe`: who holds the rows, for the
        error when the heap runs out."""
        self.rows = rows
        self.page_size = rows.page_size
        self.store = store
        self.released = released
        self._describe = describe
        self._deferred: list[torch.Tensor] = []  # rows to give back once the forward has been issued

    @property
    def refills(self) -> int:
        """Times taking rows had to read SGLang's free ids back from the device (a host wait)."""
        return self.rows.refills

    def free_rows(self) -> int:
        return self.rows.free_rows()

    def give(self, rows: torch.Tensor) -> None:
        """Rows (whole pages, a host tensor) back to the free list."""
        self.rows.give(rows)

    def reserve(self, rows: int) -> None:
        """Keep `rows` free rows where taking them never waits on the device (call where the
        host may wait: a prefill's allocation)."""
        self.rows.reserve(rows)

    def take(self, rows: int) -> torch.Tensor:
        """`rows` rows (host) for request entries, making room first; raises HeapExhausted
        (changing nothing held) when even that leaves too few: admission promised more than the
        heap has."""
        self.make_room(rows)
        taken = self.rows.take(rows)
        if taken is None:
            raise HeapExhausted(
                f"the KV heap has {self.free_rows()} free rows for {rows} sparse entries: "
                f"admission let in more than fits ({self._describe()})"
            )
        return taken

    def take_for_store(self, rows: int) -> torch.Tensor:
        """Up to `rows` rows for the prefix store, whole store blocks only, making room first
        (best effort: a cache entry is never a promise)."""
        per_block = self.store.rows_per_block
        self.make_room(rows)
        rows = min(rows, self.free_rows()) // per_block * per_block
        taken = self.rows.take(rows) if rows else None
        return torch.empty(0, dtype=torch.int64) if taken is None else taken

    def take_for_forward(self, rows: int) -> torch.Tensor:
        """`rows` rows (host) that this forward uses and gives back once it has been issued."""
        taken = self.take(rows)
        self.defer(taken)
        return taken

    def defer(self, rows: torch.Tensor) -> None:
        """Give these rows back once the step's forward has been issued (it still reads them)."""
        self._deferred.append(rows)

    def finish_forward(self) -> None:
        """The step's forward has been issued: the rows it still read go back."""
        if self._deferred:
            self.give(torch.cat(self._deferred))
            self._deferred.clear()

    def deferred_rows(self) -> int:
        return sum(rows.numel() for rows in self._deferred)

    def forget_deferred(self) -> None:
        """SGLang reset its allocator: the deferred rows are free already."""
        self._deferred.clear()

    def reclaimable_rows(self) -> int:
        """Rows the prefix store would give back on demand (they count as free)."""
        return self.store.reclaimable_rows() if self.store is not None else 0

    def released_rows(self) -> int:
        """Rows SGLang freed that are on their way back (free, usable once settled)."""
        return self.released.rows if self.released is not None else 0

    def reclaim(self, rows: int) -> None:
        """Give back prefix-store blocks, least recently used first, until `rows` rows are free
        (SGLang's frees that have reached the host first)."""
        if self.released is not None:
            self.released.settle()
        short = rows - self.free_rows()
        if short > 0 and self.store is not None:
            self.give(self.store.reclaim(short))

    def make_room(self, rows: int) -> None:
        """Free rows, then the prefix store's LRU blocks, then SGLang's radix tree, then SGLang's
        frees still on their way to the host (waiting for them)."""
        self.reclaim(rows)
        if self.free_rows() < rows:
            self.rows.evict_cache(rows)
            self.reclaim(rows)
        if self.free_rows() < rows and self.released is not None:
            self.released.settle(wait=True)
