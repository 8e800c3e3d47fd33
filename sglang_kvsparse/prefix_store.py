"""Uncompressed sparse-layer K/V of prompt tokens the radix tree may hand out again (bookkeeping
only; the K/V live in the layers' buffers, at the slots this store hands out).

Why it exists: SGLang's radix tree shares a cached prefix's full-layer K/V, but a request keeps
only a budget of entries in each sparse layer, chosen with the whole prompt in view. For a later
request that matches the prefix to compute exactly what it would compute without the hit (the
same attention for its new tokens, the same scores, so the same kept set), its prefill needs the
prefix's *uncompressed* sparse-layer K/V. The store keeps them, keyed by SGLang's full-pool token
id, the id the tree hands out for the token.

Copy-on-write, simply: store slots are written once, when a prompt token's prefill computes its
K/V, and only read after that; a request that reuses them copies what it keeps into its own row
slots, so compaction and eviction (which touch only a row's own slots) never write into a shared
slot.

Memory: the store owns no memory of its own. It borrows free pages of the group's `SlotPool` and
gives them back, least recently used first, whenever request rows need them (`reclaim`), as
SGLang's tree gives back cached tokens. Pages pinned for the current step (what its prefill reads)
are never taken. So admission counts `evictable_pages` as free, and the store never costs a
running request room.

Validity: an entry is valid while the full-pool id still holds the token it was written for.
SGLang reuses an id only by allocating it to a new token, and every new token goes through a
forward, so the forward's new ids are `invalidate`d there. Only prefill-computed K/V is stored:
a decoded token's sparse-layer K/V depend on what the layers below evicted, and reusing them
would change a later request's output. `valid_prefix_len` therefore stops at the first token
with no entry, and the radix match is capped there (`patches/prefix.py`).
"""

from __future__ import annotations

import torch

from sglang_kvsparse.index_map import SlotPool


class PrefixStore:
    """Full-pool token id -> slot in one group's pool, for tokens whose prefill K/V are kept.

    Pages of the store are whole pool pages; `last_use` orders them for eviction (-1: not in the
    store). Within one use, a sequence's earlier pages count as used later, so eviction takes a
    prefix's tail before its head: `valid_prefix_len` stops at the first missing entry, so a
    prefix without its head would be worth nothing. A page may hold entries that were invalidated
    since (their ids were reused); it stays until evicted, and eviction clears only the ids that
    still point into it.
    """

    def __init__(self, pool: SlotPool, num_full_ids: int) -> None:
        self.pool = pool
        self.page_size = pool.page_size
        pages = pool.num_pages + 1  # page 0 is the pool's padding page, never in the store
        self.slot_of = torch.zeros(num_full_ids, dtype=torch.int64)  # 0: no entry
        self.page_ids = torch.zeros(pages, self.page_size, dtype=torch.int64)  # full id per slot, 0: none
        self.last_use = torch.full((pages,), -1, dtype=torch.int64)
        self.pinned = torch.zeros(pages, dtype=torch.bool)
        self._clock = 0

    # -- queries ---------------------------------------------------------------------------
    def pages(self) -> int:
        return int((self.last_use >= 0).sum())

    def slots(self) -> int:
        return self.pages() * self.page_size

    def evictable_pages(self) -> int:
        return int(((self.last_use >= 0) & ~self.pinned).sum())

    def lookup(self, full_ids: torch.Tensor) -> torch.Tensor:
        """Store slots of the ids (int64; 0 where there is no valid entry)."""
        return self.slot_of[full_ids.long()]

    def valid_prefix_len(self, full_ids: torch.Tensor) -> int:
        """How many leading ids have an entry."""
        present = self.lookup(full_ids) > 0
        return int(present.cumprod(0).sum()) if present.numel() else 0

    def unpinned_pages_of(self, full_ids: torch.Tensor) -> int:
        """Store pages holding the ids' entries that are not pinned yet (what `pin` would pin)."""
        pages = self._pages_of(full_ids)
        return int((~self.pinned[pages]).sum())

    # -- updates ---------------------------------------------------------------------------
    def pin(self, full_ids: torch.Tensor) -> None:
        """Keep the ids' pages until `unpin_all` (the step that reads them is over)."""
        self.pinned[self._pages_of(full_ids)] = True

    def unpin_all(self) -> None:
        self.pinned.zero_()

    def touch(self, slots: torch.Tensor) -> None:
        """Mark the pages of `slots` (sequences in order) as just used: a prefix hit read them."""
        pages = slots.long() // self.page_size
        self._stamp(torch.unique_consecutive(pages[pages > 0]))

    def invalidate(self, full_ids: torch.Tensor) -> None:
        """The ids now hold other tokens (SGLang allocated them again): forget their entries."""
        self.slot_of[full_ids.long()] = 0

    def reclaim(self, free_pages: int) -> None:
        """Evict least recently used unpinned pages until the pool has `free_pages` free (or
        nothing more can be evicted)."""
        short = free_pages - self.pool.available_pages()
        if short > 0:
            self._evict(short)

    def put(self, full_ids: torch.Tensor) -> torch.Tensor:
        """Give the ids (new prompt tokens, in order) store slots, evicting older pages if the
        pool is short; returns the slots of the leading ids that got one (best effort: a store
        entry is a cache, never a promise)."""
        n = int(full_ids.numel())
        if n == 0:
            return torch.empty(0, dtype=torch.int64)
        want = -(-n // self.page_size)
        self.reclaim(want)
        got = min(want, self.pool.available_pages())
        slots = self.pool.alloc_pages(got)
        stored = min(n, got * self.page_size)
        pages = slots[:: self.page_size] // self.page_size
        ids = torch.zeros(got * self.page_size, dtype=torch.int64)
        ids[:stored] = full_ids[:stored].long()
        self.page_ids[pages] = ids.view(got, self.page_size)
        self._stamp(pages)
        self.slot_of[ids[:stored]] = slots[:stored]
        return slots[:stored]

    def clear(self) -> None:
        """Drop every entry and give all pages back (SGLang flushed its cache)."""
        self.unpin_all()
        self._evict(self.pages())

    # -- internals -------------------------------------------------------------------------
    def _pages_of(self, full_ids: torch.Tensor) -> torch.Tensor:
        slots = self.lookup(full_ids)
        return torch.unique(slots[slots > 0] // self.page_size)

    def _evict(self, n_pages: int) -> None:
        candidates = torch.nonzero((self.last_use >= 0) & ~self.pinned).flatten()
        if candidates.numel() == 0 or n_pages <= 0:
            return
        oldest = torch.argsort(self.last_use[candidates], stable=True)[:n_pages]
        pages = candidates[oldest]
        slots = (pages[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        ids = self.page_ids[pages].reshape(-1)
        live = (ids > 0) & (self.slot_of[ids] == slots)
        self.slot_of[ids[live]] = 0
        self.page_ids[pages] = 0
        self.last_use[pages] = -1
        self.pool.free(slots)

    def _stamp(self, pages: torch.Tensor) -> None:
        """Newest use for `pages`, the first of them newest (see the class docstring)."""
        n = pages.numel()
        self.last_use[pages] = self._clock + n - torch.arange(n)
        self._clock += n
