"""SGLang's frees of its own ids, on their way to the host for the prefix store (no SGLang imports).

The prefix store is keyed by SGLang's ids (`prefix_store.py`), so when SGLang frees an id (a tree
eviction, a finished request's duplicates, a request without the radix cache) its store entries
must be forgotten before the id is handed out again, and that needs the ids on the host. Reading
them back at once would make the host wait for the device wherever SGLang frees, so each freed
batch is copied to pinned memory without waiting (`device_copy.HostCopy`) and kept off every free
list until it has landed (`settle`): then its store entries are forgotten and its rows join the
heap's host free list. A tree insert's adoptions (duplicates whose entries move to the tree's ids
before the duplicates are forgotten) travel the same way, in order: an insert's frees are queued
after its adoption (`adopting`). On the CPU every copy has landed at once, so nothing waits there.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from sglang_kvsparse.state.contracts import HeapRows
from sglang_kvsparse.state.device_copy import HostCopy
from sglang_kvsparse.state.prefix_store import PrefixStore

if TYPE_CHECKING:
    from sglang_kvsparse.state.counters import Counters


class ReleasedIds:
    """SGLang's freed ids and the tree's adoptions, applied to the store in the order they came."""

    def __init__(self, store: PrefixStore, heap: HeapRows, counters: Counters) -> None:
        self.store, self.heap, self.counters = store, heap, counters
        self._queue: deque[tuple[HostCopy, HostCopy | None, int]] = deque()  # (ids, None, rows) or (ours, theirs, 0)
        self._held_back: list[tuple[HostCopy, HostCopy | None, int]] | None = None
        #: Rows of the queued frees: free, but usable only once settled.
        self.rows = 0

    def freed(self, ids: torch.Tensor) -> None:
        """SGLang freed these ids (whole pages of them, as its allocator frees)."""
        page = self.heap.page_size
        entry = (HostCopy(ids), None, ids.numel() // page * page)
        self.rows += entry[2]
        if self._held_back is not None:
            self._held_back.append(entry)
        else:
            self._queue.append(entry)
            self.settle()

    @contextmanager
    def adopting(self) -> Iterator[None]:
        """Around one insert into SGLang's tree, which frees the duplicates it finds while it
        walks: those frees are queued after the insert's adoption (`adopt`)."""
        self._held_back = []
        try:
            yield
        finally:
            held, self._held_back = self._held_back, None
            self._queue.extend(held)
            self.settle()

    def adopt(self, ours: torch.Tensor, theirs: torch.Tensor) -> None:
        """The tree keeps ids `theirs` for the tokens of ids `ours` (which it frees): their store
        entries move to `theirs` (`PrefixStore.adopt`)."""
        self._queue.append((HostCopy(ours), HostCopy(theirs), 0))
        self.settle()

    def settle(self, wait: bool = False) -> None:
        """Apply what has reached the host, in order; with `wait`, everything (waiting for the
        copies still in flight: counted in `Counters.release_waits`)."""
        while self._queue:
            first, second, rows = self._queue[0]
            landed = first.ready() and (second is None or second.ready())
            if not landed and not wait:
                return
            self.counters.add(release_waits=int(not landed))
            self._queue.popleft()
            if second is not None:
                self.counters.add(store_entries_adopted=self.store.adopt(first.value(), second.value()))
                continue
            ids = first.value().to(torch.int64)
            self.heap.give(self.store.forget(ids))
            page = self.heap.page_size
            pages = (ids // page).unique()
            self.heap.give((pages[:, None] * page + torch.arange(page)).reshape(-1))
            self.rows -= rows

    def clear(self) -> None:
        """SGLang's allocator was reset: every id is free again, nothing is on its way."""
        self._queue.clear()
        self._held_back = None
        self.rows = 0
