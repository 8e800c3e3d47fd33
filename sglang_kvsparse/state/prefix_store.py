"""Uncompressed sparse-layer K/V of prompt tokens the radix tree may hand out again (bookkeeping
only: the K/V live in the heap's lane buffers, at the rows this store records).

Why it exists: SGLang's radix tree shares a cached prefix's full-layer K/V, but a request keeps
only a budget of entries in each sparse layer, chosen with the whole prompt in view. For a later
request that matches the prefix to compute exactly what it would compute without the hit (the
same attention for its new tokens, the same scores, so the same kept set), its prefill needs the
prefix's *uncompressed* sparse-layer K/V. The store keeps them, keyed by SGLang's full-pool token
id, the id the tree hands out for the token.

Layout: a *block* is up to `page_size` consecutive prompt tokens and holds one heap page per
sparse column, so token t of block b is at row `base[b, c] + t` in column c. A token's *entry* is
`b * page_size + t` (blocks count from 1, so entry 0 means "none").

Copy-on-write, simply: store rows are written once, when a prompt token's prefill computes its
K/V, and only read after that; a request that reuses them copies what it keeps into its own rows.

Memory: the store's rows are heap rows it borrowed; they count as free for admission, and the
heap takes them back, least recently used first (a prefix's tail before its head), whenever an
owner needs rows (`reclaim`). Blocks a step's prefill will read are pinned from admission until
that forward has been issued. A prompt prefilled in chunks *holds* its blocks from the chunk
that stored them until its last chunk has read them: they are that request's only copy of its
earlier chunks' sparse-layer K/V, not a cache entry.

Validity: an entry is valid while SGLang holds its full-pool id for that token (a running request
or the radix tree). When SGLang frees the id, `forget` drops the entry, and a block whose entries
are all gone gives its rows back. Only prefill-computed K/V are stored: a decoded token's
sparse-layer K/V depend on what the layers below evicted, so reusing them would change a later
request's output; `valid_prefix_len` stops at the first token without an entry. When SGLang's
tree already holds a token under another id (an earlier request's, often a decoded one) and frees
the id a prefill just wrote, the entry moves to the tree's id (`adopt`): the K/V are the prefill's
either way, and the next turn of a conversation can reuse them.
"""

from __future__ import annotations

import torch


