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
from sglang_kvsparse.policies import ScoringPolicy
from sglang_kvsparse.row_table import HeapError
from sglang_kvsparse.sparse_state import SparseGroup, SparseState


@dataclass(frozen=True)
class Eviction:
    """The decode evictions of one column's requests that keep the same `budget` by the same
    `policy` (None: the server's): `slots` [N, max_entries] their old rows, in position order,
    `score_slots` their score slots; the forward keeps `budget` of each request's in its first
    `budget` rows."""

    budget: int
    slots: torch.Tensor
    score_slots: torch.Tensor
    policy: ScoringPolicy | None = None


@dataclass(frozen=True)
class PolicyGroup:
    """The requests of a batch that one policy serves: `rows` [n] their places in the batch and
    `mask` [B] the same as a mask, both on the device (None: every request)."""

    policy: ScoringPolicy
    rows: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class ColumnPlan:
    """Kernel inputs of one sparse column (its layers read the same rows, each in its own lane).

    `new_slots`/`new_score_slots`: where the forward's kept tokens go (decode: one per request;
    prefill: the requests' rows, request-major). `budgets` ([B] on the host: each request's own)
    and `compress` (some prefill request is longer than its budget) tell the prefill whether and
    how much to select.
    Decode: `kv_lens` [B] and `kv_indices` [B, W] (each request's rows in position order, padded
    with valid rows past its length), `score_indices` [B, W] their score slots (the lane's score
    view): the decode kernel's table layout. `evictions`: this step's, one per budget.
    `guided` ([B] on the host; None without guide layers): the requests a selecting prefill keeps
    by the cross-layer guide, those whose budget is below `guide_below` of their prompt.
    Prefill with the prefix store: `prefix_slots` (the matched prefixes' store rows, request-major,
    aligned with `ForwardPlan.prefix_positions`) and `store_slots` (where the new tokens at
    `ForwardPlan.store_positions` are stored, for later hits or the prompt's next chunk).
    """

    new_slots: torch.Tensor
    new_score_slots: torch.Tensor
    budgets: torch.Tensor | None = None
    compress: bool = False
    kv_lens: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    score_indices: torch.Tensor | None = None
    evictions: tuple[Eviction, ...] = ()
    prefix_slots: torch.Tensor | None = None
    store_slots: torch.Tensor | None = None
    guided: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeTables:
    """One group's decode inputs for B requests, shared by its columns (column c is `[..., c]`
    of the tables, `[c]` of the newest entries).

    `lengths` [B] int32; `entries` and `score_slots` [B, W, columns]: each request's rows and
    score slots in position order, padded past its length with valid ones (the padding row and
    its scratch score slots); `newest` and `newest_scores` [columns, B]: where the step's token
    goes."""

    lengths: torch.Tensor
    entries: torch.Tensor
    score_slots: torch.Tensor
    newest: torch.Tensor
    newest_scores: torch.Tensor

    def column(self, c: int, evictions: tuple[Eviction, ...] = ()) -> ColumnPlan:
        return ColumnPlan(
            self.newest[c],
            self.newest_scores[c],
            kv_lens=self.lengths,
            kv_indices=self.entries[..., c],
            score_indices=self.score_slots[..., c],
            evictions=evictions,
        )


@dataclass(frozen=True)
class ForwardPlan:
    """Everything the sparse layers of one forward need beyond their lane buffers.

    A prefill attends over each request's whole sequence, prefix then new tokens, laid out
    request-major with boundaries `kv_indptr` (`qo_indptr` when no request has a prefix).
    `prefix_positions`/`new_positions` say where the prefixes' store entries and the batch's new
    tokens go in that layout (None when no request has a prefix). `keeps` [B] (None: all) marks
    the requests that keep entries: a chunk before a prompt's last keeps none (its tokens are
    only stored), and `kept_positions` are then the sequence positions of the requests that do.
    `store_positions`: which of the batch's new tokens the columns' `store_slots` store.
    `policy_groups`: when some request has a policy of its own, every policy of the batch with its
    requests (empty: the server's policy serves them all). `sentence_ends` [total_kv] bool: the
    sequence's keys whose token ends a sentence (a prefill on a server that knows its tokens;
    `sglang_kvsparse.sentences`), else None.
    """

    qo_indptr: torch.Tensor
    columns: tuple[tuple[ColumnPlan, ...], ...]  # [group][column]
    sink: int = 0
    window: int = 0
    kv_indptr: torch.Tensor | None = None
    prefix_positions: torch.Tensor | None = None
    new_positions: torch.Tensor | None = None
    keeps: torch.Tensor | None = None
    kept_positions: torch.Tensor | None = None
    store_positions: torch.Tensor | None = None
    decode_tables: tuple[DecodeTables, ...] = ()  # [group], decode plans only
    policy_groups: tuple[PolicyGroup, ...] = ()
    sentence_ends: torch.Tensor | None = None

    def column(self, slot: SparseSlot) -> ColumnPlan:
        return self.columns[slot.group][slot.column]


