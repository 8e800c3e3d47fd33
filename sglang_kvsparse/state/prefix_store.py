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

Sliding columns (a model's sliding-window layers) read only the sinks and the last `window`
tokens before a prefill's first query. A held chunk's block that is neither is *narrowable*: the
heap takes back its sliding pages on demand, after the least recently used whole blocks, so a
chunked prompt holds its earlier chunks in the sparse layers' columns only (its peak counted by
`chunked_rows`). Until then the block is a whole cache entry. A narrowed block's entries still
serve the sparse layers' columns, and a prefix hit reuses a cut whose sinks and last `window`
tokens are in wide blocks (`valid_prefix_len`); `lookup` points a narrowed block's sliding
columns at the padding row (slot 0), which the prefill's window mask never lets count.

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

from collections.abc import Sequence

import torch

from sglang_kvsparse.state.layout import HeapLayout


class PrefixStore:
    """Full-pool id -> entry, and each block's heap pages, pins and last use."""

    def __init__(
        self,
        num_full_ids: int,
        columns: int,
        page_size: int,
        max_blocks: int,
        sliding: Sequence[bool] = (),
        sliding_reads: tuple[int, int] = (0, 0),
    ) -> None:
        """`sliding`: per column, whether it is a sliding layers' column (default none);
        `sliding_reads`: (sink, window), what a sliding column reads or keeps of a prompt."""
        self.columns = columns
        self.page_size = page_size
        self.sliding = torch.tensor(list(sliding) or [False] * columns, dtype=torch.bool)
        self.sink, self.window = sliding_reads
        self.sliding_rows_per_block = int(self.sliding.sum()) * page_size
        self.entry_of = torch.zeros(num_full_ids, dtype=torch.int64)  # 0: no entry
        blocks = max_blocks + 1  # block 0 is never used
        self.base = torch.zeros(blocks, columns, dtype=torch.int64)  # first heap row per column
        self.ids = torch.zeros(blocks, page_size, dtype=torch.int64)  # full id per token, 0: none
        self.live = torch.zeros(blocks, dtype=torch.int64)  # valid entries per block
        self.last_use = torch.full((blocks,), -1, dtype=torch.int64)  # -1: free block
        self.pins = torch.zeros(blocks, dtype=torch.int64)
        self.holds = torch.zeros(blocks, dtype=torch.int64)  # chunked prompts still to read the block
        self.wide = torch.ones(blocks, dtype=torch.bool)  # its sliding pages still held
        self.wide_pins = torch.zeros(blocks, dtype=torch.int64)  # pins that read its sliding pages too
        self.wide_holds = torch.zeros(blocks, dtype=torch.int64)  # holds that will read them
        #: Request index -> (the blocks its prompt so far is in, those its sliding columns read),
        #: held until its last chunk has read them.
        self.held_by: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._free = list(range(max_blocks, 0, -1))
        self._clock = 0
        #: Reclaimable rows, counted again only after a change (SGLang asks for the free size
        #: several times a step, and a count scans every block); `_pinned`: whether any pin is set.
        self._reclaimable_rows: int | None = 0
        self._pinned = False

    @classmethod
    def for_layout(cls, layout: HeapLayout, heap_rows: int, sink: int) -> PrefixStore:
        """The store of a heap of `heap_rows` rows (ids 1..heap_rows) laid out by `layout`: as
        many blocks as its rows hold, narrowed where it has sliding columns."""
        sliding = [bool(group.sliding_window) for group in layout.groups for _ in group.columns]
        window = max((group.sliding_window for group in layout.groups), default=0)
        narrow_rows = (len(sliding) - sum(sliding)) * layout.page_size  # every column without sliding ones
        blocks = heap_rows // max(narrow_rows, layout.page_size)
        return cls(heap_rows + layout.page_size, len(sliding), layout.page_size, blocks, sliding, (sink, window))

    @property
    def rows_per_block(self) -> int:
        """Heap rows of a wide block (every column)."""
        return self.columns * self.page_size

    @property
    def narrow_rows_per_block(self) -> int:
        """Heap rows of a narrowed block (the sparse layers' columns only)."""
        return self.rows_per_block - self.sliding_rows_per_block

    # -- queries ---------------------------------------------------------------------------
    def blocks(self) -> int:
        return int((self.last_use >= 0).sum())

    def rows(self) -> int:
        """Heap rows the store holds."""
        return int(self._block_rows()[self.last_use >= 0].sum())

    def reclaimable_rows(self) -> int:
        """Heap rows the store would give back on demand: its unpinned, unheld blocks' and its
        narrowable blocks' sliding pages."""
        if self._reclaimable_rows is None:
            self._reclaimable_rows = self._free_rows_of(torch.nonzero(self.last_use >= 0).flatten())
        return self._reclaimable_rows

    def chunked_rows(self, tokens: int, chunk: int) -> int:
        """Most heap rows a prompt of `tokens` prefilled in chunks of `chunk` holds here before
        its last chunk, its narrowable sliding pages taken back: every token's block in the
        sparse layers' columns; in the sliding columns the blocks of its sinks, of the last
        `window` tokens so far and of the chunk being stored (each may straddle one more page)."""
        page = self.page_size
        blocks = -(-tokens // page)
        if not self.sliding_rows_per_block:
            return blocks * self.rows_per_block
        wide = min(blocks, -(-self.sink // page) + -(-self.window // page) + -(-chunk // page) + 2)
        return blocks * self.narrow_rows_per_block + wide * self.sliding_rows_per_block

    def valid_prefix_len(self, full_ids: torch.Tensor, limit: int | None = None) -> int:
        """How many leading ids a prefill can reuse: each has an entry, and the sliding columns
        still hold the sinks and the last `window` of them (wide blocks). `limit`: the most
        wanted; the answer is then a whole number of pages."""
        entries = self.entry_of[full_ids.long()]
        n = int((entries > 0).cumprod(0).sum()) if entries.numel() else 0
        step = 1
        if limit is not None:
            step = self.page_size
            n = max(min(n, limit), 0) // step * step
        narrowed = ~self.wide[entries[:n] // self.page_size]
        if not bool(narrowed.any()):
            return n
        before = torch.cat([torch.zeros(1, dtype=torch.int64), narrowed.cumsum(0)])  # narrowed in [0, p)
        cut = torch.arange(0, n + 1, step)
        window_ok = before[cut] == before[(cut - self.window).clamp(min=0)]
        sinks_ok = before[cut.clamp(max=self.sink)] == 0
        return int(cut[window_ok & sinks_ok].max())

    def lookup(self, full_ids: torch.Tensor) -> torch.Tensor:
        """Heap rows [n, columns] of the ids' entries (a narrowed block's sliding columns: the
        padding row, 0); every id must have one."""
        entries = self.entry_of[full_ids.long()]
        if bool((entries == 0).any()):
            raise KeyError("a full-pool id has no prefix-store entry (evicted before its prefill read it?)")
        block, offset = entries // self.page_size, entries % self.page_size
        rows = self.base[block] + offset[:, None]
        narrowed = ~self.wide[block]
        if bool(narrowed.any()):
            rows[narrowed[:, None] & self.sliding[None, :]] = 0
        return rows

    def unpinned_rows_of(self, full_ids: torch.Tensor) -> int:
        """Heap rows that pinning the ids would stop being reclaimable."""
        return self._free_rows_of(self.blocks_of(full_ids))

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
        self.wide[blocks] = True
        ids = torch.zeros(count * self.page_size, dtype=torch.int64)
        ids[:stored] = full_ids[:stored].long()
        self.ids[blocks] = ids.view(count, self.page_size)
        self.live[blocks] = (self.ids[blocks] > 0).sum(1)
        self._stamp(blocks)
        self._reclaimable_rows = None
        entries = (blocks[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)[:stored]
        self.entry_of[ids[:stored]] = entries
        return self.lookup(ids[:stored])

    def touch(self, full_ids: torch.Tensor) -> None:
        """A prefix hit read these ids (a sequence in order): their blocks are the newest."""
        blocks = self.entry_of[full_ids.long()] // self.page_size
        self._stamp(torch.unique_consecutive(blocks[blocks > 0]))

    def pin(self, full_ids: torch.Tensor) -> None:
        """Keep the ids' blocks, every column, until `unpin` (or `unpin_all`): a prefill will
        read them."""
        self.pin_blocks(self.blocks_of(full_ids))

    def pin_blocks(self, blocks: torch.Tensor, wide: torch.Tensor | None = None) -> None:
        """Pin `blocks`, and the sliding pages of `wide` (some of them; default all) too."""
        wide = blocks if wide is None else wide
        self.pins[blocks] += 1
        self.wide_pins[wide] += 1
        self._pinned = True
        self._reclaimable_rows = None

    def unpin(self, full_ids: torch.Tensor) -> None:
        blocks = self.blocks_of(full_ids)
        self.pins[blocks] = (self.pins[blocks] - 1).clamp(min=0)
        self.wide_pins[blocks] = (self.wide_pins[blocks] - 1).clamp(min=0)
        self._reclaimable_rows = None

    def hold(self, blocks: torch.Tensor, wide: torch.Tensor | None = None) -> None:
        """Keep `blocks` (from `blocks_of`) until `release`, even if every entry is forgotten,
        and the sliding pages of `wide` (some of them; default all)."""
        wide = blocks if wide is None else wide
        self.holds[blocks] += 1
        self.wide_holds[wide] += 1
        self._reclaimable_rows = None

    def release(self, blocks: torch.Tensor, wide: torch.Tensor | None = None) -> torch.Tensor:
        """Undo one `hold` (the same `wide`); returns the heap rows of released blocks left
        without entries."""
        wide = blocks if wide is None else wide
        self.holds[blocks] = (self.holds[blocks] - 1).clamp(min=0)
        self.wide_holds[wide] = (self.wide_holds[wide] - 1).clamp(min=0)
        self._reclaimable_rows = None
        return self._drop(blocks[(self.holds[blocks] == 0) & (self.live[blocks] == 0) & (self.last_use[blocks] >= 0)])

    def hold_for(self, req_idx: int, full_ids: torch.Tensor) -> torch.Tensor:
        """The request at `req_idx` continues its prefill in a later chunk that reads these ids
        (its prompt so far): hold their blocks until then, in place of what it held before, the
        sliding pages only of its sinks and last `window` tokens. Returns the heap rows of blocks
        that leaves unheld and empty."""
        held = (self.blocks_of(full_ids), self.sliding_blocks_of(full_ids))
        self.hold(*held)
        freed = self.release_held(req_idx)
        self.held_by[req_idx] = held
        return freed

    def sliding_blocks_of(self, full_ids: torch.Tensor) -> torch.Tensor:
        """The blocks whose sliding pages a prefill after these ids (a prompt so far) reads:
        those of its first `sink` and last `window` (every block without sliding columns)."""
        if not self.sliding_rows_per_block:
            return self.blocks_of(full_ids)
        tail = full_ids[max(full_ids.numel() - self.window, 0) :]
        return self.blocks_of(torch.cat([full_ids[: self.sink], tail]))

    def read_held(self, req_idx: int) -> torch.Tensor:
        """The request at `req_idx` is in its last chunk: what it held is pinned for this forward,
        after which it is an ordinary cache entry. Returns the heap rows the release freed."""
        held = self.held_by.get(req_idx)
        if held is None:
            return torch.empty(0, dtype=torch.int64)
        self.pin_blocks(*held)
        return self.release_held(req_idx)

    def release_held(self, req_idx: int) -> torch.Tensor:
        """The request at `req_idx` holds nothing any more; returns the heap rows freed."""
        held = self.held_by.pop(req_idx, None)
        return torch.empty(0, dtype=torch.int64) if held is None else self.release(*held)

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
            self.wide_pins.zero_()
            self._pinned = False
            self._reclaimable_rows = None

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
        """Give back at least `rows` heap rows (or all that can go): least recently used
        unpinned, unheld blocks whole, then narrowable blocks' sliding pages; returns them."""
        if rows <= 0:
            return torch.empty(0, dtype=torch.int64)
        dropped = self._drop(self._oldest(self._reclaimable(), self._block_rows(), rows))
        short = rows - dropped.numel()
        if short <= 0 or not self.sliding_rows_per_block:
            return dropped
        sliding = torch.full_like(self.live, self.sliding_rows_per_block)
        return torch.cat([dropped, self._narrow(self._oldest(self._narrowable(), sliding, short))])

    def clear(self) -> torch.Tensor:
        """Drop everything (SGLang flushed its cache); returns every heap row the store held."""
        self.unpin_all()
        self.holds.zero_()
        self.wide_holds.zero_()
        self.held_by.clear()
        self._reclaimable_rows = None
        return self._drop(torch.nonzero(self.last_use >= 0).flatten())

    # -- internals -------------------------------------------------------------------------
    def _reclaimable(self) -> torch.Tensor:
        return (self.last_use >= 0) & (self.pins == 0) & (self.holds == 0)

    def _narrowable(self) -> torch.Tensor:
        """Blocks not reclaimable whole whose sliding pages no pin or hold reads."""
        if not self.sliding_rows_per_block:
            return torch.zeros_like(self.wide)
        unread = (self.wide_pins == 0) & (self.wide_holds == 0)
        return self.wide & (self.last_use >= 0) & unread & ~self._reclaimable()

    def _block_rows(self) -> torch.Tensor:
        """Heap rows each block holds (if it is in use)."""
        return torch.where(self.wide, self.rows_per_block, self.narrow_rows_per_block)

    def _free_rows_of(self, blocks: torch.Tensor) -> int:
        """Heap rows `reclaim` could take from `blocks`."""
        whole = self._reclaimable()[blocks]
        narrow = self._narrowable()[blocks]
        return int(self._block_rows()[blocks][whole].sum()) + int(narrow.sum()) * self.sliding_rows_per_block

    def _oldest(self, candidates: torch.Tensor, rows_each: torch.Tensor, rows: int) -> torch.Tensor:
        """The least recently used of the `candidates` blocks (a mask) that give at least `rows`
        heap rows, `rows_each` per block (all of them when they give fewer)."""
        blocks = torch.nonzero(candidates).flatten()
        blocks = blocks[torch.argsort(self.last_use[blocks], stable=True)]
        given = rows_each[blocks]
        return blocks[torch.cumsum(given, 0) - given < rows]  # the rows of the older ones fall short

    def _narrow(self, blocks: torch.Tensor) -> torch.Tensor:
        """Give back `blocks`' sliding pages; returns their heap rows."""
        self.wide[blocks] = False
        self._reclaimable_rows = None
        return (self.base[blocks][:, self.sliding][:, :, None] + torch.arange(self.page_size)).reshape(-1)

    def _drop(self, blocks: torch.Tensor) -> torch.Tensor:
        """Free `blocks`: clear the entries still pointing into them, return their heap rows."""
        if blocks.numel() == 0:
            return torch.empty(0, dtype=torch.int64)
        ids = self.ids[blocks].reshape(-1)
        entries = (blocks[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)
        ours = (ids > 0) & (self.entry_of[ids] == entries)
        self.entry_of[ids[ours]] = 0
        held = self.wide[blocks][:, None] | ~self.sliding[None, :]  # [blocks, columns] pages still held
        rows = (self.base[blocks][held][:, None] + torch.arange(self.page_size)).reshape(-1)
        self.ids[blocks] = 0
        self.live[blocks] = 0
        self.last_use[blocks] = -1
        self.pins[blocks] = 0
        self.holds[blocks] = 0
        self.wide[blocks] = True
        self.wide_pins[blocks] = 0
        self.wide_holds[blocks] = 0
        self._free.extend(blocks.tolist())
        self._reclaimable_rows = None
        return rows

    def _stamp(self, blocks: torch.Tensor) -> None:
        """Newest use for `blocks`, the first of them newest: eviction takes a tail first."""
        n = blocks.numel()
        self.last_use[blocks] = self._clock + n - torch.arange(n)
        self._clock += n
