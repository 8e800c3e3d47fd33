"""One lane of the heap's K/V buffers, and one group of sparse columns: its requests' entry and
score tables, their device mirrors and pending evictions, and how they change when SGLang
allocates a step (`growth`, then `grow`), when a decode step takes its evictions
(`take_evictions`) and when a request leaves (`release`). The heap rows and each request's
budget come from the caller (`SparseState`); no SGLang imports."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from sglang_kvsparse.config import ResolvedSparsity
from sglang_kvsparse.state.entry_table import EntryTable, HeapError
from sglang_kvsparse.state.layout import GroupSpec


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
    """One group of sparse columns: its spec, its requests' entries and pending evictions."""

    spec: GroupSpec
    table: EntryTable
    #: First global column index of the group (columns are numbered across groups).
    first_column: int
    #: Request index -> heap rows of its scores, [columns, score rows of the widest request]
    #: (0: none; a request holds those of its own `max_entries`, the rest stay 0).
    score_table: torch.Tensor
    #: What the decode kernels read, on the lanes' device (int32): `table.table` and
    #: `score_table`, brought up to date by the next forward's plan wherever the host tables
    #: changed what a reader sees (a new request's entries and score rows, a page appended), so a
    #: step copies only those few entries, in the plan's one upload (`stale_entries`).
    device_table: torch.Tensor
    device_scores: torch.Tensor
    #: Entries whose scores one score row holds (`layout.scores_per_row`).
    scores_per_row: int
    #: Request index -> its entries before this step's eviction, [its max_entries, columns].
    evictions: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Host-table changes the device tables do not have yet: requests (indices) whose entries
    #: and score rows changed, and (request indices, first positions) of pages appended.
    stale_requests: list[torch.Tensor] = field(default_factory=list)
    stale_pages: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def mirror_requests(self, req_indices: torch.Tensor) -> None:
        """These requests' entries and score rows changed (a prefill): the next plan copies them."""
        if req_indices.numel():
            self.stale_requests.append(req_indices.clone())

    def mirror_pages(self, req_indices: torch.Tensor, starts: torch.Tensor) -> None:
        """Request req_indices[i] got the page starting at position starts[i]: the next plan
        copies it."""
        if req_indices.numel():
            self.stale_pages.append((req_indices.clone(), starts.clone()))

    def stale_entries(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(flat indices into `device_table`, their values, flat indices into `device_scores`,
        their values), all host, from the host tables as they are now (an index changed twice is
        copied once, at its last value); the pending changes are forgotten."""
        table, page = self.table, self.table.page_size
        width = table.capacity * self.columns
        entry_parts = []
        for req_indices in self.stale_requests:
            lengths = (table.counts[req_indices] + page - 1) // page * page
            entry_parts.append(_line_spans(req_indices, lengths * self.columns, width))
        for req_indices, starts in self.stale_pages:
            first = req_indices * width + starts * self.columns
            entry_parts.append((first[:, None] + torch.arange(page * self.columns)).reshape(-1))
        entries = torch.cat(entry_parts).unique() if entry_parts else torch.empty(0, dtype=torch.int64)
        scores = torch.empty(0, dtype=torch.int64)
        if self.stale_requests:
            score_width = self.score_table[0].numel()
            req_indices = torch.cat(self.stale_requests).unique()
            scores = (req_indices[:, None] * score_width + torch.arange(score_width)).reshape(-1)
        self.stale_requests.clear()
        self.stale_pages.clear()
        return entries, table.table.view(-1)[entries], scores, self.score_table.view(-1)[scores]

    @property
    def columns(self) -> int:
        return len(self.spec.columns)

    def budgets(self, own: torch.Tensor) -> torch.Tensor:
        """`GroupSpec.budgets`."""
        return self.spec.budgets(own)

    def guided(self, resolved: ResolvedSparsity, own: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """`GroupSpec.guided`."""
        return self.spec.guided(resolved, own, seq_lens)

    def max_entries(self, own: torch.Tensor, evict_page: int, context_len: int) -> torch.Tensor:
        """The most entries in this group of requests with these own budgets (`budgets`): they
        evict on reaching them."""
        if self.spec.sliding_window:
            return torch.full_like(own, self.spec.max_entries)
        return torch.where(own > 0, (own + evict_page).clamp(max=context_len), self.spec.max_entries)

    def score_slots(self, req_indices: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Score slots [n, columns] of entries at `positions` of these requests (both [n]): in the
        request's score rows, or scratch slots in the padding row for a request that never evicts."""
        per_row = self.scores_per_row
        pages = self.score_table[req_indices, :, positions // per_row]  # [n, columns]
        return pages * per_row + (positions % per_row)[:, None]

    # -- what a step's allocation changes ------------------------------------------------------
    def growth(
        self,
        new: torch.Tensor,
        kept_new: torch.Tensor,
        score_widths: list[int],
        stepping: torch.Tensor,
        max_entries: torch.Tensor,
        budgets: torch.Tensor,
    ) -> tuple[int, torch.Tensor]:
        """(pages this allocation takes in the group, which stepping requests evict first): the
        `new` requests keep `kept_new` entries each and score rows of `score_widths` per column
        (0: none), each `stepping` request appends one entry, first cut from its `max_entries`
        back to its budget (`budgets`, both aligned with `stepping`) when it holds them."""
        table = self.table
        if bool(table.active[new].any()):
            raise HeapError("a new request still holds sparse entries")
        pages = sum(table.pages_for(int(n)) for n in kept_new)
        pages += sum(score_widths) * self.columns // table.page_size
        if stepping.numel() and not bool(table.active[stepping].all()):
            raise HeapError("a decoding request holds no sparse entries")
        held = table.counts[stepping]
        full = held == max_entries
        evicting = stepping[full]
        if any(int(req_idx) in self.evictions for req_idx in evicting):
            raise HeapError("a request evicts again before its previous eviction ran in a forward")
        kept = torch.where(full, budgets, held)
        pages += int((kept % table.page_size == 0).sum()) * self.columns
        return pages, evicting

    def grow(
        self,
        new: torch.Tensor,
        kept_new: torch.Tensor,
        score_widths: list[int],
        stepping: torch.Tensor,
        evicting: torch.Tensor,
        evicting_budgets: torch.Tensor,
        rows: torch.Tensor,
    ) -> torch.Tensor:
        """Record what `growth` planned, in the heap `rows` taken for it: the new requests'
        entries and score rows, the evicting requests' cut (their entries before it kept for the
        step's eviction), the stepping requests' appended entries. Returns the heap rows the cut
        freed, which the step's forward still reads."""
        table = self.table
        offset = 0
        for req_idx, kept, width in zip(new.tolist(), kept_new.tolist(), score_widths):
            take = table.pages_for(kept) * table.page_size
            table.assign(req_idx, kept, rows[offset : offset + take])
            offset += take
            if width:
                take = self.columns * width
                self.score_table[req_idx, :, :width] = rows[offset : offset + take].view(self.columns, width)
                offset += take
        self.mirror_requests(new)
        freed = []
        for req_idx, budget in zip(evicting.tolist(), evicting_budgets.tolist()):
            self.evictions[req_idx] = table.entries(req_idx)
            freed.append(table.shrink(req_idx, budget))
        growing = table.needing_page(stepping)
        starts = table.counts[growing]
        table.append(stepping, rows[offset:])
        self.mirror_pages(growing, starts)
        return torch.cat(freed) if freed else torch.empty(0, dtype=torch.int64)

    def take_evictions(self, req_indices: list[int]) -> dict[int, torch.Tensor]:
        """This decode step's evictions (request index -> its entries before the cut), taken off
        the group; every pending one must be in the step's batch."""
        evicting = {i: self.evictions.pop(i) for i in req_indices if i in self.evictions}
        if self.evictions:
            raise HeapError(
                f"requests {sorted(self.evictions)} evicted but are not in this decode batch ({req_indices})"
            )
        return evicting

    def release(self, req_idx: int) -> torch.Tensor:
        """Everything the request holds in the group (entries, score rows; none: empty), as heap
        rows to give back; its pending eviction is dropped."""
        self.evictions.pop(req_idx, None)
        parts = []
        if self.table.is_active(req_idx):
            parts.append(self.table.release(req_idx))
        if bool(self.score_table[req_idx, 0, 0]):
            held = self.score_table[req_idx]
            parts.append(held[held > 0])
            self.score_table[req_idx] = 0
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def reset(self) -> None:
        """SGLang reset its allocator: no request holds anything here any more."""
        for req_idx in self.table.active_requests().tolist():
            self.table.release(req_idx)
        self.evictions.clear()
        self.score_table.zero_()

    def rows_held(self) -> int:
        """Heap rows the group's requests hold: entries (pending evictions' included) and scores."""
        return self.table.rows_held() + self.score_rows()

    def score_rows(self) -> int:
        return int((self.score_table > 0).sum())


def _line_spans(lines: torch.Tensor, counts: torch.Tensor, width: int) -> torch.Tensor:
    """Flat indices of the first counts[i] elements of line lines[i] of a [*, width] table."""
    starts = (lines * width).repeat_interleave(counts)
    offsets = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts).repeat_interleave(counts)
    return starts + offsets
