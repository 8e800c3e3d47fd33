"""The sparse layers' per-request state inside one scheduler process (no SGLang imports).

`SparseState` is the `AuxCache` SGLang keeps in step with its requests (`ReqToTokenPool`):
SGLang calls `alloc_to_lengths` when requests grow (prefill, then one token per decode step) and
`free` on every release path (finish, abort, retraction). It owns, per group of sparse columns
(`layout.py`), an `EntryTable` of each request's entries (the heap rows they are in), and the
`PrefixStore` of cached prompt tokens; the rows themselves come from the one KV heap (`HeapRows`:
SGLang's token allocator), shared with SGLang's full layers.

Each request keeps its own budget and policy (`request_sparsity.py`: the server's by default, or
those its `custom_params` ask for, which `expect` records); "budget" below is the request's.

Lifecycle of a request in one group: a prefill keeps min(length, budget) entries, each decode
step appends one, and a request holding its `max_entries` (budget + evict_page) is first cut back to
`budget` (`growth.py`); the forward moves the best-scored old entries into the kept positions
(`forward_step.begin_decode` hands the old rows over), and the evicted rows go back to the heap only
once that forward has been issued (`finish_forward`). A prompt prefilled in chunks keeps nothing
until its last chunk: earlier chunks' sparse K/V wait in the prefix store, held for the request,
and the last chunk reads them back as a cached prefix, selecting with the whole prompt in view.

Scores: a request that will outgrow its `max_entries` in a group (its final length, prompt + max new
tokens, is told by `expect` when SGLang admits it) gets the group's score rows at prefill;
entry j of column c keeps its scores at score slot `score_rows[j // per_row] * per_row +
j % per_row` of the lane's score view (the K bytes of those rows as float32). A request that
never evicts gets none: its score writes go to scratch slots in the padding row, never read.

Memory pressure, in one order for every owner: free rows, then the prefix store's least recently
used blocks, then SGLang's radix tree (`_make_room`). Admission (`admission.py`) and SGLang's
decode check (`patches/allocator.py`) ask this state what each request holds and needs, so the
heap is never promised twice.
"""

from __future__ import annotations

import torch

from sglang_kvsparse.config import ResolvedSparsity
from sglang_kvsparse.contracts import HeapRows
from sglang_kvsparse.counters import Counters
from sglang_kvsparse.entry_table import EntryTable, HeapExhausted
from sglang_kvsparse.growth import grow_to_lengths
from sglang_kvsparse.layout import HeapLayout, round_up, scores_per_row
from sglang_kvsparse.policies import ScoringPolicy
from sglang_kvsparse.prefix_store import PrefixStore
from sglang_kvsparse.released_ids import ReleasedIds
from sglang_kvsparse.request_sparsity import SERVER_GROUPING, SERVER_SETTING, RequestSparsity
from sglang_kvsparse.request_table import Phase, RequestTable
from sglang_kvsparse.sentences import SentenceMarks
from sglang_kvsparse.sparse_group import LaneBuffers, SparseGroup