class PrefixStore:
    """Full-pool id -> entry, and each block's heap pages, pins and last use."""

    def __init__(self, num_full_ids: int, columns: int, page_size: int, max_blocks: int) -> None:
        self.columns = columns
        self.page_size = page_size
        self.entry_of = torch.zeros(num_full_ids, dtype=torch.int64)  # 0: no entry
        blocks = max_blocks + 1  # block 0 is never used
        self.base = torch.zeros(blocks, columns, dtype=torch.int64)  # first heap row per column
        self.ids = torch.zeros(blocks, page_size, dtype=torch.int64)  # full id per token, 0: none
        self.live = torch.zeros(blocks, dtype=torch.int64)  # valid entries per block
        self.last_use = torch.full((blocks,), -1, dtype=torch.int64)  # -1: free block
        self.pins = torch.zeros(blocks, dtype=torch.int64)
        self.holds = torch.zeros(blocks, dtype=torch.int64)  # chunked prompts still to read the block
        #: Request index -> the blocks its prompt so far is in, held until its last chunk has read them.
        self.held_by: dict[int, torch.Tensor] = {}
        self._free = list(range(max_blocks, 0, -1))
        self._clock = 0
        #: Reclaimable blocks, counted again only after a change (SGLang asks for the free size
        #: several times a step, and a count scans every block); `_pinned`: whether any pin is set.
        self._reclaimable_blocks: int | None = 0
        self._pinned = False

    @property
    def rows_per_block(self) -> int:
        return self.columns * self.page_size

    # -- queries ---------------------------------------------------------------------------
    def blocks(self) -> int:
        return int((self.last_use >= 0).sum())

    def rows(self) -> int:
        """Heap rows the store holds."""
        return self.blocks() * self.rows_per_block

    def reclaimable_rows(self) -> int:
        """Heap rows the store would give back on demand (its unpinned blocks')."""
        if self._reclaimable_blocks is None:
            self._reclaimable_blocks = int(self._reclaimable().sum())
        return self._reclaimable_blocks * self.rows_per_block

    def valid_prefix_len(self, full_ids: torch.Tensor) -> int:
        """How many leading ids have an entry."""
        present = self.entry_of[full_ids.long()] > 0
        return int(present.cumprod(0).sum()) if present.numel() else 0

    def lookup(self, full_ids: torch.Tensor) -> torch.Tensor:
        """Heap rows [n, columns] of the ids' entries; every id must have one."""
        entries = self.entry_of[full_ids.long()]
        if bool((entries == 0).any()):
            raise KeyError("a full-pool id has no prefix-store entry (evicted before its prefill read it?)")
        block, offset = entries // self.page_size, entries % self.page_size
        return self.base[block] + offset[:, None]

    def unpinned_rows_of(self, full_ids: torch.Tensor) -> int:
        """Heap rows that pinning the ids would stop being reclaimable."""
        blocks = self.blocks_of(full_ids)
        return int(((self.pins[blocks] == 0) & (self.holds[blocks] == 0)).sum()) * self.rows_per_block

    def blocks_of(self, full_ids: torch.Tensor) -> torch.Tensor:
        """The distinct blocks holding the ids' entries (ids without one are skipped)."""
        entries = self.entry_of[full_ids.long()]
        return torch.unique(entries[entries > 0] // self.page_size)

    # -- updates ---------------------------------------------------------------------------
    def put(self, full_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Store the leading ids (new prompt tokens, in order) in `rows` (whole blocks' worth of
        heap pages, page by page); returns their heap rows [n_stored, columns]."""
        per_block = self.rows_per_block
        count = min(rows.numel() // per_block, len(self._free), -(-full_ids.numel() // self.page_size))
        stored = min(full_ids.numel(), count * self.page_size)
        if count == 0:
            return torch.empty(0, self.columns, dtype=torch.int64)
        blocks = torch.tensor([self._free.pop() for _ in range(count)], dtype=torch.int64)
        self.base[blocks] = rows[: count * per_block].view(count, self.columns, self.page_size)[:, :, 0]
        ids = torch.zeros(count * self.page_size, dtype=torch.int64)
        ids[:stored] = full_ids[:stored].long()
        self.ids[blocks] = ids.view(count, self.page_size)
        self.live[blocks] = (self.ids[blocks] > 0).sum(1)
        self._stamp(blocks)
        self._reclaimable_blocks = None
        entries = (blocks[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)[:stored]
        self.entry_of[ids[:stored]] = entries
        return self.lookup(ids[:stored])

    def touch(self, full_ids: torch.Tensor) -> None:
        """A prefix hit read these ids (a sequence in order): their blocks are the newest."""
        blocks = self.entry_of[full_ids.long()] // self.page_size
        self._stamp(torch.unique_consecutive(blocks[blocks > 0]))

    def pin(self, full_ids: torch.Tensor) -> None:
        """Keep the ids' blocks until `unpin` (or `unpin_all`): a prefill will read them."""
        self.pin_blocks(self.blocks_of(full_ids))

    def pin_blocks(self, blocks: torch.Tensor) -> None:
        self.pins[blocks] += 1
        self._pinned = True
        self._reclaimable_blocks = None

    def unpin(self, full_ids: torch.Tensor) -> None:
        blocks = self.blocks_of(full_ids)
        self.pins[blocks] = (self.pins[blocks] - 1).clamp(min=0)
        self._reclaimable_blocks = None

    def hold(self, blocks: torch.Tensor) -> None:
        """Keep `blocks` (from `blocks_of`) until `release`, even if every entry is forgotten."""
        self.holds[blocks] += 1
        self._reclaimable_blocks = None

    def release(self, blocks: torch.Tensor) -> torch.Tensor:
        """Undo one `hold`; returns the heap rows of released blocks left without entries."""
        self.holds[blocks] = (self.holds[blocks] - 1).clamp(min=0)
        self._reclaimable_blocks = None
        return self._drop(blocks[(self.holds[blocks] == 0) & (self.live[blocks] == 0) & (self.last_use[blocks] >= 0)])

    def hold_for(self, req_idx: int, full_ids: torch.Tensor) -> torch.Tensor:
        """The request at `req_idx` continues its prefill in a later chunk that reads these ids
        (its prompt so far): hold their blocks until then, in place of what it held before.
        Returns the heap rows of blocks that leaves unheld and empty."""
        blocks = self.blocks_of(full_ids)
        self.hold(blocks)
        freed = self.release_held(req_idx)
        self.held_by[req_idx] = blocks
        return freed

    def read_held(self, req_idx: int) -> torch.Tensor:
        """The request at `req_idx` is in its last chunk: what it held is pinned for this forward,
        after which it is an ordinary cache entry. Returns the heap rows the release freed."""
        blocks = self.held_by.get(req_idx)
        if blocks is None:
            return torch.empty(0, dtype=torch.int64)
        self.pin_blocks(blocks)
        return self.release_held(req_idx)

    def release_held(self, req_idx: int) -> torch.Tensor:
        """The request at `req_idx` holds nothing any more; returns the heap rows freed."""
        blocks = self.held_by.pop(req_idx, None)
        return torch.empty(0, dtype=torch.int64) if blocks is None else self.release(blocks)

    def adopt(self, ours: torch.Tensor, theirs: torch.Tensor) -> int:
        """SGLang's tree holds the tokens of ids `ours` under ids `theirs` (same positions) and is
        about to free `ours`: move each entry of `ours` to its `theirs` where that has none.
        Returns how many entries moved."""
        ours, theirs = ours.long().reshape(-1), theirs.long().reshape(-1)
        mine, tree = self.entry_of[ours], self.entry_of[theirs]
        move = (ours != theirs) & (mine > 0) & (tree == 0)
        if not bool(move.any()):
            return 0
        entries, targets = mine[move], theirs[move]
        self.entry_of[ours[move]] = 0
        self.entry_of[targets] = entries
        self.ids[entries // self.page_size, entries % self.page_size] = targets
        return int(move.sum())

    def unpin_all(self) -> None:
        if self._pinned:
            self.pins.zero_()
            self._pinned = False
            self._reclaimable_blocks = None

    def forget(self, full_ids: torch.Tensor) -> torch.Tensor:
        """SGLang freed these ids: drop their entries; returns the heap rows of blocks left empty."""
        ids = full_ids.long().reshape(-1)
        entries = self.entry_of[ids]
        ids, entries = ids[entries > 0], entries[entries > 0]
        if ids.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        self.entry_of[ids] = 0
        blocks, offsets = entries // self.page_size, entries % self.page_size
        self.ids[blocks, offsets] = 0
        self.live.index_add_(0, blocks, torch.full_like(blocks, -1))
        empty = torch.unique(blocks[(self.live[blocks] == 0) & (self.holds[blocks] == 0)])
        return self._drop(empty)

    def reclaim(self, rows: int) -> torch.Tensor:
        """Evict least recently used unpinned blocks worth at least `rows` heap rows (or all that
        can go); returns their heap rows."""
        if rows <= 0:
            return torch.empty(0, dtype=torch.int64)
        candidates = torch.nonzero(self._reclaimable()).flatten()
        need = -(-rows // self.rows_per_block)
        oldest = candidates[torch.argsort(self.last_use[candidates], stable=True)[:need]]
        return self._drop(oldest)

    def clear(self) -> torch.Tensor:
        """Drop everything (SGLang flushed its cache); returns every heap row the store held."""
        self.unpin_all()
        self.holds.zero_()
        self.held_by.clear()
        self._reclaimable_blocks = None
        return self._drop(torch.nonzero(self.last_use >= 0).flatten())

    # -- internals -------------------------------------------------------------------------
    def _reclaimable(self) -> torch.Tensor:
        return (self.last_use >= 0) & (self.pins == 0) & (self.holds == 0)

    def _drop(self, blocks: torch.Tensor) -> torch.Tensor:
        """Free `blocks`: clear the entries still pointing into them, return their heap rows."""
        if blocks.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        ids = self.ids[blocks].reshape(-1)
        entries = (blocks[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        ours = (ids > 0) & (self.entry_of[ids] == entries)
        self.entry_of[ids[ours]] = 0
        rows = (self.base[blocks][:, :, None] + torch.arange(self.page_size)).reshape(-1)
        self.ids[blocks] = 0
        self.live[blocks] = 0
        self.last_use[blocks] = -1
        self.pins[blocks] = 0
        self.holds[blocks] = 0
        self._free.extend(blocks.tolist())
        self._reclaimable_blocks = None
        return rows

    def _stamp(self, blocks: torch.Tensor) -> None:
        """Newest use for `blocks`, the first of them newest: eviction takes a tail first."""
        n = blocks.numel()
        self.last_use[blocks] = self._clock + n - torch.arange(n)
        self._clock += n