@dataclass(frozen=True)
class MixedPlan:
    """A prefill and running requests' decode step in one forward (SGLang's mixed chunk): the
    batch's first `extend_tokens` tokens are the prefill's, one token per decoding row follows."""

    extend: ForwardPlan
    decode: ForwardPlan
    extend_tokens: int


def plan_extend(
    state: SparseState,
    rows: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    prefix_ids: Sequence[torch.Tensor] = (),
    new_ids: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> ForwardPlan:
    """Plan a prefill: every row keeps min(length, its budget) entries of its whole sequence (cached
    prefix + new tokens), but for a chunk before its prompt's last (`SparseState.partial`),
    which keeps none and stores its tokens.

    With the prefix store, `prefix_ids` (per row, SGLang's full-pool ids of its matched prefix)
    and `new_ids` (the batch's new tokens' ids, request-major) are required: the prefixes' store
    rows are looked up (pinned at admission or held since the previous chunk, so they are there),
    a chunk's tokens are stored (admission charged their rows) and the other new tokens get store
    rows where the heap has room.
    """
    prefix_lens = [int(n) for n in prefix_lens]
    extend_lens = [int(n) for n in extend_lens]
    if any(prefix_lens) and state.store is None:
        raise HeapError("an extend with a cached prefix reached the sparse layers without a prefix store")
    index = torch.tensor(list(rows), dtype=torch.int64)
    partial = state.partial[index]
    hits = [n for n, row in zip(prefix_lens, rows) if n and not state.continues_chunks(int(row))]
    state.counters.forward_plans += 1
    state.counters.chunks_stored += int(partial.sum())
    state.counters.prefix_hits += len(hits)
    state.counters.prefix_tokens_reused += sum(hits)
    prefix = torch.tensor(prefix_lens, dtype=torch.int64)
    extend = torch.tensor(extend_lens, dtype=torch.int64)
    seq_lens = prefix + extend
    prefix_rows = store_rows = store_positions = None
    if state.store is not None:
        if new_ids is None or len(prefix_ids) != len(index):
            raise HeapError("a prefill with the prefix store needs every row's prefix ids and the new ids")
        prefix_rows, store_rows, store_positions = _use_store(state, index, prefix_ids, new_ids, extend)
    elif bool(partial.any()):
        raise HeapError("a chunked prefill reached the sparse layers without a prefix store")
    columns = []
    for group in state.groups:
        budgets = state.budgets(group, index)
        kept = torch.where(partial, 0, torch.minimum(seq_lens, budgets))
        if not torch.equal(group.table.lengths[index], kept):
            raise HeapError(
                f"sparse rows hold {group.table.lengths[index].tolist()} entries for a prefill keeping {kept.tolist()}"
            )
        indices, scores = _indices(state, group, index, device)
        compress = bool((seq_lens > budgets)[~partial].any())
        guided = _guided(state, budgets, seq_lens)
        plans = []
        for c in range(group.columns):
            column = group.first_column + c
            plans.append(
                ColumnPlan(
                    indices[c],
                    scores[c],
                    budgets,
                    compress,
                    prefix_slots=None if prefix_rows is None else prefix_rows[column].to(device),
                    store_slots=None if store_rows is None else store_rows[column].to(device),
                    guided=guided,
                )
            )
        columns.append(tuple(plans))
    plan = ForwardPlan(
        _indptr(extend, device),
        tuple(columns),
        state.config.sink,
        state.config.window,
        store_positions=None if store_positions is None else store_positions.to(device),
        policy_groups=_policy_groups(state, index, device),
    )
    state.prefilled[index[~partial]] = True
    if bool(partial.any()):
        kept_positions = _ranges(_indptr(seq_lens, "cpu")[:-1][~partial], seq_lens[~partial])
        plan = dataclasses.replace(plan, keeps=(~partial).to(device), kept_positions=kept_positions.to(device))
    if not any(prefix_lens):
        return plan
    starts = _indptr(seq_lens, "cpu")[:-1]
    return dataclasses.replace(
        plan,
        kv_indptr=_indptr(seq_lens, device),
        prefix_positions=_ranges(starts, prefix).to(device),
        new_positions=_ranges(starts + prefix, extend).to(device),
    )


def _guided(state: SparseState, budgets: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor | None:
    """The requests (host [B]) a selecting prefill keeps by the guide: with guide layers, those
    whose budget is below `guide_below` of their whole sequence (all without it)."""
    if not state.resolved.guide_layers:
        return None
    share = state.config.guide_below
    if share is None:
        return torch.ones(budgets.shape, dtype=torch.bool)
    return budgets < share * seq_lens


def plan_decode(state: SparseState, rows: Sequence[int], device: torch.device | str = "cpu") -> ForwardPlan:
    """Plan a decode step: each row's newest entry (appended by the allocation) takes the new
    token, and the rows the allocation cut back to their budget get their eviction (`evictions`,
    one per budget among them)."""
    state.counters.forward_plans += 1
    index = torch.tensor(list(rows), dtype=torch.int64)
    listed = set(index.tolist())
    columns = []
    tables = []
    for group in state.groups:
        group_tables = _decode_tables(state, group, index, device)
        tables.append(group_tables)
        rows = [row for row in index.tolist() if row in group.evictions]
        olds = {row: group.evictions.pop(row) for row in rows}
        if group.evictions:
            stray = sorted(group.evictions)
            raise HeapError(f"rows {stray} evicted but are not in this decode batch ({sorted(listed)})")
        kinds: dict[tuple[int, ScoringPolicy | None], list[int]] = {}
        for row, budget in zip(rows, state.budgets(group, torch.tensor(rows, dtype=torch.int64)).tolist()):
            kinds.setdefault((budget, state.request_policy[row]), []).append(row)
        evictions = [_evictions(state, group, kind, members, olds, device) for kind, members in kinds.items()]
        state.counters.evictions += len(rows)
        columns.append(
            tuple(
                group_tables.column(c, tuple(per_column[c] for per_column in evictions)) for c in range(group.columns)
            )
        )
    ones = torch.ones(len(index), dtype=torch.int64)
    return ForwardPlan(
        _indptr(ones, device),
        tuple(columns),
        state.config.sink,
        state.config.window,
        decode_tables=tuple(tables),
        policy_groups=_policy_groups(state, index, device),
    )


def _policy_groups(state: SparseState, index: torch.Tensor, device: torch.device | str) -> tuple[PolicyGroup, ...]:
    """Every policy of the batch of request rows `index` with its requests, when some request has
    its own (none otherwise)."""
    policies = [state.request_policy[row] for row in index.tolist()]
    if all(policy is None for policy in policies):
        return ()
    members: dict[ScoringPolicy, list[int]] = {}
    for place, policy in enumerate(policies):
        members.setdefault(policy or state.policy, []).append(place)
    groups = []
    for policy, places in members.items():
        rows = torch.tensor(places, dtype=torch.int64)
        mask = torch.zeros(len(policies), dtype=torch.bool)
        mask[rows] = True
        groups.append(PolicyGroup(policy, rows.to(device), mask.to(device)))
    return tuple(groups)


def _evictions(
    state: SparseState,
    group: SparseGroup,
    kind: tuple[int, ScoringPolicy | None],
    rows: list[int],
    olds: dict[int, torch.Tensor],
    device: torch.device | str,
) -> list[Eviction]:
    """The `Eviction` of each column for these request rows of one (budget, policy) (their old
    entries in `olds`, all as long: the budget's max_entries)."""
    budget, policy = kind
    old = torch.stack([olds[row] for row in rows]).permute(2, 0, 1).to(device)  # [columns, N, n_old]
    n_old = old.shape[2]
    positions = torch.arange(n_old).repeat(len(rows))
    slots = state.score_slots(group, torch.tensor(rows).repeat_interleave(n_old), positions)
    old_scores = slots.T.reshape(group.columns, len(rows), n_old).to(device)
    return [Eviction(budget, old[c], old_scores[c], policy) for c in range(group.columns)]


def _use_store(
    state: SparseState,
    index: torch.Tensor,
    prefix_ids: Sequence[torch.Tensor],
    new_ids: torch.Tensor,
    extend: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the prefixes' store rows [num_columns, n_prefix], the stored new tokens' store rows
    [num_columns, n_stored], those tokens' positions among the batch's new tokens [n_stored]).

    A last chunk's held blocks are pinned for this forward; the tokens of chunks before a
    prompt's last are stored (admission charged their rows) and their request holds its prompt so
    far for its next chunk; only then, best effort, the other new tokens get store rows, which may
    reclaim unpinned, unheld store blocks."""
    store = state.store
    parts = [ids.to("cpu", torch.int64) for ids in prefix_ids]
    prefix = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    prefix_rows = store.lookup(prefix)
    store.touch(prefix)
    partial = state.partial[index]
    for row in index[~partial].tolist():
        state.read_held(row)  # pinned before any row is taken below, which may reclaim the store
    new = new_ids.to("cpu", torch.int64)
    chunk_tokens = partial.repeat_interleave(extend)
    must, rest = torch.nonzero(chunk_tokens).flatten(), torch.nonzero(~chunk_tokens).flatten()
    blocks = -(-must.numel() // store.page_size)
    chunk_rows = store.put(new[must], state.take(blocks * store.rows_per_block)) if must.numel() else None
    if chunk_rows is not None and chunk_rows.shape[0] != must.numel():
        raise HeapError(f"the prefix store took {chunk_rows.shape[0]} of a chunk's {must.numel()} tokens")
    news = new.split(extend.tolist())
    for b in torch.nonzero(partial).flatten().tolist():  # held before the best-effort take below
        state.hold_for_next_chunk(int(index[b]), torch.cat([parts[b], news[b]]))
    wanted = -(-rest.numel() // store.page_size) * store.rows_per_block
    stored = store.put(new[rest], state.take_for_store(wanted)) if rest.numel() else None
    row_parts = [r for r in (chunk_rows, stored) if r is not None]
    rows = torch.cat(row_parts) if row_parts else torch.empty(0, store.columns, dtype=torch.int64)
    positions = torch.cat([must, rest[: 0 if stored is None else stored.shape[0]]])
    return prefix_rows.T, rows.T, positions


def _ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """start..start+length-1 for each pair, concatenated."""
    if lengths.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    offsets = torch.arange(int(lengths.sum())) - (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths)
    return starts.repeat_interleave(lengths) + offsets


def _indices(
    state: SparseState, group: SparseGroup, index: torch.Tensor, device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [columns, total], score slots [columns, total]) of the requests' entries,
    request-major."""
    lengths = group.table.lengths[index]
    width = int(lengths.max()) if lengths.numel() else 0
    mask = torch.arange(width)[None, :] < lengths[:, None]
    entries = group.table.table[index, :width][mask]  # [total, columns]
    positions = torch.arange(width).expand(len(index), width)[mask]
    scores = state.score_slots(group, index.repeat_interleave(lengths), positions)
    return entries.T.contiguous().to(device), scores.T.contiguous().to(device)


def _decode_tables(
    state: SparseState, group: SparseGroup, index: torch.Tensor, device: torch.device | str
) -> DecodeTables:
    """The group's decode tables for these requests, gathered on the device from its mirrored
    tables (`SparseGroup.device_table`); only the rows and lengths travel, and W, the longest
    row, is known on the host. Past a row's length: whatever the mirror holds there, slots
    that were valid (the padding row when never written)."""
    lengths = group.table.lengths[index]
    width = int(lengths.max()) if lengths.numel() else 0
    rows = index.to(device)
    entries = group.device_table[rows, :width]  # [B, W, columns]
    per_row = state.scores_per_row
    positions = torch.arange(width, device=device)
    pages = group.device_scores[rows][:, :, positions // per_row]  # [B, columns, W]
    scores = (pages * per_row + positions % per_row).transpose(1, 2)  # [B, W, columns]
    lengths = lengths.to(device, torch.int32)
    last = (lengths.long() - 1).clamp(min=0)
    batch = torch.arange(len(index), device=device)
    return DecodeTables(lengths, entries, scores, entries[batch, last].T, scores[batch, last].T)


def _indptr(lengths: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = lengths.cumsum(0)
    return out.to(device, torch.int32)
