"""SGLang's token allocator as the one KV heap (SGLang 0.5.23 allocator capacity hooks).

With sparse layers, SGLang's token pool is sized for the heap (`patches/memory.py`) and its
allocator hands out every heap row: SGLang's own ids (the full layers) and, through `RawHeapRows`,
the sparse layers' entries and the prefix store's blocks. `heap_allocator_class` subclasses the
allocator SGLang built (token or paged) so that SGLang's scheduler sees the whole heap through the
hooks it already calls on every allocator:

* `available_size` counts the prefix store's reclaimable rows and the host's free rows as free, and
  every `alloc*` reclaims store rows and lends host rows to SGLang's own free list before it hands
  out ids, so the store borrows memory without SGLang knowing;
* `free` of SGLang's ids drops their prefix-store entries (the tree no longer holds the token):
  with the store, the ids travel to the host without waiting and join the host's free list once
  their entries are gone (`released_ids.py`);
* `request_slot_reserve` (admission, every path) adds what the prefill being admitted takes in the
  sparse columns (the charge `patches/admission.py` sets for the request, by the prefill's end),
  `check_decode_capacity` (the decode check the retract loop converges on) adds the next step's
  sparse entries, and `max_new_tokens_for_memory` (queue admission) knows what a request of a
  given length holds in the heap, its prefill's peak included.

**Two free lists, one heap.** SGLang keeps its free ids on the device; reading them back makes
the host wait for the device. So the rows the project hands out come from a free list on the host
(`RawHeapRows.host`, `heap.HostFreeList`): every row the project gives back goes there, a prefill's allocation tops it
up from SGLang's list to what the running requests' decode steps may take (`reserve`, where the
host may wait), and SGLang's allocations draw on it when its own list runs short (`lend`: a
pinned, non-blocking copy). A decode step then never reads a device value for its rows.
"""

from __future__ import annotations

from typing import Any

import torch

from sglang_kvsparse.state.admission import prefill_peak_rows, rows_for_next_decode
from sglang_kvsparse.state.device_copy import upload
from sglang_kvsparse.state.heap import HostFreeList
from sglang_kvsparse.state.layout import round_up
from sglang_kvsparse.state.sparse_state import SparseState

from . import context


