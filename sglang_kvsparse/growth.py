"""How a request's entries grow when SGLang allocates a step (`SparseState.alloc_to_lengths`):
a prefill gets min(length, budget) entries per sparse column, and score rows where it will evict;
a decode step appends one entry, first cutting a request that holds its `max_entries` back to its
budget (the evicted heap rows go back after the forward, `SparseState.defer`). All-or-nothing:
every group is checked and the heap rows taken before anything changes. No SGLang imports."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sglang_kvsparse.entry_table import HeapError
from sglang_kvsparse.request_table import Phase
from sglang_kvsparse.sparse_group import SparseGroup

if TYPE_CHECKING:
    from sglang_kvsparse.sparse_state import SparseState


def grow_to_lengths(state: SparseState, req_indices: torch.Tensor, targets: torch.Tensor) -> None:
    """Grow each request (host [n] request indices) to its target length."""
    requests = state.requests
    prefilling = requests.phase[req_indices] <= Phase.CHUNKED
    stepping = req_indices[~prefilling]
    if bool((targets[~prefilling] != requests.length[stepping] + 1).any()):
        raise HeapError("a running request grows by more than one token: only one decode token per step is supported")
    chunk = prefilling & (targets < requests.fill_len[req_indices])  # a chunk before the prompt's last
    new = prefilling & ~chunk
    plans = [_growth(state, group, req_indices[new], targets[new], stepping) for group in state.groups]
    total = sum(pages for pages, _ in plans) * state.page_size
    refills = state.heap.refills
    taken = state.take(total) if total else torch.empty(0, dtype=torch.int64)
    if not bool(prefilling.any()):
        state.counters.decode_refills += state.heap.refills - refills
    offset = 0
    for group, (pages, evicting) in zip(state.groups, plans):
        mine = taken[offset : offset + pages * state.page_size]
        offset += mine.numel()
        _grow(state, group, req_indices[new], targets[new], stepping, evicting, mine)
    requests.length[req_indices] = targets
    starting = req_indices[prefilling]
    requests.phase[starting] = torch.where(chunk[prefilling], Phase.CHUNKED, Phase.PREFILLING).to(torch.int8)
    state.counters.requests_running_peak = max(state.counters.requests_running_peak, state.requests_running())
    if bool(prefilling.any()):  # a prefill's allocation, where the host may wait: never a decode step's
        state.heap.reserve(state.decode_reserve())


def _score_rows(state: SparseState, group: SparseGroup, req_indices: torch.Tensor) -> list[int]:
    """Score rows per column each of these requests holds in the group if it evicts."""
    return [state.layout.score_rows(n) for n in state.max_entries(group, req_indices).tolist()]


def _scored(state: SparseState, group: SparseGroup, req_indices: torch.Tensor) -> torch.Tensor:
    """Which of these new requests will evict in the group (one of unknown final length may grow
    to the context length)."""
    final = state.requests.final_len[req_indices]
    final = torch.where(final == 0, state.resolved.context_len, final)
    return final > state.max_entries(group, req_indices)


def _growth(
    state: SparseState, group: SparseGroup, new: torch.Tensor, new_lens: torch.Tensor, stepping: torch.Tensor
) -> tuple[int, torch.Tensor]:
    """(pages the group needs for this allocation, the stepping requests that evict first)."""
    table = group.table
    if bool(table.active[new].any()):
        raise HeapError("a new request still holds sparse entries")
    kept_new = torch.minimum(new_lens, state.budgets(group, new))
    pages = sum(table.pages_for(int(n)) for n in kept_new)
    scored = _scored(state, group, new)
    score_rows = sum(n for n, with_scores in zip(_score_rows(state, group, new), scored.tolist()) if with_scores)
    pages += score_rows * group.columns // state.page_size
    if stepping.numel() and not bool(table.active[stepping].all()):
        raise HeapError("a decoding request holds no sparse entries")
    held = table.lengths[stepping]
    full = held == state.max_entries(group, stepping)
    evicting = stepping[full]
    if any(int(req_idx) in group.evictions for req_idx in evicting):
        raise HeapError("a request evicts again before its previous eviction ran in a forward")
    kept = torch.where(full, state.budgets(group, stepping), held)
    pages += int((kept % state.page_size == 0).sum()) * group.columns
    return pages, evicting


def _grow(
    state: SparseState,
    group: SparseGroup,
    new: torch.Tensor,
    new_lens: torch.Tensor,
    stepping: torch.Tensor,
    evicting: torch.Tensor,
    rows: torch.Tensor,
) -> None:
    """Record the group's growth: the `new` requests' entries and score rows, the `evicting`
    requests' cut, the `stepping` requests' appended entries, all in the heap `rows` taken."""
    table = group.table
    offset = 0
    budgets = state.budgets(group, new).tolist()
    scored = _scored(state, group, new).tolist()
    score_rows = _score_rows(state, group, new)
    for req_idx, n, budget, with_scores, width in zip(new.tolist(), new_lens.tolist(), budgets, scored, score_rows):
        kept = min(n, budget)
        take = table.pages_for(kept) * state.page_size
        table.assign(req_idx, kept, rows[offset : offset + take])
        offset += take
        if with_scores:
            take = group.columns * width
            group.score_table[req_idx, :, :width] = rows[offset : offset + take].view(group.columns, width)
            offset += take
    group.mirror_requests(new)
    for req_idx, budget in zip(evicting.tolist(), state.budgets(group, evicting).tolist()):
        group.evictions[req_idx] = table.entries(req_idx)
        state.defer(table.shrink(req_idx, budget))
    growing = table.needing_page(stepping)
    starts = table.lengths[growing]
    table.append(stepping, rows[offset:])
    group.mirror_pages(growing, starts)
