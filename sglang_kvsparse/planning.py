"""Forward plans: what one step's sparse layers read and write, built from the `SparseState`.

The attention backend (`patches/attention.py`) builds a plan once per forward in
`init_forward_metadata`, after SGLang allocated the step's rows (`SparseState.alloc_to_lengths`),
and every sparse layer then takes its column's `ColumnPlan` (`ForwardPlan.column`). Index
tensors are built with batched tensor operations on the host tables, then moved to the device.
No SGLang imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sglang_kvsparse.device_copy import upload
from sglang_kvsparse.plans import ColumnPlan, DecodeTables, Eviction, ForwardPlan, PolicyGroup
from sglang_kvsparse.policies import ScoringPolicy
from sglang_kvsparse.request_table import Phase
from sglang_kvsparse.row_table import HeapError
from sglang_kvsparse.sparse_group import SparseGroup
from sglang_kvsparse.sparse_state import SparseState


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
    prefix + new tokens), but for a chunk before its prompt's last (phase `CHUNKED`),
    which keeps none and stores its tokens.

    With the prefix store, `prefix_ids` (per row, SGLang's full-pool ids of its matched prefix)
    and `new_ids` (the batch's new tokens' ids, request-major) are required: the prefixes' store
    rows are looked up (pinned at admission or held since the previous chunk, so they are there),
    a chunk's tokens are stored (admission charged their rows) and the other new tokens get store
    rows where the heap has room. The plan's index tensors travel in one non-blocking copy.
    """
    prefix_lens = [int(n) for n in prefix_lens]
    extend_lens = [int(n) for n in extend_lens]
    if any(prefix_lens) and state.store is None:
        raise HeapError("an extend with a cached prefix reached the sparse layers without a prefix store")
    index = torch.tensor(list(rows), dtype=torch.int64)
    partial = state.requests.is_(Phase.CHUNKED, index)
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
    staging = _Staging()
    writes = [staging.writes(group) for group in state.groups]
    staged_columns = []
    waiting = torch.zeros(len(index), dtype=torch.bool)  # requests some group keeps by the guide
    for group in state.groups:
        budgets = state.budgets(group, index)
        kept = torch.where(partial, 0, torch.minimum(seq_lens, budgets))
        if not torch.equal(group.table.lengths[index], kept):
            raise HeapError(
                f"sparse rows hold {group.table.lengths[index].tolist()} entries for a prefill keeping {kept.tolist()}"
            )
        indices, scores = _indices(state, group, index)
        compress = bool((seq_lens > budgets)[~partial].any())
        guided = state.guided(budgets, seq_lens)
        room = budgets.double() / seq_lens.clamp(min=1).double()
        if guided is not None:
            guided &= ~partial
            waiting |= guided
        staged_columns.append(
            [
                (
                    staging.add(indices[c]),
                    staging.add(scores[c]),
                    budgets,
                    room,
                    compress,
                    staging.add(None if prefix_rows is None else prefix_rows[group.first_column + c]),
                    staging.add(None if store_rows is None else store_rows[group.first_column + c]),
                    guided,
                    group.first_column + c,
                )
                for c in range(group.columns)
            ]
        )
    work_rows, work_positions = _guide_rows(state, waiting, extend)
    at_qo = staging.add(_indptr(extend))
    at_store = staging.add(store_positions)
    policies = staging.policies(state, index)
    kept_positions = keeps = kv_indptr = prefix_positions = new_positions = None
    if bool(partial.any()):
        kept_positions = staging.add(_ranges(_indptr(seq_lens)[:-1][~partial], seq_lens[~partial]))
        keeps = staging.add(~partial)
    if any(prefix_lens):
        starts = _indptr(seq_lens)[:-1]
        kv_indptr = staging.add(_indptr(seq_lens))
        prefix_positions = staging.add(_ranges(starts, prefix))
        new_positions = staging.add(_ranges(starts + prefix, extend))
    work_slots = [staging.add(rows) for rows in work_rows]
    at_work = staging.add(work_positions)
    get = staging.send(device)
    for group, write in zip(state.groups, writes):
        _apply_writes(group, write, get)
    columns = tuple(
        tuple(
            ColumnPlan(
                get(i),
                get(sc),
                budgets,
                room,
                compress,
                prefix_slots=get(p),
                store_slots=get(st),
                guided=guided,
                work_slots=get(work_slots[place]) if work_slots else None,
            )
            for i, sc, budgets, room, compress, p, st, guided, place in group_columns
        )
        for group_columns in staged_columns
    )
    state.requests.phase[index[~partial]] = Phase.DECODING
    state.counters.scoring_passes_peak = max(state.counters.scoring_passes_peak, len(policies) or 1)
    # The store took its rows: top the host free list up again to what the running requests'
    # decode steps will take (as the prefill's allocation did), so none waits on the device.
    state.heap.reserve(state.decode_reserve())
    return ForwardPlan(
        get(at_qo),
        columns,
        state.config.sink,
        state.config.window,
        kv_indptr=get(kv_indptr),
        prefix_positions=get(prefix_positions),
        new_positions=get(new_positions),
        keeps=get(keeps),
        kept_positions=get(kept_positions),
        store_positions=get(at_store),
        work_positions=get(at_work),
        policy_groups=tuple(PolicyGroup(policy, get(r), get(m)) for policy, r, m in policies),
    )


