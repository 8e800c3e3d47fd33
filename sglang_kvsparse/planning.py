"""Forward plans: what one step's sparse layers read and write, built from the `SparseState`.

The attention backend (`patches/attention.py`) builds a plan once per forward in
`init_forward_metadata`, after SGLang allocated the step's rows (`SparseState.alloc_to_lengths`),
and every sparse layer then takes its column's `ColumnPlan` (`ForwardPlan.column`). Index
tensors are built with batched tensor operations on the host tables, then moved to the device.
No SGLang imports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_kvsparse.layout import SparseSlot
from sglang_kvsparse.row_table import HeapError
from sglang_kvsparse.sparse_state import SparseGroup, SparseState


@dataclass(frozen=True)
class ColumnPlan:
    """Kernel inputs of one sparse column (its layers read the same rows, each in its own lane).

    `kv_indptr`/`kv_indices`: each request's rows in position order, `score_indices` their score
    slots (the lane's score view). `new_slots`/`new_score_slots`: where the forward's kept tokens
    go (decode: one per request; prefill: the requests' rows, request-major).
    `budget` and `compress` (some prefill request is longer than the budget) tell the prefill
    whether to select. `evict_slots` (decode): [N, max_entries] old rows, in position order, of the
    N requests that evict this step, `evict_score_slots` their score slots; the forward keeps
    `budget` of them in the first `budget` rows.
    Prefill with the prefix store: `prefix_slots` (the matched prefixes' store rows, request-major,
    aligned with `ForwardPlan.prefix_positions`) and `store_slots` (where the batch's first
    `len(store_slots)` new tokens are stored for later hits).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    score_indices: torch.Tensor
    new_slots: torch.Tensor
    new_score_slots: torch.Tensor
    budget: int = 0
    compress: bool = False
    evict_slots: torch.Tensor | None = None
    evict_score_slots: torch.Tensor | None = None
    prefix_slots: torch.Tensor | None = None
    store_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardPlan:
    """Everything the sparse layers of one forward need beyond their lane buffers.

    A prefill attends over each request's whole sequence, prefix then new tokens, laid out
    request-major with boundaries `kv_indptr` (`qo_indptr` when no request has a prefix).
    `prefix_positions`/`new_positions` say where the prefixes' store entries and the batch's new
    tokens go in that layout (None when no request has a prefix).
    """

    qo_indptr: torch.Tensor
    columns: tuple[tuple[ColumnPlan, ...], ...]  # [group][column]
    sink: int = 0
    window: int = 0
    kv_indptr: torch.Tensor | None = None
    prefix_positions: torch.Tensor | None = None
    new_positions: torch.Tensor | None = None

    def column(self, slot: SparseSlot) -> ColumnPlan:
        return self.columns[slot.group][slot.column]


def plan_extend(
    state: SparseState,
    rows: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    prefix_ids: Sequence[torch.Tensor] = (),
    new_ids: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> ForwardPlan:
    """Plan a prefill: every row is new and keeps min(length, budget) entries of its whole
    sequence (cached prefix + new tokens).

    With the prefix store, `prefix_ids` (per row, SGLang's full-pool ids of its matched prefix)
    and `new_ids` (the batch's new tokens' ids, request-major) are required: the prefixes' store
    rows are looked up (pinned at admission, so they are there) and the new tokens get store rows
    where the heap has room.
    """
    prefix_lens = [int(n) for n in prefix_lens]
    extend_lens = [int(n) for n in extend_lens]
    if any(prefix_lens) and state.store is None:
        raise HeapError("an extend with a cached prefix reached the sparse layers without a prefix store")
    state.counters.forward_plans += 1
    state.counters.prefix_hits += sum(1 for n in prefix_lens if n)
    state.counters.prefix_tokens_reused += sum(prefix_lens)
    index = torch.tensor(list(rows), dtype=torch.int64)
    seq_lens = torch.tensor(prefix_lens, dtype=torch.int64) + torch.tensor(extend_lens, dtype=torch.int64)
    prefix_rows = store_rows = None
    if state.store is not None:
        if new_ids is None or len(prefix_ids) != len(index):
            raise HeapError("a prefill with the prefix store needs every row's prefix ids and the new ids")
        prefix_rows, store_rows = _use_store(state, prefix_ids, new_ids)
    columns = []
    for group in state.groups:
        kept = seq_lens.clamp(max=group.spec.budget)
        if not torch.equal(group.table.lengths[index], kept):
            raise HeapError(
                f"sparse rows hold {group.table.lengths[index].tolist()} entries for a prefill keeping {kept.tolist()}"
            )
        indptr, indices, scores = _indices(state, group, index, device)
        compress = bool((seq_lens > group.spec.budget).any())
        plans = []
        for c in range(group.columns):
            column = group.first_column + c
            plans.append(
                ColumnPlan(
                    indptr,
                    indices[c],
                    scores[c],
                    indices[c],
                    scores[c],
                    group.spec.budget,
                    compress,
                    prefix_slots=None if prefix_rows is None else prefix_rows[column].to(device),
                    store_slots=None if store_rows is None else store_rows[column].to(device),
                )
            )
        columns.append(tuple(plans))
    plan = ForwardPlan(
        _indptr(torch.tensor(extend_lens), device), tuple(columns), state.config.sink, state.config.window
    )
    if not any(prefix_lens):
        return plan
    starts = _indptr(seq_lens, "cpu")[:-1].tolist()
    prefix_positions = torch.cat([torch.arange(p) + s for p, s in zip(prefix_lens, starts)])
    new_positions = torch.cat([torch.arange(e) + s + p for p, e, s in zip(prefix_lens, extend_lens, starts)])
    return dataclasses.replace(
        plan,
        kv_indptr=_indptr(seq_lens, device),
        prefix_positions=prefix_positions.to(device),
        new_positions=new_positions.to(device),
    )


def plan_decode(state: SparseState, rows: Sequence[int], device: torch.device | str = "cpu") -> ForwardPlan:
    """Plan a decode step: each row's newest entry (appended by the allocation) takes the new
    token, and the rows the allocation cut back to the budget get their eviction (`evict_slots`)."""
    state.counters.forward_plans += 1
    index = torch.tensor(list(rows), dtype=torch.int64)
    listed = set(index.tolist())
    columns = []
    for group in state.groups:
        indptr, indices, scores = _indices(state, group, index, device)
        newest = group.table.last_entries(index).T.to(device)  # [columns, B]
        newest_scores = state.score_slots(group, index, group.table.lengths[index] - 1).T.to(device)
        rows = [row for row in index.tolist() if row in group.evictions]
        evicting = [group.evictions.pop(row) for row in rows]
        if group.evictions:
            stray = sorted(group.evictions)
            raise HeapError(f"rows {stray} evicted but are not in this decode batch ({sorted(listed)})")
        old = old_scores = None
        if evicting:
            old = torch.stack(evicting).permute(2, 0, 1).to(device)  # [columns, N, n_old]
            n_old = old.shape[2]
            positions = torch.arange(n_old).repeat(len(rows))
            slots = state.score_slots(group, torch.tensor(rows).repeat_interleave(n_old), positions)
            old_scores = slots.T.reshape(group.columns, len(rows), n_old).to(device)
        state.counters.evictions += len(evicting)
        columns.append(
            tuple(
                ColumnPlan(
                    indptr,
                    indices[c],
                    scores[c],
                    newest[c],
                    newest_scores[c],
                    group.spec.budget,
                    evict_slots=None if old is None else old[c],
                    evict_score_slots=None if old_scores is None else old_scores[c],
                )
                for c in range(group.columns)
            )
        )
    ones = torch.ones(len(index), dtype=torch.int64)
    return ForwardPlan(_indptr(ones, device), tuple(columns), state.config.sink, state.config.window)


def _use_store(
    state: SparseState, prefix_ids: Sequence[torch.Tensor], new_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the prefixes' store rows, the new tokens' store rows), each [num_columns, n], on the host."""
    store = state.store
    parts = [ids.to("cpu", torch.int64) for ids in prefix_ids]
    prefix = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    prefix_rows = store.lookup(prefix)
    store.touch(prefix)
    new = new_ids.to("cpu", torch.int64)
    wanted = -(-new.numel() // store.page_size) * store.rows_per_block
    stored = store.put(new, state.take_for_store(wanted))
    return prefix_rows.T, stored.T


def _indices(
    state: SparseState, group: SparseGroup, index: torch.Tensor, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(indptr [B+1], rows [columns, total], score slots [columns, total]) of the requests'
    entries, request-major."""
    lengths = group.table.lengths[index]
    width = int(lengths.max()) if lengths.numel() else 0
    mask = torch.arange(width)[None, :] < lengths[:, None]
    entries = group.table.table[index, :width][mask]  # [total, columns]
    positions = torch.arange(width).expand(len(index), width)[mask]
    scores = state.score_slots(group, index.repeat_interleave(lengths), positions)
    return _indptr(lengths, device), entries.T.contiguous().to(device), scores.T.contiguous().to(device)


def _indptr(lengths: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = lengths.cumsum(0)
    return out.to(device, torch.int32)