class SparseState:
    """Entries, records and the prefix store of every sparse layer, keyed by SGLang's request index."""

    def __init__(
        self,
        resolved: ResolvedSparsity,
        *,
        heap: HeapRows,
        lanes: list[LaneBuffers],
        max_requests: int,
        heap_rows: int,
        prefix_cache: bool = False,
    ) -> None:
        """`heap_rows`: rows of the heap (SGLang's ids are 1..heap_rows, pages of `heap.page_size`).
        `prefix_cache`: keep prompt tokens' sparse K/V for radix-tree hits (SGLang's cache is on)."""
        self.resolved = resolved
        self.config = resolved.config
        self.page_size = heap.page_size
        self.scores_per_row = scores_per_row(lanes[0].k.shape[2], lanes[0].k.element_size())
        self.layout = HeapLayout.from_resolved(resolved, self.scores_per_row, self.page_size)
        if len(lanes) != self.layout.lanes:
            raise ValueError(f"{len(lanes)} lane buffers for a layout of {self.layout.lanes} lanes")
        self.policy = resolved.config.policy
        self.heap = heap
        self.lanes = lanes
        self.dense_capacity = heap_rows
        self.groups: list[SparseGroup] = []
        first = 0
        device = lanes[0].k.device
        for spec in self.layout.groups:
            widest = self.layout.widest_request(spec)
            table = EntryTable(max_requests, widest, len(spec.columns), self.page_size)
            score_rows = self.layout.score_rows(widest)
            scores = torch.zeros(max_requests, len(spec.columns), score_rows, dtype=torch.int64)
            device_table = torch.zeros(table.table.shape, dtype=torch.int32, device=device)
            device_scores = torch.zeros(scores.shape, dtype=torch.int32, device=device)
            self.groups.append(SparseGroup(spec, table, first, scores, device_table, device_scores))
            first += len(spec.columns)
        store_blocks = heap_rows // max(self.layout.num_columns * self.page_size, 1)
        self.store = (
            PrefixStore(heap_rows + self.page_size, self.layout.num_columns, self.page_size, store_blocks)
            if prefix_cache and self.groups
            else None
        )
        self.requests = RequestTable(max_requests)
        self.counters = Counters()
        #: SGLang's freed ids on their way to the host, for the prefix store (None without one).
        self.released = ReleasedIds(self.store, heap, self.counters) if self.store is not None else None
        self._deferred: list[torch.Tensor] = []  # evicted rows to give back after the forward
        self.sentence_marks: SentenceMarks | None = None  # the server's, when it has a tokenizer

    # -- AuxCache (called by SGLang's ReqToTokenPool) --------------------------------------
    def alloc_to_lengths(self, *, req_pool_indices_cpu: torch.Tensor, target_seq_lens_cpu: torch.Tensor) -> None:
        """Grow each request to its target length (see the module doc). All-or-nothing: every group is
        checked and the heap rows taken before anything changes."""
        grow_to_lengths(
            self, req_pool_indices_cpu.to(torch.int64).reshape(-1), target_seq_lens_cpu.to(torch.int64).reshape(-1)
        )

    def free(self, req_idx: int) -> None:
        """Release what the request at `req_idx` holds in every group (none: a no-op)."""
        self._release_held(req_idx)
        self.requests.clear(req_idx)
        for group in self.groups:
            group.evictions.pop(req_idx, None)
            if group.table.is_active(req_idx):
                self.heap.give(group.table.release(req_idx))
            if bool(group.score_table[req_idx, 0, 0]):
                held = group.score_table[req_idx]
                self.heap.give(held[held > 0])
                group.score_table[req_idx] = 0

    def expect(
        self,
        req_indices: list[int],
        final_lens: list[int],
        fill_lens: list[int] | None = None,
        settings: list[RequestSparsity] | None = None,
    ) -> None:
        """The requests SGLang just admitted at these indices will reach at most these lengths (their
        prompt and max new tokens): those that outgrow their budget in a group get score rows
        there. `fill_lens`: the lengths their prefills reach (a shorter allocation is a chunk).
        `settings`: each request's own (`request_sparsity.py`; default the server's)."""
        index = torch.tensor(req_indices, dtype=torch.int64)
        requests = self.requests
        requests.final_len[index] = torch.tensor(final_lens, dtype=torch.int64)
        if fill_lens is not None:
            requests.fill_len[index] = torch.tensor(fill_lens, dtype=torch.int64)
        settings = settings if settings is not None else [SERVER_SETTING] * len(req_indices)
        requests.budget[index] = torch.tensor([s.own_budget(self.resolved) for s in settings], dtype=torch.int64)
        for req_idx, setting in zip(req_indices, settings):
            requests.policy[req_idx] = setting.policy
        new = requests.is_(Phase.FREE, index)  # a chunked prompt's later chunks keep the record of its first
        requests.phase[index[new]] = Phase.ADMITTED
        counts = self.counters.requests_by_setting
        for setting in (s for s, is_new in zip(settings, new.tolist()) if is_new):
            counts[setting.label] = counts.get(setting.label, 0) + 1

    def clear(self) -> None:
        """Release every request, the deferred evictions and the prefix store, giving rows back."""
        if self.released is not None:
            self.released.settle(wait=True)
        for req_idx in torch.nonzero(self.requests.phase).flatten().tolist():
            self.free(req_idx)
        self.finish_forward()
        if self.store is not None:
            self.heap.give(self.store.clear())

    def reset_allocator(self) -> None:
        """SGLang reset its allocator (every row is free again): forget what we held."""
        for group in self.groups:
            for req_idx in group.table.active_requests().tolist():
                group.table.release(req_idx)
            group.evictions.clear()
            group.score_table.zero_()
        self.requests.reset()
        self._deferred.clear()
        if self.store is not None:
            self.store.clear()
            self.released.clear()

    # -- the heap, for SGLang's allocator hooks ----------------------------------------------
    def reclaimable_rows(self) -> int:
        """Heap rows the prefix store would give back on demand (they count as free)."""
        return self.store.reclaimable_rows() if self.store is not None else 0

    def reclaim(self, rows: int) -> None:
        """Give back prefix-store blocks, least recently used first, until `rows` rows are free
        (SGLang's frees that have reached the host first)."""
        if self.released is not None:
            self.released.settle()
        short = rows - self.heap.free_rows()
        if short > 0 and self.store is not None:
            self.heap.give(self.store.reclaim(short))

    def released_rows(self) -> int:
        """Rows SGLang freed that are on their way back to the heap (free, usable once settled)."""
        return self.released.rows if self.released is not None else 0

    def hold_for_next_chunk(self, req_idx: int, full_ids: torch.Tensor) -> None:
        """The request at `req_idx` continues its prefill in a later chunk that reads these ids (its
        prompt so far): hold their store blocks until then, in place of what it held before."""
        blocks = self.store.blocks_of(full_ids)
        self.store.hold(blocks)
        self._release_held(req_idx)
        self.requests.held[req_idx] = blocks

    def continues_chunks(self, req_idx: int) -> bool:
        """Whether the request at `req_idx` is past the first chunk of a chunked prefill."""
        return req_idx in self.requests.held

    def read_held(self, req_idx: int) -> None:
        """The request at `req_idx` is in its last chunk: what it held is pinned for this forward,
        after which it is an ordinary cache entry."""
        blocks = self.requests.held.get(req_idx)
        if blocks is not None:
            self.store.pin_blocks(blocks)
            self._release_held(req_idx)

    def _release_held(self, req_idx: int) -> None:
        blocks = self.requests.held.pop(req_idx, None)
        if blocks is not None:
            self.heap.give(self.store.release(blocks))

    def finish_forward(self) -> None:
        """The step's forward has been issued: give back the rows its evictions read, and unpin
        the prefixes its prefill read."""
        if self._deferred:
            self.heap.give(torch.cat(self._deferred))
            self._deferred.clear()
        if self.store is not None:
            self.store.unpin_all()

    def guided(self, budgets: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """Which requests (host [B], by their budgets in one group and whole sequence lengths) a
        selecting prefill keeps by the guide: with guide layers, those longer than their budget
        and, with `guide_below`, whose budget is below that share of their sequence; None without
        guide layers."""
        if not self.resolved.guide_layers:
            return None
        over = seq_lens > budgets
        share = self.config.guide_below
        return over if share is None else over & (budgets < share * seq_lens)

    def guide_rows(self, tokens: int) -> int:
        """Heap rows `tokens` new tokens of a guided prefill wait in, one per sparse column (whole
        pages), from the sparse layers' own attention until the guide has chosen."""
        return round_up(tokens, self.page_size) * self.layout.num_columns

    def take_for_forward(self, rows: int) -> torch.Tensor:
        """`rows` heap rows (host) that this forward uses and gives back once it has been issued
        (`finish_forward`), as an eviction's old rows."""
        taken = self.take(rows)
        self.defer(taken)
        return taken

    def defer(self, rows: torch.Tensor) -> None:
        """Give these heap rows back once the step's forward has been issued (`finish_forward`):
        it still reads them."""
        self._deferred.append(rows)

    def rows_held(self, req_idx: int) -> int:
        """Heap rows the request at `req_idx` holds in the sparse columns now (scores included)."""
        return sum(
            group.columns * round_up(group.table.length(req_idx), self.page_size)
            + int((group.score_table[req_idx] > 0).sum())
            for group in self.groups
            if group.table.is_active(req_idx)
        )

    def score_slots(self, group: SparseGroup, req_indices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Score slots [n, columns] of entries at `positions` of these requests (both [n]): in the
        request's score rows, or scratch slots in the padding row for a request that never evicts."""
        per_row = self.scores_per_row
        pages = group.score_table[req_indices, :, positions // per_row]  # [n, columns]
        return pages * per_row + (positions % per_row)[:, None]

    def reusable_prefix_len(self, prefix_ids: torch.Tensor, seq_len: int) -> int:
        """How much of a radix match of `prefix_ids` a prefill of `seq_len` tokens can reuse: the
        leading ids with store entries, leaving the last `window` tokens (the queries the
        policies score with) to the prefill, whole pages only. 0 without a store."""
        if self.store is None:
            return 0
        self.released.settle()  # adoptions that have landed
        usable = max(min(self.store.valid_prefix_len(prefix_ids), seq_len - self.config.window), 0)
        return usable - usable % self.page_size

    def pin_prefix(self, prefix_ids: torch.Tensor) -> None:
        """Keep the prefix's store blocks until the forward that reads them has been issued."""
        if self.store is not None:
            self.store.pin(prefix_ids)

    def unpin_prefix(self, prefix_ids: torch.Tensor) -> None:
        if self.store is not None:
            self.store.unpin(prefix_ids)

    # -- queries -------------------------------------------------------------------------
    def own_settings_running(self) -> set[tuple[int, ScoringPolicy | None]]:
        """The distinct own settings (own budget, policy) of the running requests, as the sparse
        layers group them (`RequestSparsity.grouping`); the server's is not one."""
        running = self.requests.running_requests().tolist()
        settings = {(int(self.requests.budget[i]), self.requests.policy[i]) for i in running}
        return settings - {SERVER_GROUPING}

    def requests_running(self) -> int:
        return int(self.requests.running().sum())

    def running_requests(self) -> torch.Tensor:
        """The indices of the running requests."""
        return self.requests.running_requests()

    def sparse_rows(self, group: SparseGroup) -> int:
        """Heap rows the group's requests hold: entries (pending evictions' included) and scores."""
        return group.table.rows_held() + self.score_rows(group)

    def score_rows(self, group: SparseGroup) -> int:
        return int((group.score_table > 0).sum())

    def deferred_rows(self) -> int:
        return sum(rows.numel() for rows in self._deferred)

    def budgets(self, group: SparseGroup, req_indices: torch.Tensor) -> torch.Tensor:
        """Each of these requests' budget in the group: its own, or the group's."""
        own = self.requests.budget[req_indices]
        return torch.where(own > 0, own, group.spec.budget)

    def max_entries(self, group: SparseGroup, req_indices: torch.Tensor) -> torch.Tensor:
        """Each of these requests' most entries in the group (it evicts on reaching them)."""
        own = self.requests.budget[req_indices]
        mine = (own + self.config.evict_page).clamp(max=self.resolved.context_len)
        return torch.where(own > 0, mine, group.spec.max_entries)

    def take(self, rows: int) -> torch.Tensor:
        """`rows` heap rows (host) for request entries, making room first; raises HeapExhausted
        (changing nothing held) when even that leaves too few: admission promised more than the
        heap has."""
        self._make_room(rows)
        taken = self.heap.take(rows)
        if taken is None:
            raise HeapExhausted(
                f"the KV heap has {self.heap.free_rows()} free rows for {rows} sparse entries: "
                f"admission let in more than fits ({self.describe_heap()})"
            )
        return taken

    def decode_reserve(self) -> int:
        """Heap rows the running requests may take in their coming decode steps before their own
        evictions give rows back: per group and request, the pages from what it holds up to the
        most it will hold (its `max_entries`, or its final length when shorter), and one more."""
        running = self.running_requests()
        page = self.page_size
        total = 0
        for group in self.groups:
            holding = running[group.table.active[running]]
            final = self.requests.final_len[holding]
            final = torch.where(final == 0, self.resolved.context_len, final)
            most = torch.minimum(self.max_entries(group, holding), final)
            pages = (most + page - 1) // page - (group.table.lengths[holding] + page - 1) // page
            total += int((pages.clamp(min=0) + 1).sum()) * page * group.columns
        return total

    def describe_heap(self) -> str:
        """Who holds the heap's rows, for an error message."""
        store = "no store"
        if self.store is not None:
            store = f"prefix store {self.store.rows()} ({self.reclaimable_rows()} reclaimable)"
        sparse = ", ".join(f"group {i}: {self.sparse_rows(g)}" for i, g in enumerate(self.groups))
        return (
            f"{self.requests_running()} requests, sparse rows {sparse}; {store}; "
            f"{self.deferred_rows()} evicted rows awaiting the forward"
        )

    def take_for_store(self, rows: int) -> torch.Tensor:
        """Up to `rows` heap rows for the prefix store, whole store blocks only, making room first
        (best effort: a cache entry is never a promise)."""
        per_block = self.store.rows_per_block
        self._make_room(rows)
        rows = min(rows, self.heap.free_rows()) // per_block * per_block
        taken = self.heap.take(rows) if rows else None
        return torch.empty(0, dtype=torch.int64) if taken is None else taken

    def _make_room(self, rows: int) -> None:
        """Free rows, then the prefix store's LRU blocks, then SGLang's radix tree, then SGLang's
        frees still on their way to the host (waiting for them)."""
        self.reclaim(rows)
        if self.heap.free_rows() < rows:
            self.heap.evict_cache(rows)
            self.reclaim(rows)
        if self.heap.free_rows() < rows and self.released is not None:
            self.released.settle(wait=True)