def _guide_rows(
    state: SparseState, waiting: torch.Tensor, extend: torch.Tensor
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """(per sparse column, the heap rows [n] the new tokens of the `waiting` requests (host [B])
    wait in until the guide has chosen; their positions [n] among the batch's new tokens). The
    rows go back once the forward has been issued; admission charged them (`prefill_charge`)."""
    if not bool(waiting.any()):
        return [], None
    positions = _ranges(_indptr(extend)[:-1][waiting], extend[waiting])
    rows = state.guide_rows(positions.numel())
    state.counters.guide_rows_peak = max(state.counters.guide_rows_peak, rows)
    taken = state.take_for_forward(rows).view(state.layout.num_columns, -1)
    return list(taken[:, : positions.numel()]), positions


class _Staging:
    """Host tensors bound for the device in one non-blocking copy (`device_copy.upload`): `add`
    gives each a place (None stays None), `send` returns the lookup of places to device tensors."""

    def __init__(self) -> None:
        self.host: list[torch.Tensor] = []

    def add(self, tensor: torch.Tensor | None) -> int | None:
        if tensor is None:
            return None
        self.host.append(tensor)
        return len(self.host) - 1

    def writes(self, group: SparseGroup) -> tuple[int, int, int, int] | None:
        """The group's pending device-table changes (`SparseGroup.stale_entries`), staged; None
        when nothing changed."""
        entries, values, score_entries, score_values = group.stale_entries()
        if not entries.numel() and not score_entries.numel():
            return None
        return self.add(entries), self.add(values), self.add(score_entries), self.add(score_values)

    def policies(self, state: SparseState, index: torch.Tensor) -> list[tuple[ScoringPolicy, int, int]]:
        """Every policy of the batch with its requests' places and mask (`_policy_members`), staged."""
        return [(policy, self.add(places), self.add(mask)) for policy, places, mask in _policy_members(state, index)]

    def send(self, device: torch.device | str) -> Callable[[int | None], torch.Tensor | None]:
        on_device = upload(self.host, device)
        return lambda place: None if place is None else on_device[place]


def plan_decode(state: SparseState, rows: Sequence[int], device: torch.device | str = "cpu") -> ForwardPlan:
    """Plan a decode step from the host tables alone: each row's newest entry (appended by the
    allocation) takes the new token, and the rows the allocation cut back to their budget get
    their eviction (`evictions`, one per group and (budget, policy) among them). What the device
    needs (its tables' pending changes, the rows, lengths and evictions) travels in one
    non-blocking copy (`device_copy.upload`), and nothing is read back: the host never waits."""
    state.counters.forward_plans += 1
    index = torch.tensor(list(rows), dtype=torch.int64)
    staging = _Staging()
    writes = [staging.writes(group) for group in state.groups]
    per_row = state.scores_per_row
    at_rows, at_batch = staging.add(index), staging.add(torch.arange(len(index)))
    tables = []
    kinds = []
    listed = set(index.tolist())
    for g, group in enumerate(state.groups):
        lengths = group.table.lengths[index]
        width = int(lengths.max()) if lengths.numel() else 0
        positions = torch.arange(width)
        last = (lengths - 1).clamp(min=0)
        places = [staging.add(t) for t in (lengths, last, positions // per_row, positions % per_row)]
        tables.append((width, places))
        evicting = [row for row in index.tolist() if row in group.evictions]
        olds = {row: group.evictions.pop(row) for row in evicting}
        if group.evictions:
            stray = sorted(group.evictions)
            raise HeapError(f"rows {stray} evicted but are not in this decode batch ({sorted(listed)})")
        members: dict[tuple[int, ScoringPolicy | None], list[int]] = {}
        budgets = state.budgets(group, torch.tensor(evicting, dtype=torch.int64)).tolist()
        for row, budget in zip(evicting, budgets):
            members.setdefault((budget, state.requests.policy[row]), []).append(row)
        for (budget, policy), members_rows in members.items():
            slots, score_slots = _old_entries(state, group, members_rows, olds)
            kinds.append((g, budget, policy, staging.add(slots), staging.add(score_slots)))
        state.counters.evictions += len(evicting)
    state.counters.evictions_per_step_peak = max(state.counters.evictions_per_step_peak, len(kinds))
    policies = staging.policies(state, index)
    at_indptr = staging.add(_indptr(torch.ones(len(index), dtype=torch.int64)))
    get = staging.send(device)
    for group, write in zip(state.groups, writes):
        _apply_writes(group, write, get)
    decode_tables = tuple(
        _decode_tables(group, get(at_rows), get(at_batch), width, [get(p) for p in places], per_row)
        for group, (width, places) in zip(state.groups, tables)
    )
    columns = tuple(tuple(t.column(c) for c in range(group.columns)) for group, t in zip(state.groups, decode_tables))
    return ForwardPlan(
        get(at_indptr),
        columns,
        state.config.sink,
        state.config.window,
        decode_tables=decode_tables,
        evictions=tuple(Eviction(g, b, get(sl), get(sc), policy) for g, b, policy, sl, sc in kinds),
        policy_groups=tuple(PolicyGroup(policy, get(r), get(m)) for policy, r, m in policies),
    )


def _policy_members(state: SparseState, index: torch.Tensor) -> list[tuple[ScoringPolicy, torch.Tensor, torch.Tensor]]:
    """Every policy of the batch of request rows `index` with its requests' places in the batch
    and the same as a mask (host), when some request has a policy of its own (none otherwise)."""
    policies = [state.requests.policy[row] for row in index.tolist()]
    if all(policy is None for policy in policies):
        return []
    members: dict[ScoringPolicy, list[int]] = {}
    for place, policy in enumerate(policies):
        members.setdefault(policy or state.policy, []).append(place)
    out = []
    for policy, places in members.items():
        rows = torch.tensor(places, dtype=torch.int64)
        mask = torch.zeros(len(policies), dtype=torch.bool)
        mask[rows] = True
        out.append((policy, rows, mask))
    return out


def _old_entries(
    state: SparseState, group: SparseGroup, rows: list[int], olds: dict[int, torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(old rows, their score slots), both host [columns, N, n_old], of these evicting request
    rows (their old entries in `olds`, all as long: the budget's max_entries)."""
    old = torch.stack([olds[row] for row in rows]).permute(2, 0, 1).contiguous()
    n_old = old.shape[2]
    positions = torch.arange(n_old).repeat(len(rows))
    slots = state.score_slots(group, torch.tensor(rows).repeat_interleave(n_old), positions)
    return old, slots.T.reshape(group.columns, len(rows), n_old).contiguous()


def _apply_writes(
    group: SparseGroup, write: tuple[int, int, int, int] | None, get: Callable[[int | None], torch.Tensor | None]
) -> None:
    """Bring the group's device tables up to date from the uploaded changes."""
    if write is None:
        return
    entries, values, score_entries, score_values = (get(place) for place in write)
    if entries.numel():
        group.device_table.view(-1)[entries] = values.to(torch.int32)
    if score_entries.numel():
        group.device_scores.view(-1)[score_entries] = score_values.to(torch.int32)


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
    partial = state.requests.is_(Phase.CHUNKED, index)
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


def _indices(state: SparseState, group: SparseGroup, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [columns, total], score slots [columns, total]) of the requests' entries,
    request-major (host)."""
    lengths = group.table.lengths[index]
    width = int(lengths.max()) if lengths.numel() else 0
    mask = torch.arange(width)[None, :] < lengths[:, None]
    entries = group.table.table[index, :width][mask]  # [total, columns]
    positions = torch.arange(width).expand(len(index), width)[mask]
    scores = state.score_slots(group, index.repeat_interleave(lengths), positions)
    return entries.T.contiguous(), scores.T.contiguous()


def _decode_tables(
    group: SparseGroup,
    rows: torch.Tensor,
    batch: torch.Tensor,
    width: int,
    uploaded: list[torch.Tensor],
    per_row: int,
) -> DecodeTables:
    """The group's decode tables for the batch's request `rows` (device), gathered from its
    device tables (`SparseGroup.device_table`); W, the longest row, is known on the host, and so
    are the lengths, the newest entries' places and the score-slot arithmetic (`uploaded`).
    Past a row's length: whatever the mirror holds there, slots that were valid (the padding row
    when never written)."""
    lengths, last, page_of, in_page = uploaded
    entries = group.device_table[rows, :width]  # [B, W, columns]
    pages = group.device_scores[rows][:, :, page_of]  # [B, columns, W]
    scores = (pages * per_row + in_page).transpose(1, 2)  # [B, W, columns]
    return DecodeTables(lengths, entries, scores, entries[batch, last].T, scores[batch, last].T)


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    """[B+1] int64 boundaries of these lengths (host)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = lengths.cumsum(0)
    return out
