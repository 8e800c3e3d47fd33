"""The sparse layers' per-request state inside one scheduler process (no SGLang imports).

`SparseState` is the `AuxCache` SGLang keeps in step with its requests (`ReqToTokenPool`):
SGLang calls `alloc_to_lengths` when requests grow (prefill, then one token per decode step) and
`free` on every release path (finish, abort, retraction). It owns each request's record
(`Requests`), per group of sparse columns a `SparseGroup` (each request's entries, score rows and
pending eviction), the `PrefixStore` of cached prompt tokens, and the `Heap` through which they
all take and give rows of the one KV heap, shared with SGLang's full layers.

A request (at its own budget and policy, `request_sparsity.py`) keeps min(length, budget)
entries per sparse column at its prefill, appends one per decode step, and on reaching its
`max_entries` (budget + evict_page) is cut back to its budget at the step's allocation; that
decode forward moves the best-scored old entries into the kept positions, and the cut rows go
back only once the forward has been issued (`finish_forward`). A prompt prefilled in chunks keeps
nothing until its last chunk, which reads the earlier chunks back from the prefix store and
selects with the whole prompt in view. A forward first changes the state (`begin_extend` /
`begin_decode`), then `planning.py` builds its plan, reading the state only. Score rows (the K
bytes of heap rows as float32) are taken only by requests that will evict; the others' score
writes go to scratch slots of the padding row.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from sglang_kvsparse.config import ResolvedSparsity
from sglang_kvsparse.state.admission import decode_reserve
from sglang_kvsparse.state.contracts import HeapRows
from sglang_kvsparse.state.counters import Counters
from sglang_kvsparse.state.entry_table import EntryTable, HeapError
from sglang_kvsparse.state.heap import Heap
from sglang_kvsparse.state.layout import HeapLayout, round_up, scores_per_row
from sglang_kvsparse.state.steps import EvictingRequests, ExtendStep, indptr, ranges

if TYPE_CHECKING:
    from sglang_kvsparse.policies.sentences import SentenceMarks
from sglang_kvsparse.config.request_sparsity import SERVER_SETTING, RequestSparsity
from sglang_kvsparse.policies import ScoringPolicy
from sglang_kvsparse.state.prefix_store import PrefixStore
from sglang_kvsparse.state.released_ids import ReleasedIds
from sglang_kvsparse.state.requests import Phase, Requests
from sglang_kvsparse.state.sparse_group import LaneBuffers, SparseGroup


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
        sentence_marks: SentenceMarks | None = None,
    ) -> None:
        """`heap`: SGLang's allocator, raw (ids 1..heap_rows, pages of `heap.page_size`).
        `prefix_cache`: keep prompt tokens' sparse K/V for radix-tree hits (SGLang's cache is on).
        `sentence_marks`: the server's, when it has a tokenizer."""
        self.resolved = resolved
        self.config = resolved.config
        self.page_size = heap.page_size
        self.scores_per_row = scores_per_row(lanes[0].k.shape[2], lanes[0].k.element_size())
        self.layout = HeapLayout.from_resolved(resolved, self.scores_per_row, self.page_size)
        if len(lanes) != self.layout.lanes:
            raise ValueError(f"{len(lanes)} lane buffers for a layout of {self.layout.lanes} lanes")
        self.policy = resolved.config.policy
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
            self.groups.append(
                SparseGroup(spec, table, first, scores, device_table, device_scores, self.scores_per_row)
            )
            first += len(spec.columns)
        with_store = prefix_cache and self.groups
        self.store = PrefixStore.for_layout(self.layout, heap_rows, self.config.sink) if with_store else None
        self.requests = Requests(max_requests)
        self.counters = Counters()
        #: SGLang's freed ids on their way to the host, for the prefix store (None without one).
        self.released = ReleasedIds(self.store, heap, self.counters) if self.store is not None else None
        self.heap = Heap(heap, self.store, self.released, self.describe_heap)
        self.sentence_marks = sentence_marks

    # -- AuxCache (called by SGLang's ReqToTokenPool) --------------------------------------
    def alloc_to_lengths(self, *, req_pool_indices_cpu: torch.Tensor, target_seq_lens_cpu: torch.Tensor) -> None:
        """Grow each request to its target length: a prefill gets min(length, budget) entries per
        sparse column, and score rows where it will evict; a decode step appends one entry, first
        cutting a request that holds its `max_entries` back to its budget (the evicted heap rows go
        back after the forward). All-or-nothing: every group and phase is checked and the heap
        rows taken before anything changes."""
        req_indices = req_pool_indices_cpu.to(torch.int64).reshape(-1)
        targets = target_seq_lens_cpu.to(torch.int64).reshape(-1)
        requests = self.requests
        phases = requests.phase[req_indices]
        if bool((phases == Phase.FREE).any()):
            raise HeapError("SGLang allocated tokens for a request index the sparse layers never admitted")
        prefilling = phases <= Phase.CHUNKED
        stepping = req_indices[~prefilling]
        if bool((targets[~prefilling] != requests.length[stepping] + 1).any()):
            raise HeapError(
                "a running request grows by more than one token: only one decode token per step is supported"
            )
        chunk = prefilling & (targets < requests.fill_len[req_indices])  # a chunk before the prompt's last
        new = prefilling & ~chunk
        new_indices, new_lens = req_indices[new], targets[new]
        plans = []
        for group in self.groups:
            kept_new = torch.minimum(new_lens, self.budgets(group, new_indices))
            widths = self._score_widths(group, new_indices)
            pages, evicting = group.growth(
                new_indices,
                kept_new,
                widths,
                stepping,
                self.max_entries(group, stepping),
                self.budgets(group, stepping),
            )
            plans.append((kept_new, widths, pages, evicting))
        total = sum(pages for _, _, pages, _ in plans) * self.page_size
        refills = self.heap.refills
        taken = self.heap.take(total) if total else torch.empty(0, dtype=torch.int64)
        if not bool(prefilling.any()):
            self.counters.add(decode_refills=self.heap.refills - refills)
        offset = 0
        for group, (kept_new, widths, pages, evicting) in zip(self.groups, plans):
            mine = taken[offset : offset + pages * self.page_size]
            offset += mine.numel()
            cut = group.grow(new_indices, kept_new, widths, stepping, evicting, self.budgets(group, evicting), mine)
            if cut.numel():
                self.heap.defer(cut)
        requests.set_length(req_indices, targets)
        requests.move(req_indices[chunk], Phase.CHUNKED)
        requests.move(req_indices[new], Phase.PREFILLING)
        requests.move(stepping, Phase.DECODING)
        self.counters.peak(requests_running_peak=self.requests_running())
        if bool(prefilling.any()):  # a prefill's allocation, where the host may wait: never a decode step's
            self.heap.reserve(decode_reserve(self))

    def free(self, req_idx: int) -> None:
        """Release what the request at `req_idx` holds in every group (none: a no-op)."""
        if self.store is not None:
            self.heap.give(self.store.release_held(req_idx))
        self.requests.release(req_idx)
        for group in self.groups:
            self.heap.give(group.release(req_idx))

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
        settings = settings if settings is not None else [SERVER_SETTING] * len(req_indices)
        new = self.requests.admit(
            torch.tensor(req_indices, dtype=torch.int64),
            torch.tensor(final_lens, dtype=torch.int64),
            None if fill_lens is None else torch.tensor(fill_lens, dtype=torch.int64),
            settings,
            lambda setting: setting.own_budget(self.resolved),
        )
        for setting in (s for s, is_new in zip(settings, new.tolist()) if is_new):
            self.counters.count_setting(setting.label)

    def clear(self) -> None:
        """Release every request, the deferred evictions and the prefix store, giving rows back."""
        if self.released is not None:
            self.released.settle(wait=True)
        for req_idx in self.requests.held_requests().tolist():
            self.free(req_idx)
        self.finish_forward()
        if self.store is not None:
            self.heap.give(self.store.clear())

    def reset_allocator(self) -> None:
        """SGLang reset its allocator (every row is free again): forget what we held."""
        for group in self.groups:
            group.reset()
        self.requests.reset()
        self.heap.forget_deferred()
        if self.store is not None:
            self.store.clear()
            self.released.clear()

    # -- a forward's changes, before it is planned ---------------------------------------
    def begin_extend(
        self,
        req_indices: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        prefix_ids: Sequence[torch.Tensor] = (),
        new_ids: torch.Tensor | None = None,
    ) -> ExtendStep:
        """A prefill forward: counted; the prefix store read and written (a last chunk's held
        blocks pinned, a chunk's tokens stored and held for the prompt's next chunk, other new
        tokens stored where the heap has room); the heap rows a guided prefill's new tokens wait
        in taken; the host free list topped up. With the prefix store, `prefix_ids` (per
        request, SGLang's full-pool ids of its matched prefix) and `new_ids` (the batch's new
        tokens' ids, request-major) are required."""
        index = torch.tensor(list(req_indices), dtype=torch.int64)
        prefix = torch.tensor([int(n) for n in prefix_lens], dtype=torch.int64)
        extend = torch.tensor([int(n) for n in extend_lens], dtype=torch.int64)
        if bool(prefix.any()) and self.store is None:
            raise HeapError("an extend with a cached prefix reached the sparse layers without a prefix store")
        partial = self.requests.is_(Phase.CHUNKED, index)
        held = self.store.held_by if self.store is not None else {}
        hits = [int(n) for n, i in zip(prefix, index.tolist()) if n and i not in held]
        policies = {self.requests.policy[i] or self.policy for i in index.tolist()}
        self.counters.add(
            forward_plans=1, chunks_stored=int(partial.sum()), prefix_hits=len(hits), prefix_tokens_reused=sum(hits)
        )
        self.counters.peak(scoring_passes_peak=len(policies) or 1)
        step = ExtendStep(index, prefix, extend, partial)
        if self.store is not None:
            if new_ids is None or len(prefix_ids) != len(index):
                raise HeapError("a prefill with the prefix store needs every request's prefix ids and the new ids")
            prefix_rows, store_rows, store_positions = self._use_store(step, prefix_ids, new_ids)
            step = replace(step, prefix_rows=prefix_rows, store_rows=store_rows, store_positions=store_positions)
        elif bool(partial.any()):
            raise HeapError("a chunked prefill reached the sparse layers without a prefix store")
        work_rows, work_positions = self._take_guide_rows(step)
        step = replace(step, work_rows=work_rows, work_positions=work_positions)
        # The store took its rows: top the host free list up again to what the running requests'
        # decode steps will take (as the prefill's allocation did), so none waits on the device.
        self.heap.reserve(decode_reserve(self))
        return step

    def begin_decode(self, req_indices: Sequence[int]) -> list[EvictingRequests]:
        """A decode step: its evictions (cut by the allocation) taken off the groups, one record
        per group and (budget, policy) among them."""
        self.counters.add(forward_plans=1)
        listed = [int(i) for i in req_indices]
        evicting_groups = []
        for g, group in enumerate(self.groups):
            if not group.evictions:  # most steps: no Python pass over the batch
                continue
            olds = group.take_evictions(listed)
            evicting = list(olds)
            members: dict[tuple[int, ScoringPolicy | None], list[int]] = {}
            budgets = self.budgets(group, torch.tensor(evicting, dtype=torch.int64)).tolist()
            sliding = bool(group.spec.sliding_window)  # ranked by recency, whatever the request's policy
            for req_idx, budget in zip(evicting, budgets):
                members.setdefault((budget, None if sliding else self.requests.policy[req_idx]), []).append(req_idx)
            for (budget, policy), indices in members.items():
                evicting_groups.append(EvictingRequests(g, budget, policy, indices, [olds[i] for i in indices]))
            self.counters.add(evictions=len(evicting))
        self.counters.peak(evictions_per_step_peak=len(evicting_groups))
        return evicting_groups

    def finish_forward(self) -> None:
        """The step's forward has been issued: give back the rows its evictions read, and unpin
        the prefixes its prefill read."""
        self.heap.finish_forward()
        if self.store is not None:
            self.store.unpin_all()

    # -- the prefix store ----------------------------------------------------------------
    def reusable_prefix_len(self, prefix_ids: torch.Tensor, seq_len: int, own_budget: int = 0) -> int:
        """How much of a radix match of `prefix_ids` a prefill of `seq_len` tokens (at this own
        budget; 0: the groups') can reuse: the leading ids with store entries whose sliding
        columns still hold what the prefill reads (`PrefixStore.valid_prefix_len`), whole pages
        only, leaving the last `window` tokens (the queries the policies score with) to a
        prefill that selects by score; one that keeps every token in every sparse group reuses
        the whole match, as stock SGLang does. 0 without a store."""
        if self.store is None:
            return 0
        self.released.settle()  # adoptions that have landed
        scored = (group for group in self.groups if not group.spec.sliding_window)  # recency needs no queries
        selects = any(seq_len > int(group.budgets(torch.tensor([own_budget]))[0]) for group in scored)
        return self.store.valid_prefix_len(prefix_ids, limit=seq_len - (self.config.window if selects else 0))

    def pin_prefix(self, prefix_ids: torch.Tensor) -> None:
        """Keep the prefix's store blocks until the forward that reads them has been issued."""
        if self.store is not None:
            self.store.pin(prefix_ids)

    def unpin_prefix(self, prefix_ids: torch.Tensor) -> None:
        if self.store is not None:
            self.store.unpin(prefix_ids)

    # -- queries -------------------------------------------------------------------------
    def rows_held(self, req_idx: int) -> int:
        """Heap rows the request at `req_idx` holds in the sparse columns now (scores included)."""
        return sum(
            group.columns * round_up(group.table.count(req_idx), self.page_size)
            + int((group.score_table[req_idx] > 0).sum())
            for group in self.groups
            if group.table.is_active(req_idx)
        )

    def requests_running(self) -> int:
        return int(self.requests.running().sum())

    def budgets(self, group: SparseGroup, req_indices: torch.Tensor) -> torch.Tensor:
        """Each of these requests' budget in the group (`SparseGroup.budgets`)."""
        return group.budgets(self.requests.budget[req_indices])

    def max_entries(self, group: SparseGroup, req_indices: torch.Tensor) -> torch.Tensor:
        """Each of these requests' most entries in the group (it evicts on reaching them)."""
        return group.max_entries(self.requests.budget[req_indices], self.config.evict_page, self.resolved.context_len)

    def describe_heap(self) -> str:
        """Who holds the heap's rows, for an error message."""
        store = "no store"
        if self.store is not None:
            store = f"prefix store {self.store.rows()} ({self.heap.reclaimable_rows()} reclaimable)"
        sparse = ", ".join(f"group {i}: {g.rows_held()}" for i, g in enumerate(self.groups))
        return (
            f"{self.requests_running()} requests, sparse rows {sparse}; {store}; "
            f"{self.heap.deferred_rows()} evicted rows awaiting the forward"
        )

    # -- growth (alloc_to_lengths) -------------------------------------------------------
    def _score_widths(self, group: SparseGroup, req_indices: torch.Tensor) -> list[int]:
        """Score rows per column each of these new requests takes in the group: those of its
        `max_entries` if it will evict (one of unknown final length may grow to the context
        length), else none."""
        most = self.max_entries(group, req_indices)
        final = self.requests.final_len[req_indices]
        evicts = torch.where(final == 0, self.resolved.context_len, final) > most
        return [self.layout.score_rows(n) if e else 0 for n, e in zip(most.tolist(), evicts.tolist())]

    # -- a prefill's store and guide rows (begin_extend) ---------------------------------
    def _take_guide_rows(self, step: ExtendStep) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
        """(per column, the heap rows [n] (none in a sliding column) the new tokens of the requests some group keeps by
        the guide wait in; their positions [n] among the batch's new tokens). Admission charged them
        (`prefill_charge`); they go back once the forward has been issued."""
        seq_lens = step.seq_lens
        waiting = torch.zeros(len(step.req_indices), dtype=torch.bool)
        for group in self.groups:
            guided = group.guided(self.resolved, self.requests.budget[step.req_indices], seq_lens)
            if guided is not None:
                waiting |= guided & ~step.partial
        if not bool(waiting.any()):
            return (), None
        positions = ranges(indptr(step.extend_lens)[:-1][waiting], step.extend_lens[waiting])
        rows = self.layout.guide_rows(positions.numel())
        self.counters.peak(guide_rows_peak=rows)
        taken = iter(self.heap.take_for_forward(rows).view(self.layout.guided_columns, -1)[:, : positions.numel()])
        none = torch.empty(0, dtype=torch.int64)
        rows_of = [none if g.spec.sliding_window else next(taken) for g in self.groups for _ in range(g.columns)]
        return tuple(rows_of), positions

    def _use_store(
        self, step: ExtendStep, prefix_ids: Sequence[torch.Tensor], new_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(the prefixes' store rows [num_columns, n_prefix], the stored new tokens' store rows
        [num_columns, n_stored], those tokens' positions among the batch's new tokens [n_stored]).

        A last chunk's held blocks are pinned for this forward; the tokens of chunks before a
        prompt's last are stored (admission charged their rows) and their request holds its prompt
        so far for its next chunk; only then, best effort, the other new tokens get store rows,
        which may reclaim unpinned, unheld store blocks (and narrow held ones: the prefix rows are
        looked up last)."""
        store, index, partial, extend = self.store, step.req_indices, step.partial, step.extend_lens
        parts = [ids.to("cpu", torch.int64) for ids in prefix_ids]
        prefix = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        store.touch(prefix)
        for req_idx in index[~partial].tolist():
            self.heap.give(store.read_held(req_idx))  # pinned before any take below, which may reclaim the store
        new = new_ids.to("cpu", torch.int64)
        chunk_tokens = partial.repeat_interleave(extend)
        must, rest = torch.nonzero(chunk_tokens).flatten(), torch.nonzero(~chunk_tokens).flatten()
        blocks = -(-must.numel() // store.page_size)
        chunk_rows = store.put(new[must], self.heap.take(blocks * store.rows_per_block)) if must.numel() else None
        if chunk_rows is not None and chunk_rows.shape[0] != must.numel():
            raise HeapError(f"the prefix store took {chunk_rows.shape[0]} of a chunk's {must.numel()} tokens")
        news = new.split(extend.tolist())
        for b in torch.nonzero(partial).flatten().tolist():  # held before the best-effort take below
            self.heap.give(store.hold_for(int(index[b]), torch.cat([parts[b], news[b]])))
        wanted = -(-rest.numel() // store.page_size) * store.rows_per_block
        stored = store.put(new[rest], self.heap.take_for_store(wanted)) if rest.numel() else None
        row_parts = [r for r in (chunk_rows, stored) if r is not None]
        rows = torch.cat(row_parts) if row_parts else torch.empty(0, store.columns, dtype=torch.int64)
        positions = torch.cat([must, rest[: 0 if stored is None else stored.shape[0]]])
        return store.lookup(prefix).T, rows.T, positions  # after the takes, which may narrow blocks