class RawHeapRows:
    """`HeapRows` over the allocator SGLang built: the project's free rows on the host, and
    SGLang's own free list through its stock methods (bypassing the heap hooks)."""

    def __init__(self, allocator: Any, base: type) -> None:
        self.allocator = allocator
        self.base = base
        self.page_size = allocator.page_size
        self.tree_cache: Any = None  # SGLang's radix tree, learned from the first admission
        #: Free rows known on the host.
        self.host = HostFreeList()
        #: Copies of SGLang's free ids to the host (each waits for the device on a GPU).
        self.refills = 0

    def take(self, rows: int) -> torch.Tensor | None:
        if self.host.rows < rows:
            self._refill(rows - self.host.rows)
        if self.host.rows < rows:
            return None
        return self.host.take(rows)

    def give(self, rows: torch.Tensor) -> None:
        if rows.device.type != "cpu":
            raise ValueError("heap rows are given back from the host tables, never from the device")
        self.host.give(rows)

    def free_rows(self) -> int:
        return self.base.available_size(self.allocator) + self.host.rows

    def reserve(self, rows: int) -> None:
        if self.host.rows < rows:
            self._refill(rows - self.host.rows)

    def lend(self, rows: int) -> None:
        """Move up to `rows` (whole pages) of the host's free rows to SGLang's own free list."""
        count = min(round_up(rows, self.page_size), self.host.rows)
        if count <= 0:
            return
        lent = self.host.take(count)
        (pages,) = upload([lent[:: self.page_size] // self.page_size], self.allocator.device)
        # The token allocator's stock free (its free_page_ids calls the hooked free, which reads
        # the ids back for the prefix store); the paged one's free_page_ids (its free runs
        # torch.unique, which waits on the device).
        if self.page_size == 1:
            self.base.free(self.allocator, pages)
        else:
            self.base.free_page_ids(self.allocator, pages)

    def clear(self) -> None:
        """SGLang's free list was reset to every row: the host's copies are in it again."""
        self.host.clear()

    def evict_cache(self, rows: int) -> None:
        if self.tree_cache is not None:
            self.allocator.evict_to_free_tokens(self.tree_cache, rows)

    def _refill(self, rows: int) -> None:
        """Move `rows` (whole pages, at most what it has) of SGLang's free ids to the host."""
        count = min(round_up(rows, self.page_size), self.base.available_size(self.allocator))
        if count <= 0:
            return
        taken = self.base.alloc(self.allocator, count)
        if taken is None:
            return
        self.host.give(taken.to("cpu", torch.int64))
        self.refills += 1


def heap_allocator_class(base: type) -> type:
    """`base` (SGLang's token or paged allocator) with the heap hooks of the module doc."""

    class KVSparseHeapAllocator(base):
        kvsparse_state: SparseState
        kvsparse_rows: RawHeapRows

        def available_size(self) -> int:
            state = self.kvsparse_state
            return (
                super().available_size()
                + self.kvsparse_rows.host.rows
                + state.heap.reclaimable_rows()
                + state.heap.released_rows()
            )

        def _make_room(self, rows: int) -> None:
            """SGLang's next allocation takes up to `rows` ids from its own free list: reclaim
            prefix-store blocks (and settle SGLang's frees, waiting only when short), and lend
            host rows when its list is short."""
            state = self.kvsparse_state
            state.heap.reclaim(rows)
            if self.kvsparse_rows.free_rows() < rows and state.released is not None:
                state.released.settle(wait=True)
            short = rows - super().available_size()
            if short > 0:
                self.kvsparse_rows.lend(short)

        def alloc(self, need_size: int):
            self._make_room(need_size)
            return super().alloc(need_size)

        def alloc_extend(self, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, **kw):
            self._make_room(extend_num_tokens + (len(seq_lens_cpu) + 1) * self.page_size)
            return super().alloc_extend(
                prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc, extend_num_tokens, **kw
            )

        def alloc_decode(self, seq_lens, seq_lens_cpu, last_loc, **kw):
            self._make_room(len(seq_lens_cpu) * self.page_size)
            return super().alloc_decode(seq_lens, seq_lens_cpu, last_loc, **kw)

        def free(self, free_index: torch.Tensor) -> None:
            released = self.kvsparse_state.released
            if released is None:  # no prefix store: nothing keyed by these ids
                super().free(free_index)
            elif free_index.numel():
                released.freed(free_index)

        def clear(self) -> None:
            super().clear()
            if "kvsparse_rows" in self.__dict__:
                self.kvsparse_rows.clear()
            if "kvsparse_state" in self.__dict__:
                self.kvsparse_state.reset_allocator()

        def create_prefill_budget(self, tree_cache, **kwargs):
            self.kvsparse_rows.tree_cache = tree_cache
            return super().create_prefill_budget(tree_cache, **kwargs)

        def request_slot_reserve(self, *, has_req_pool_slot: bool, prefill_tokens: int = 0) -> int:
            stock = super().request_slot_reserve(has_req_pool_slot=has_req_pool_slot, prefill_tokens=prefill_tokens)
            return stock + context.prefill_charge(prefill_tokens)

        def check_decode_capacity(self, *, num_tokens: int, tree_cache, requests=None, spec_algorithm=None) -> bool:
            req_indices = [r.kv.req_pool_idx for r in requests or () if r.kv.req_pool_idx is not None]
            need = num_tokens + rows_for_next_decode(self.kvsparse_state, req_indices)
            self.evict_to_free_tokens(tree_cache, need)
            return self.available_size() >= need

        def max_new_tokens_for_memory(
            self, input_tokens: int, max_new_tokens: int, *, token_capacity: int, chunk_size: int | None = None, **kw
        ):
            rows = token_capacity - self.page_size - 1
            layout = self.kvsparse_state.layout
            if prefill_peak_rows(self.kvsparse_state, input_tokens, chunk_size) > rows:
                return None
            longest = layout.longest_fitting(rows)
            return max(0, min(max_new_tokens, longest - round_up(input_tokens, self.page_size)))

    KVSparseHeapAllocator.__qualname__ = KVSparseHeapAllocator.__name__ = f"KVSparseHeap{base.__name__}"
    return KVSparseHeapAllocator


def make_heap(allocator: Any) -> RawHeapRows:
    """Turn SGLang's allocator into the heap's (in place: the scheduler already holds it) and
    return raw access to its rows; `attach` completes it once the state exists."""
    base = type(allocator)
    allocator.__class__ = heap_allocator_class(base)
    rows = RawHeapRows(allocator, base)
    allocator.kvsparse_rows = rows
    return rows


def attach(allocator: Any, state: SparseState) -> None:
    allocator.kvsparse_state = state
