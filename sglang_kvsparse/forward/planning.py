"""Forward plans: what one step's sparse layers read and write, built from the `SparseState`.

The attention backend (`patches/attention.py`) plans once per forward in `init_forward_metadata`,
after SGLang allocated the step's tokens (`SparseState.alloc_to_lengths`): first the forward's
state changes (`SparseState.begin_extend` / `begin_decode`), then its plan (`build_extend` /
`build_decode`), which only reads the state's tables and brings their device mirrors up to date.
Every sparse layer then takes its column's `ColumnPlan` (`ForwardPlan.column`). Index tensors are
built with batched tensor operations on the host tables, then moved to the device in one copy.
No SGLang imports.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sglang_kvsparse.forward.plans import ColumnPlan, DecodeTables, Eviction, ForwardPlan, PolicyGroup
from sglang_kvsparse.kernels.common import Segments
from sglang_kvsparse.policies import ScoringPolicy
from sglang_kvsparse.state.device_copy import upload
from sglang_kvsparse.state.entry_table import HeapError
from sglang_kvsparse.state.sparse_group import SparseGroup
from sglang_kvsparse.state.sparse_state import SparseState
from sglang_kvsparse.state.steps import EvictingRequests, ExtendStep, indptr, ranges


def plan_extend(
    state: SparseState,
    req_indices: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    prefix_ids: Sequence[torch.Tensor] = (),
    new_ids: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
) -> ForwardPlan:
    """A prefill forward: its state changes (`SparseState.begin_extend`), then its plan (`build_extend`)."""
    return build_extend(state, state.begin_extend(req_indices, prefix_lens, extend_lens, prefix_ids, new_ids), device)


def plan_decode(state: SparseState, req_indices: Sequence[int], device: torch.device | str = "cpu") -> ForwardPlan:
    """A decode step: its state changes (`SparseState.begin_decode`), then its plan (`build_decode`)."""
    return build_decode(state, req_indices, state.begin_decode(req_indices), device)


def build_extend(state: SparseState, step: ExtendStep, device: torch.device | str = "cpu") -> ForwardPlan:
    """Plan a prefill: every request keeps min(length, its budget) entries of its whole sequence
    (cached prefix + new tokens), but for a chunk before its prompt's last (`step.partial`), which
    keeps none and stores its tokens; a request some group keeps by the guide reads its new
    tokens' K/V from the rows the step took (`step.work_rows`). The plan's index tensors travel in
    one non-blocking copy."""
    index, partial, extend, seq_lens = step.req_indices, step.partial, step.extend_lens, step.seq_lens
    staging = _Staging()
    writes = [staging.writes(group) for group in state.groups]
    staged_columns = []
    for group in state.groups:
        budgets = state.budgets(group, index)
        kept = torch.where(partial, 0, torch.minimum(seq_lens, budgets))
        if not torch.equal(group.table.counts[index], kept):
            raise HeapError(
                f"the tables hold {group.table.counts[index].tolist()} entries for a prefill keeping {kept.tolist()}"
            )
        indices, scores = _indices(state, group, index)
        compress = bool((seq_lens > budgets)[~partial].any())
        guided = group.guided(state.resolved, state.requests.budget[index], seq_lens)
        if guided is not None:
            guided &= ~partial
        at_budgets = staging.add(budgets)  # one copy for the group's columns
        staged_columns.append(
            [
                (
                    staging.add(indices[c]),
                    staging.add(scores[c]),
                    budgets,
                    compress,
                    staging.add(None if step.prefix_rows is None else step.prefix_rows[group.first_column + c]),
                    staging.add(None if step.store_rows is None else step.store_rows[group.first_column + c]),
                    guided,
                    group.first_column + c,
                    kept,
                    at_budgets,
                )
                for c in range(group.columns)
            ]
        )
    at_qo = staging.add(indptr(extend))
    at_store = staging.add(step.store_positions)
    policies = staging.policies(state, index)
    kept_positions = keeps = prefix_positions = new_positions = None
    at_kv = at_qo
    if bool(partial.any()):
        kept_positions = staging.add(ranges(indptr(seq_lens)[:-1][~partial], seq_lens[~partial]))
        keeps = staging.add(~partial)
    if bool(step.prefix_lens.any()):
        starts = indptr(seq_lens)[:-1]
        at_kv = staging.add(indptr(seq_lens))
        prefix_positions = staging.add(ranges(starts, step.prefix_lens))
        new_positions = staging.add(ranges(starts + step.prefix_lens, extend))
    work_slots = [staging.add(rows) for rows in step.work_rows]
    at_work = staging.add(step.work_positions)
    get = staging.send(device)
    for group, write in zip(state.groups, writes):
        _apply_writes(group, write, get)
    columns = tuple(
        tuple(
            ColumnPlan(
                get(i),
                get(sc),
                budgets,
                compress,
                prefix_slots=get(p),
                store_slots=get(st),
                guided=guided,
                work_slots=get(work_slots[column]) if work_slots else None,
                kept=kept,
                device_budgets=get(at_budgets),
            )
            for i, sc, budgets, compress, p, st, guided, column, kept, at_budgets in group_columns
        )
        for group_columns in staged_columns
    )
    return ForwardPlan(
        get(at_qo),
        columns,
        state.config.sink,
        state.config.window,
        keys=Segments(get(at_kv), int(seq_lens.sum()), int(seq_lens.max()) if seq_lens.numel() else 0),
        prefix_positions=get(prefix_positions),
        new_positions=get(new_positions),
        keeps=get(keeps),
        kept_positions=get(kept_positions),
        store_positions=get(at_store),
        work_positions=get(at_work),
        policy_groups=tuple(PolicyGroup(policy, get(r), get(m)) for policy, r, m in policies),
        max_q_len=int(extend.max()) if extend.numel() else 0,
    )


class _Staging:
    """Host tensors bound for the device in one non-blocking copy (`device_copy.upload`): `add`
    gives each a ticket (None stays None), `send` returns the lookup of tickets to device tensors."""

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
        """Every policy of the batch with its requests' batch indices and mask (`_policy_members`), staged."""
        members = _policy_members(state, index)
        return [(policy, self.add(at), self.add(mask)) for policy, at, mask in members]

    def send(self, device: torch.device | str) -> Callable[[int | None], torch.Tensor | None]:
        on_device = upload(self.host, device)
        return lambda ticket: None if ticket is None else on_device[ticket]


