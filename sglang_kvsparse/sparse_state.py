"""The sparse layers' per-request state inside one scheduler process (no SGLang imports).

`SparseState` is the `AuxCache` SGLang keeps in step with its request rows: SGLang calls
`alloc_to_lengths` when rows grow (prefill, then one token per decode step) and `free` on every
release path (finish, abort, retraction). It owns, per group of sparse columns (`layout.py`), a
`RowTable` of each request's heap rows, and the `PrefixStore` of cached prompt tokens; the rows
themselves come from the one KV heap (`HeapRows`: SGLang's token allocator), shared with SGLang's
full layers.

Each request keeps its own budget and policy (`request_sparsity.py`: the server's by default, or
those its `custom_params` ask for, which `expect` records); "budget" below is the request's.

Lifecycle of a row in one group: a prefill keeps min(length, budget) entries (the forward fills
them, compressing when the prompt is longer than the budget); each decode step appends one. A
prompt prefilled in chunks (SGLang's chunked prefill) keeps nothing until its last chunk: each
earlier chunk's sparse-layer K/V go to the prefix store, held for the request (`partial` rows),
and the last chunk reads them back as a cached prefix, so it selects with the whole prompt in
view exactly as an unchunked prefill would. When
a row holds its `max_entries` (budget + evict_page), the step first evicts: the row is cut back to
`budget` entries here, and the forward moves the `budget` best-scored of the old entries into the
kept positions before it writes the new token (`planning.plan_decode` hands the old rows over).
The evicted pages go back to the heap only once that forward has been issued (`finish_forward`),
so no other owner can write into a row the eviction still reads.

Scores: a request that will outgrow its `max_entries` in a group (its final length, prompt + max new
tokens, is told by `expect` when SGLang gives it a row) gets the group's score rows at prefill;
entry j of column c keeps its scores at score slot `score_rows[j // per_row] * per_row +
j % per_row` of the lane's score view (the K bytes of those rows as float32). A request that
never evicts gets none: its score writes go to scratch slots in the padding row, never read.

Memory pressure, in one order for every owner: free rows, then the prefix store's least recently
used blocks, then SGLang's radix tree (`_make_room`). Admission (`admission.py`) and SGLang's
decode check (`patches/allocator.py`) ask this state what each request holds and needs, so the
heap is never promised twice.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_kvsparse.config import ResolvedSparsity
from sglang_kvsparse.contracts import HeapRows
from sglang_kvsparse.layout import GroupSpec, HeapLayout, round_up, scores_per_row
from sglang_kvsparse.policies import ScoringPolicy
from sglang_kvsparse.prefix_store import PrefixStore
from sglang_kvsparse.released_ids import ReleasedIds
from sglang_kvsparse.request_sparsity import SERVER_GROUPING, SERVER_SETTING, RequestSparsity
from sglang_kvsparse.row_table import HeapError, HeapExhausted, RowTable
from sglang_kvsparse.sentences import SentenceMarks


@dataclass(frozen=True)
class LaneBuffers:
    """One lane of the heap: a layer position's K/V in every row, and the float32 score view of
    its K bytes (score slot s of row r: s in [r * per_row, (r + 1) * per_row)).

    With full layers, lane i *is* full layer i's buffer in SGLang's pool."""

    k: torch.Tensor  # [rows + page, H_kv, D]
    v: torch.Tensor
    scores: torch.Tensor  # [(rows + page) * per_row, H_kv] float32, a view of k

    @classmethod
    def over(cls, k: torch.Tensor, v: torch.Tensor) -> LaneBuffers:
        """The lane of these K/V buffers, with the score view of `k`."""
        return cls(k, v, k.view(torch.float32).view(-1, k.shape[1]))


@dataclass
class SparseGroup:
    """One group of sparse columns: its spec, its requests' rows and pending evictions."""

    spec: GroupSpec
    table: RowTable
    #: First global column index of the group (columns are numbered across groups).
    first_column: int
    #: Request row -> heap rows of its scores, [columns, score rows of the widest row] (0: none;
    #: a request holds those of its own `max_entries`, the rest stay 0).
    score_table: torch.Tensor
    #: What the decode kernels read, on the lanes' device (int32): `table.table` and
    #: `score_table`, brought up to date by the next forward's plan wherever the host tables
    #: changed what a reader sees (a new request's entries and score rows, a page appended), so a
    #: step copies only those few entries, in the plan's one upload (`stale_entries`).
    device_table: torch.Tensor
    device_scores: torch.Tensor
    #: Request row -> its entries before this step's eviction, [its max_entries, columns].
    evictions: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Host-table changes the device tables do not have yet: request rows whose entries and
    #: score rows changed, and (request rows, first positions) of pages appended.
    stale_rows: list[torch.Tensor] = field(default_factory=list)
    stale_pages: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def mirror_rows(self, rows: torch.Tensor) -> None:
        """These request rows' entries and score rows changed (a prefill): the next plan copies them."""
        if rows.numel():
            self.stale_rows.append(rows.clone())

    def mirror_pages(self, rows: torch.Tensor, starts: torch.Tensor) -> None:
        """Request rows[i] got the page starting at position starts[i]: the next plan copies it."""
        if rows.numel():
            self.stale_pages.append((rows.clone(), starts.clone()))

    def stale_entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(flat indices into `device_table`, their values, flat indices into `device_scores`,
        their values), all host, from the host tables as they are now (a place changed twice is
        copied once, at its last value); the pending changes are forgotten."""
        table, page = self.table, self.table.page_size
        width = table.capacity * self.columns
        entry_parts = []
        for rows in self.stale_rows:
            lengths = (table.lengths[rows] + page - 1) // page * page
            entry_parts.append(_row_spans(rows, lengths * self.columns, width))
        for rows, starts in self.stale_pages:
            first = rows * width + starts * self.columns
            entry_parts.append((first[:, None] + torch.arange(page * self.columns)).reshape(-1))
        entries = torch.cat(entry_parts).unique() if entry_parts else torch.empty(0, dtype=torch.int64)
        scores = torch.empty(0, dtype=torch.int64)
        if self.stale_rows:
            score_width = self.score_table[0].numel()
            rows = torch.cat(self.stale_rows).unique()
            scores = (rows[:, None] * score_width + torch.arange(score_width)).reshape(-1)
        self.stale_rows.clear()
        self.stale_pages.clear()
        return entries, table.table.view(-1)[entries], scores, self.score_table.view(-1)[scores]

    @property
    def columns(self) -> int:
        return len(self.spec.columns)


def _row_spans(rows: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """Flat indices of the first counts[i] elements of row rows[i] of a [*, width] table."""
    starts = (rows * width).repeat_interleave(counts)
    offsets = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
    return starts + offsets


@dataclass
class Counters:
    """What the state has done since start-up (for stats)."""

    forward_plans: int = 0
    evictions: int = 0  # (request, group) evictions handed to decode forwards
    prefix_hits: int = 0
    prefix_tokens_reused: int = 0
    chunks_stored: int = 0  # prefill chunks before a prompt's last, kept whole in the store
    store_entries_adopted: int = 0  # store entries moved to the tree's id for the same token
    #: Allocations that waited for SGLang's frees to reach the host (memory was short at once).
    release_waits: int = 0
    requests_running_peak: int = 0
    #: Device values the sparse path read back (each a host wait on a GPU): request rows SGLang
    #: gave a forward no host copy of.
    host_syncs: int = 0
    #: Decode steps that ran eagerly where a captured graph could not serve them (a request
    #: with a policy of its own).
    eager_decode_steps: int = 0
    #: Copies of SGLang's free ids to the host made while allocating a decode step (the host
    #: free list ran short of the running requests' reserve: memory pressure).
    decode_refills: int = 0
    #: Admissions put off because the request's own setting would have made one more than
    #: `max_distinct_settings` among the running requests (it waits for one of them to finish).
    setting_waits: int = 0
    #: The most scoring passes one prefill forward made (one per policy among its requests),
    #: and the most evictions one decode step ran (one per group and (budget, policy)).
    scoring_passes_peak: int = 0
    evictions_per_step_peak: int = 0
    #: The most heap rows a guided prefill's new tokens waited in during one forward, and the
    #: admissions put off to the next round because this round's guided prefills held rows that
    #: come back after their forward.
    guide_rows_peak: int = 0
    guide_waits: int = 0
    #: Requests given rows, by their setting's label (`RequestSparsity.label`); a retracted
    #: request counts again when it is readmitted.
    requests_by_setting: dict[str, int] = field(default_factory=dict)


class SparseState:
    """Rows, tables and the prefix store of every sparse layer, keyed by SGLang's request row."""

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
            widest = self.layout.widest_row(spec)
            table = RowTable(max_requests, widest, len(spec.columns), self.page_size)
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
        self.logical = torch.zeros(max_requests, dtype=torch.int64)  # each row's sequence length
        self.running = torch.zeros(max_requests, dtype=torch.bool)  # rows holding a request now
        self.final_len = torch.zeros(max_requests, dtype=torch.int64)  # expected final length, 0: unknown
        self.fill_len = torch.zeros(max_requests, dtype=torch.int64)  # length its prefill reaches, 0: unknown
        self.partial = torch.zeros(max_requests, dtype=torch.bool)  # rows between chunks of their prefill
        self.prefilled = torch.zeros(max_requests, dtype=torch.bool)  # rows whose prefill was planned: decoding
        self.request_budget = torch.zeros(max_requests, dtype=torch.int64)  # a request's own budget, 0: the groups'
        self.request_policy: list[ScoringPolicy | None] = [None] * max_requests  # its own policy, None: the server's
        self._held: dict[int, torch.Tensor] = {}  # partial row -> the store blocks it holds
        self.counters = Counters()
        #: SGLang's freed ids on their way to the host, for the prefix store (None without one).
        self.released = ReleasedIds(self.store, heap, self.counters) if self.store is not None else None
        self._deferred: list[torch.Tensor] = []  # evicted rows to give back after the forward
        self.sentence_marks: SentenceMarks | None = None  # the server's, when it has a tokenizer

    # -- AuxCache (called by SGLang's ReqToTokenPool) --------------------------------------
    def alloc_to_lengths(self, *, req_pool_indices_cpu: torch.Tensor, target_seq_lens_cpu: torch.Tensor) -> None:
        """Grow each row to its target length (see the module doc). All-or-nothing: every group is
        checked and the heap rows taken before anything changes."""
        rows = req_pool_indices_cpu.to(torch.int64).reshape(-1)
        targets = target_seq_lens_cpu.to(torch.int64).reshape(-1)
        prefilling = ~self.running[rows] | self.partial[rows]
        stepping = rows[~prefilling]
        if bool((targets[~prefilling] != self.logical[stepping] + 1).any()):
            raise HeapError("a running row grows by more than one token: only one decode token per step is supported")
        chunk = prefilling & (targets < self.fill_len[rows])  # a chunk before the prompt's last
        new = prefilling & ~chunk
        plans = [self._growth(group, rows[new], targets[new], stepping) for group in self.groups]
        total = sum(pages for pages, _ in plans) * self.page_size
        refills = self.heap.refills
        taken = self.take(total) if total else torch.empty(0, dtype=torch.int64)
        if not bool(prefilling.any()):
            self.counters.decode_refills += self.heap.refills - refills
        offset = 0
        for group, (pages, evicting) in zip(self.groups, plans):
            mine = taken[offset : offset + pages * self.page_size]
            offset += mine.numel()
            self._grow(group, rows[new], targets[new], stepping, evicting, mine)
        self.logical[rows] = targets
        self.running[rows] = True
        self.partial[rows[prefilling]] = chunk[prefilling]
        self.counters.requests_running_peak = max(self.counters.requests_running_peak, self.requests_running())
        if bool(prefilling.any()):  # a prefill's allocation, where the host may wait: never a decode step's
            self.heap.reserve(self.decode_reserve())

    def free(self, row: int) -> None:
        """Release the row in every group (a row that never got any is a no-op)."""
        self.logical[row] = 0
        self.running[row] = False
        self.final_len[row] = 0
        self.fill_len[row] = 0
        self.partial[row] = False
        self.prefilled[row] = False
        self.request_budget[row] = 0
        self.request_policy[row] = None
        self._release_held(row)
        for group in self.groups:
            group.evictions.pop(row, None)
            if group.table.is_active(row):
                self.heap.give(group.table.release(row))
            if bool(group.score_table[row, 0, 0]):
                held = group.score_table[row]
                self.heap.give(held[held > 0])
                group.score_table[row] = 0

    def expect(
        self,
        rows: list[int],
        final_lens: list[int],
        fill_lens: list[int] | None = None,
        settings: list[RequestSparsity] | None = None,
    ) -> None:
        """The requests SGLang just gave these rows will reach at most these lengths (their
        prompt and max new tokens): those that outgrow their budget in a group get score rows
        there. `fill_lens`: the lengths their prefills reach (a shorter allocation is a chunk).
        `settings`: each request's own (`request_sparsity.py`; default the server's)."""
        index = torch.tensor(rows, dtype=torch.int64)
        self.final_len[index] = torch.tensor(final_lens, dtype=torch.int64)
        if fill_lens is not None:
            self.fill_len[index] = torch.tensor(fill_lens, dtype=torch.int64)
        settings = settings if settings is not None else [SERVER_SETTING] * len(rows)
        self.request_budget[index] = torch.tensor([s.row_budget(self.resolved) for s in settings], dtype=torch.int64)
        for row, setting in zip(rows, settings):
            self.request_policy[row] = setting.policy
        counts = self.counters.requests_by_setting
        for setting, continuing in zip(settings, self.running[index].tolist()):
            if not continuing:  # a chunked prompt's later chunks keep the row it got first
                counts[setting.label] = counts.get(setting.label, 0) + 1

    def clear(self) -> None:
        """Release every row, the deferred evictions and the prefix store, giving rows back."""
        if self.released is not None:
            self.released.settle(wait=True)
        for row in torch.nonzero(self.running).flatten().tolist():
            self.free(row)
        self.finish_forward()
        if self.store is not None:
            self.heap.give(self.store.clear())

    def reset_allocator(self) -> None:
        """SGLang reset its allocator (every row is free again): forget what we held."""
        for group in self.groups:
            for row in group.table.active_rows().tolist():
                group.table.release(row)
            group.evictions.clear()
            group.score_table.zero_()
        self.logical.zero_()
        self.running.zero_()
        self.final_len.zero_()
        self.fill_len.zero_()
        self.partial.zero_()
        self.prefilled.zero_()
        self.request_budget.zero_()
        self.request_policy = [None] * len(self.request_policy)
        self._held.clear()
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

    def hold_for_next_chunk(self, row: int, full_ids: torch.Tensor) -> None:
        """The request in `row` continues its prefill in a later chunk that reads these ids (its
        prompt so far): hold their store blocks until then, in place of what it held before."""
        blocks = self.store.blocks_of(full_ids)
        self.store.hold(blocks)
        self._release_held(row)
        self._held[row] = blocks

    def continues_chunks(self, row: int) -> bool:
        """Whether the request in `row` is past the first chunk of a chunked prefill."""
        return row in self._held

    def read_held(self, row: int) -> None:
        """The request in `row` is in its last chunk: what it held is pinned for this forward,
        after which it is an ordinary cache entry."""
        blocks = self._held.get(row)
        if blocks is not None:
            self.store.pin_blocks(blocks)
            self._release_held(row)

    def _release_held(self, row: int) -> None:
        blocks = self._held.pop(row, None)
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

    # -- admission and SGLang's decode check ---------------------------------------------------
    def rows_to_hold(self, final_len: int, budget: int = 0) -> int:
        """Most heap rows a request reaching `final_len` tokens holds in the sparse columns
        (`budget`: its own, `RequestSparsity.row_budget`; 0 for the groups')."""
        return sum(self.layout.sparse_rows(group.spec, final_len, budget) for group in self.groups)

    def row_rows_to_hold(self, row: int, final_len: int) -> int:
        """`rows_to_hold` of the request in `row`, at its own budget."""
        return self.rows_to_hold(final_len, int(self.request_budget[row]))

    def prefill_peak_rows(self, prompt_len: int, chunk_size: int | None, budget: int = 0) -> int:
        """Most heap rows a prompt's prefill holds: its SGLang ids and entries, and, prefilled in
        chunks of `chunk_size`, its earlier chunks in the prefix store until the last chunk has
        read them, and, when it keeps by the guide, its last forward's tokens for the length of
        that forward (`guide_rows`): together at most one row per sparse column and token."""
        held = self.layout.rows_held(prompt_len, budget)
        chunked = chunk_size is not None and 0 < chunk_size < prompt_len and self.store is not None
        if chunked:  # the earlier chunks in the store and a guided last chunk's tokens: one row per column
            return held + self.store.rows_per_block * -(-prompt_len // self.page_size)
        return held + (self.guide_rows(prompt_len) if self.waits_for_guide(prompt_len, budget) else 0)

    def prefill_charge(self, prefix_len: int, end: int, fill_len: int, final_len: int, budget: int = 0) -> int:
        """Heap rows a prefill of tokens [prefix_len, end) of a request whose prefill reaches
        `fill_len` takes beyond SGLang's own ids: a chunk before the last stores its tokens in the
        prefix store (whole blocks), the last chunk (or the whole prompt) the request's entries
        (at its own `budget`, 0 for the groups') and, when it keeps by the guide, the rows its
        new tokens wait in until the guide has chosen (`guide_rows`, back after the forward)."""
        if end >= fill_len or self.store is None:
            return self.rows_to_hold(final_len, budget) + self.prefill_guide_rows(prefix_len, end, fill_len, budget)
        blocks = -(-(end - prefix_len) // self.page_size)
        return blocks * self.store.rows_per_block

    def prefill_guide_rows(self, prefix_len: int, end: int, fill_len: int, budget: int = 0) -> int:
        """Of `prefill_charge`, the rows a guided prefill's last forward (tokens [prefix_len, end)
        of a prefill reaching `fill_len`) takes only until it has been issued (`guide_rows`)."""
        last = end >= fill_len or self.store is None
        return self.guide_rows(end - prefix_len) if last and self.waits_for_guide(fill_len, budget) else 0

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

    def waits_for_guide(self, seq_len: int, budget: int = 0) -> bool:
        """Whether a prefill reaching `seq_len` tokens at this `budget` (0: the groups') keeps by
        the guide in some group, so that its new tokens wait for it (`guide_rows`)."""
        lengths = torch.tensor([seq_len])
        for group in self.groups:
            guided = self.guided(torch.tensor([budget or group.spec.budget]), lengths)
            if guided is not None and bool(guided.any()):
                return True
        return False

    def guide_rows(self, tokens: int) -> int:
        """Heap rows `tokens` new tokens of a guided prefill wait in, one per sparse column (whole
        pages), from the sparse layers' own attention until the guide has chosen."""
        return round_up(tokens, self.page_size) * self.layout.num_columns

    def take_for_forward(self, rows: int) -> torch.Tensor:
        """`rows` heap rows (host) that this forward uses and gives back once it has been issued
        (`finish_forward`), as an eviction's old rows."""
        taken = self.take(rows)
        self._deferred.append(taken)
        return taken

    def rows_held(self, row: int) -> int:
        """Heap rows the request in `row` holds in the sparse columns now (scores included)."""
        return sum(
            group.columns * round_up(group.table.length(row), self.page_size) + int((group.score_table[row] > 0).sum())
            for group in self.groups
            if group.table.is_active(row)
        )

    def score_slots(self, group: SparseGroup, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Score slots [n, columns] of entries at `positions` of request `rows` (both [n]): in the
        request's score rows, or scratch slots in the padding row for a request that never evicts."""
        per_row = self.scores_per_row
        pages = group.score_table[rows, :, positions // per_row]  # [n, columns]
        return pages * per_row + (positions % per_row)[:, None]

    def rows_for_next_decode(self, rows: list[int]) -> int:
        """Fresh heap rows the next decode step of `rows` takes in the sparse columns (the rows an
        eviction frees come back only after the forward, so they are not netted)."""
        index = torch.tensor(rows, dtype=torch.int64)
        total = 0
        for group in self.groups:
            held = group.table.lengths[index]
            kept = torch.where(held == self.max_entries(group, index), self.budgets(group, index), held)
            total += int((kept % self.page_size == 0).sum()) * group.columns * self.page_size
        return total

    def reusable_prefix_len(self, prefix_ids: torch.Tensor, seq_len: int) -> int:
        """How much of a radix match of `prefix_ids` a prefill of `seq_len` tokens can reuse: the
        leading ids with store entries, leaving the last `observed` tokens (the queries the
        policies score with) to the prefill, whole pages only. 0 without a store."""
        if self.store is None:
            return 0
        self.released.settle()  # adoptions that have landed
        usable = max(min(self.store.valid_prefix_len(prefix_ids), seq_len - self.config.observed), 0)
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
        """The distinct own settings (row budget, policy) of the running requests, as the sparse
        layers group them (`RequestSparsity.grouping`); the server's is not one."""
        rows = torch.nonzero(self.running).flatten().tolist()
        settings = {(int(self.request_budget[row]), self.request_policy[row]) for row in rows}
        return settings - {SERVER_GROUPING}

    def requests_running(self) -> int:
        return int(self.running.sum())

    def running_rows(self) -> torch.Tensor:
        return torch.nonzero(self.running).flatten()

    def sparse_rows(self, group: SparseGroup) -> int:
        """Heap rows the group's requests hold: entries (pending evictions' included) and scores."""
        return group.table.rows_held() + self.score_rows(group)

    def score_rows(self, group: SparseGroup) -> int:
        return int((group.score_table > 0).sum())

    def deferred_rows(self) -> int:
        return sum(rows.numel() for rows in self._deferred)

    def budgets(self, group: SparseGroup, rows: torch.Tensor) -> torch.Tensor:
        """Each request row's budget in the group: its own, or the group's."""
        own = self.request_budget[rows]
        return torch.where(own > 0, own, group.spec.budget)

    def max_entries(self, group: SparseGroup, rows: torch.Tensor) -> torch.Tensor:
        """Each request row's most entries in the group (it evicts on reaching them)."""
        own = self.request_budget[rows]
        mine = (own + self.config.evict_page).clamp(max=self.resolved.context_len)
        return torch.where(own > 0, mine, group.spec.max_entries)

    def _score_rows(self, group: SparseGroup, rows: torch.Tensor) -> list[int]:
        """Score rows per column each request row holds in the group if it evicts."""
        return [self.layout.score_rows(n) for n in self.max_entries(group, rows).tolist()]

    # -- internals -------------------------------------------------------------------------
    def _scored(self, group: SparseGroup, rows: torch.Tensor) -> torch.Tensor:
        """Which of these new rows will evict in the group (one of unknown final length may grow
        to the context length)."""
        final = self.final_len[rows]
        final = torch.where(final == 0, self.resolved.context_len, final)
        return final > self.max_entries(group, rows)

    def _growth(
        self, group: SparseGroup, new_rows: torch.Tensor, new_lens: torch.Tensor, stepping: torch.Tensor
    ) -> tuple[int, torch.Tensor]:
        """(pages the group needs for this allocation, the stepping rows that evict first)."""
        table = group.table
        if bool(table.active[new_rows].any()):
            raise HeapError("a new request row still holds sparse entries")
        kept_new = torch.minimum(new_lens, self.budgets(group, new_rows))
        pages = sum(table.pages_for(int(n)) for n in kept_new)
        scored = self._scored(group, new_rows)
        score_rows = sum(n for n, with_scores in zip(self._score_rows(group, new_rows), scored.tolist()) if with_scores)
        pages += score_rows * group.columns // self.page_size
        if stepping.numel() and not bool(table.active[stepping].all()):
            raise HeapError("a decoding row holds no sparse entries")
        held = table.lengths[stepping]
        full = held == self.max_entries(group, stepping)
        evicting = stepping[full]
        if any(int(row) in group.evictions for row in evicting):
            raise HeapError("a row evicts again before its previous eviction ran in a forward")
        kept = torch.where(full, self.budgets(group, stepping), held)
        pages += int((kept % self.page_size == 0).sum()) * group.columns
        return pages, evicting

    def _grow(
        self,
        group: SparseGroup,
        new_rows: torch.Tensor,
        new_lens: torch.Tensor,
        stepping: torch.Tensor,
        evicting: torch.Tensor,
        rows: torch.Tensor,
    ) -> None:
        table = group.table
        offset = 0
        budgets = self.budgets(group, new_rows).tolist()
        scored = self._scored(group, new_rows).tolist()
        score_rows = self._score_rows(group, new_rows)
        news = zip(new_rows.tolist(), new_lens.tolist(), budgets, scored, score_rows)
        for row, n, budget, with_scores, width in news:
            kept = min(n, budget)
            take = table.pages_for(kept) * self.page_size
            table.assign(row, kept, rows[offset : offset + take])
            offset += take
            if with_scores:
                take = group.columns * width
                group.score_table[row, :, :width] = rows[offset : offset + take].view(group.columns, width)
                offset += take
        group.mirror_rows(new_rows)
        for row, budget in zip(evicting.tolist(), self.budgets(group, evicting).tolist()):
            group.evictions[row] = table.entries(row)
            self._deferred.append(table.shrink(row, budget))
        growing = table.rows_needing_page(stepping)
        starts = table.lengths[growing]
        table.append(stepping, rows[offset:])
        group.mirror_pages(growing, starts)

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
        running = self.running_rows()
        page = self.page_size
        total = 0
        for group in self.groups:
            rows = running[group.table.active[running]]
            final = self.final_len[rows]
            final = torch.where(final == 0, self.resolved.context_len, final)
            most = torch.minimum(self.max_entries(group, rows), final)
            pages = (most + page - 1) // page - (group.table.lengths[rows] + page - 1) // page
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

    def describe_tables(self) -> str:
        """The row tables' size, for the start-up log: a request's row is as wide as the largest
        budget a request may ask for (`max_request_budget`), in every group."""
        host = sum(g.table.table.nbytes + g.score_table.nbytes for g in self.groups)
        device = sum(g.device_table.nbytes + g.device_scores.nbytes for g in self.groups)
        widths = ", ".join(str(g.table.max_entries) for g in self.groups) or "none"
        return (
            f"row tables: {self.running.numel()} request rows x {widths} entries: "
            f"{host / 2**20:.1f} MiB on the host, {device / 2**20:.1f} MiB on the device"
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