def build_decode(
    state: SparseState,
    req_indices: Sequence[int],
    evicting: Sequence[EvictingRequests],
    device: torch.device | str = "cpu",
) -> ForwardPlan:
    """Plan a decode step from the host tables alone: each request's newest entry (appended by
    the allocation) takes the new token, and the requests the allocation cut back to their
    budget get their eviction (one per record of `evicting`). What the device needs (its
    tables' pending changes, the request indices, lengths and evictions) travels in one
    non-blocking copy (`device_copy.upload`), and nothing is read back: the host never waits."""
    index = torch.tensor(list(req_indices), dtype=torch.int64)
    staging = _Staging()
    writes = [staging.writes(group) for group in state.groups]
    per_row = state.scores_per_row
    at_requests, at_batch = staging.add(index), staging.add(torch.arange(len(index)))
    tables = []
    for group in state.groups:
        lengths = group.table.counts[index]
        width = int(lengths.max()) if lengths.numel() else 0
        positions = torch.arange(width)
        last = (lengths - 1).clamp(min=0)
        tickets = [staging.add(t) for t in (lengths, last, positions // per_row, positions % per_row)]
        tables.append((width, tickets))
    kinds = []
    for e in evicting:
        slots, score_slots = _old_entries(state, state.groups[e.group], e.req_indices, e.olds)
        kinds.append((e.group, e.budget, e.policy, staging.add(slots), staging.add(score_slots)))
    at_kinds = staging.add(_row_kinds(state, index))
    at_indptr = staging.add(indptr(torch.ones(len(index), dtype=torch.int64)))
    get = staging.send(device)
    for group, write in zip(state.groups, writes):
        _apply_writes(group, write, get)
    decode_tables = tuple(
        _decode_tables(group, get(at_requests), get(at_batch), width, [get(t) for t in tickets], per_row)
        for group, (width, tickets) in zip(state.groups, tables)
    )
    return ForwardPlan(
        get(at_indptr),
        (),
        state.config.sink,
        state.config.window,
        decode_tables=decode_tables,
        evictions=tuple(Eviction(g, b, get(sl), get(sc), policy) for g, b, policy, sl, sc in kinds),
        row_kinds=get(at_kinds),
    )


def _row_kinds(state: SparseState, index: torch.Tensor) -> torch.Tensor | None:
    """[B, 2] int32 host: each request's `decode_rule` (its own policy's, else the server's), when
    some request's policy decodes otherwise than the server's (`ScoringPolicy.decodes_like`);
    None when every row decodes as the server's."""
    server = state.policy
    policies = [state.requests.policy[req_idx] or server for req_idx in index.tolist()]
    if all(policy.decodes_like(server) for policy in policies):
        return None
    return torch.tensor([policy.decode_rule() for policy in policies], dtype=torch.int32)


def _policy_members(state: SparseState, index: torch.Tensor) -> list[tuple[ScoringPolicy, torch.Tensor, torch.Tensor]]:
    """Every policy of the batch of requests `index` with its requests' indices in the batch and
    the same as a mask (host), when some request has a policy of its own (none otherwise)."""
    policies = [state.requests.policy[req_idx] for req_idx in index.tolist()]
    if all(policy is None for policy in policies):
        return []
    members: dict[ScoringPolicy, list[int]] = {}
    for member, policy in enumerate(policies):
        members.setdefault(policy or state.policy, []).append(member)
    out = []
    for policy, indices in members.items():
        at = torch.tensor(indices, dtype=torch.int64)
        mask = torch.zeros(len(policies), dtype=torch.bool)
        mask[at] = True
        out.append((policy, at, mask))
    return out


def _old_entries(
    state: SparseState, group: SparseGroup, req_indices: list[int], olds: list[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(old heap rows, their score slots), both host [columns, N, n_old], of these evicting
    requests (their old entries in `olds`, all as long: the budget's max_entries)."""
    old = torch.stack(olds).permute(2, 0, 1).contiguous()
    n_old = old.shape[2]
    positions = torch.arange(n_old).repeat(len(req_indices))
    slots = group.score_slots(torch.tensor(req_indices).repeat_interleave(n_old), positions)
    return old, slots.T.reshape(group.columns, len(req_indices), n_old).contiguous()


def _apply_writes(
    group: SparseGroup, write: tuple[int, int, int, int] | None, get: Callable[[int | None], torch.Tensor | None]
) -> None:
    """Bring the group's device tables up to date from the uploaded changes."""
    if write is None:
        return
    entries, values, score_entries, score_values = (get(ticket) for ticket in write)
    if entries.numel():
        group.device_table.view(-1)[entries] = values.to(torch.int32)
    if score_entries.numel():
        group.device_scores.view(-1)[score_entries] = score_values.to(torch.int32)


def _indices(state: SparseState, group: SparseGroup, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [columns, total], score slots [columns, total]) of the requests' entries,
    request-major (host)."""
    lengths = group.table.counts[index]
    width = int(lengths.max()) if lengths.numel() else 0
    mask = torch.arange(width)[None, :] < lengths[:, None]
    entries = group.table.table[index, :width][mask]  # [total, columns]
    positions = torch.arange(width).expand(len(index), width)[mask]
    scores = group.score_slots(index.repeat_interleave(lengths), positions)
    return entries.T.contiguous(), scores.T.contiguous()


def _decode_tables(
    group: SparseGroup,
    req_indices: torch.Tensor,
    batch: torch.Tensor,
    width: int,
    uploaded: list[torch.Tensor],
    per_row: int,
) -> DecodeTables:
    """The group's decode tables for the batch's requests (`req_indices`, device), gathered from
    its device tables (`SparseGroup.device_table`); W, the most entries of one, is known on the
    host, and so are the lengths, the newest entries' positions and the score-slot arithmetic
    (`uploaded`). Past a request's length: whatever the mirror holds there, slots that were valid
    (the padding row when never written)."""
    lengths, last, page_of, in_page = uploaded
    entries = group.device_table[req_indices, :width]  # [B, W, columns]
    pages = group.device_scores[req_indices][:, :, page_of]  # [B, columns, W]
    scores = (pages * per_row + in_page).transpose(1, 2)  # [B, W, columns]
    return DecodeTables(lengths, entries, scores, entries[batch, last].T, scores[batch, last].T)
