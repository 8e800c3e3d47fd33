"""What a forward changes in the `SparseState` before it is planned (no SGLang imports).

A prefill (`begin_extend`) counts itself, reads and writes the prefix store (a last chunk's held
blocks pinned, a chunk's tokens stored and held for the prompt's next chunk, other new tokens
stored where the heap has room), takes the heap rows a guided prefill's new tokens wait in, moves
its requests to `DECODING` and tops the host free list up; a decode step (`begin_decode`) takes
the step's evictions off the groups and groups them by (budget, policy). What each returns is all
that planning (`planning.py`) needs beyond the state's tables, which it only reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from sglang_kvsparse.entry_table import HeapError
from sglang_kvsparse.policies import ScoringPolicy
from sglang_kvsparse.request_table import Phase
from sglang_kvsparse.sparse_state import SparseState


@dataclass(frozen=True)
class ExtendStep:
    """A prefill forward's requests and what it took (all host tensors).

    `partial` [B]: the chunks before their prompt's last (they keep no entries and store their
    tokens). With the prefix store: `prefix_rows` [num_columns, n_prefix] the matched prefixes'
    store rows, `store_rows` [num_columns, n] the rows the new tokens at `store_positions` [n]
    (among the batch's new tokens) are stored in. `work_rows` (per sparse column, [n]) the heap
    rows the new tokens at `work_positions` of the requests some group keeps by the guide wait in
    until it has chosen (back once the forward has been issued)."""

    req_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    partial: torch.Tensor
    prefix_rows: torch.Tensor | None = None
    store_rows: torch.Tensor | None = None
    store_positions: torch.Tensor | None = None
    work_rows: tuple[torch.Tensor, ...] = ()
    work_positions: torch.Tensor | None = None

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens


@dataclass(frozen=True)
class EvictingRequests:
    """The requests of one group that evict this decode step keeping `budget` by `policy` (None:
    the server's), with their entries before the cut (`olds`, each [max_entries, columns])."""

    group: int
    budget: int
    policy: ScoringPolicy | None
    req_indices: list[int]
    olds: list[torch.Tensor]


def begin_extend(
    state: SparseState,
    req_indices: Sequence[int],
    prefix_lens: Sequence[int],
    extend_lens: Sequence[int],
    prefix_ids: Sequence[torch.Tensor] = (),
    new_ids: torch.Tensor | None = None,
) -> ExtendStep:
    """The state changes of a prefill forward (see the module doc). With the prefix store,
    `prefix_ids` (per request, SGLang's full-pool ids of its matched prefix) and `new_ids` (the
    batch's new tokens' ids, request-major) are required."""
    index = torch.tensor(list(req_indices), dtype=torch.int64)
    prefix = torch.tensor([int(n) for n in prefix_lens], dtype=torch.int64)
    extend = torch.tensor([int(n) for n in extend_lens], dtype=torch.int64)
    if bool(prefix.any()) and state.store is None:
        raise HeapError("an extend with a cached prefix reached the sparse layers without a prefix store")
    partial = state.requests.is_(Phase.CHUNKED, index)
    hits = [int(n) for n, i in zip(prefix, index.tolist()) if n and not state.continues_chunks(i)]
    counters = state.counters
    counters.forward_plans += 1
    counters.chunks_stored += int(partial.sum())
    counters.prefix_hits += len(hits)
    counters.prefix_tokens_reused += sum(hits)
    counters.scoring_passes_peak = max(counters.scoring_passes_peak, _distinct_policies(state, index))
    step = ExtendStep(index, prefix, extend, partial)
    if state.store is not None:
        if new_ids is None or len(prefix_ids) != len(index):
            raise HeapError("a prefill with the prefix store needs every request's prefix ids and the new ids")
        prefix_rows, store_rows, store_positions = _use_store(state, step, prefix_ids, new_ids)
        step = replace(step, prefix_rows=prefix_rows, store_rows=store_rows, store_positions=store_positions)
    elif bool(partial.any()):
        raise HeapError("a chunked prefill reached the sparse layers without a prefix store")
    work_rows, work_positions = _take_guide_rows(state, step)
    step = replace(step, work_rows=work_rows, work_positions=work_positions)
    state.requests.phase[index[~partial]] = Phase.DECODING
    # The store took its rows: top the host free list up again to what the running requests'
    # decode steps will take (as the prefill's allocation did), so none waits on the device.
    state.heap.reserve(state.decode_reserve())
    return step


def begin_decode(state: SparseState, req_indices: Sequence[int]) -> list[EvictingRequests]:
    """The state changes of a decode step: its evictions (cut by the allocation) taken off the
    groups, one record per group and (budget, policy) among them."""
    state.counters.forward_plans += 1
    listed = [int(i) for i in req_indices]
    evicting_groups = []
    for g, group in enumerate(state.groups):
        if not group.evictions:  # most steps: no Python pass over the batch
            continue
        evicting = [i for i in listed if i in group.evictions]
        olds = {i: group.evictions.pop(i) for i in evicting}
        if group.evictions:
            raise HeapError(f"requests {sorted(group.evictions)} evicted but are not in this decode batch ({listed})")
        members: dict[tuple[int, ScoringPolicy | None], list[int]] = {}
        budgets = state.budgets(group, torch.tensor(evicting, dtype=torch.int64)).tolist()
        for req_idx, budget in zip(evicting, budgets):
            members.setdefault((budget, state.requests.policy[req_idx]), []).append(req_idx)
        for (budget, policy), indices in members.items():
            evicting_groups.append(EvictingRequests(g, budget, policy, indices, [olds[i] for i in indices]))
        state.counters.evictions += len(evicting)
    state.counters.evictions_per_step_peak = max(state.counters.evictions_per_step_peak, len(evicting_groups))
    return evicting_groups


def _distinct_policies(state: SparseState, index: torch.Tensor) -> int:
    """Scoring passes a prefill of these requests makes: one per distinct policy among them."""
    return len({state.requests.policy[i] or state.policy for i in index.tolist()}) or 1


def _take_guide_rows(state: SparseState, step: ExtendStep) -> tuple[tuple[torch.Tensor, ...], torch.Tensor | None]:
    """(per sparse column, the heap rows [n] the new tokens of the requests some group keeps by
    the guide wait in; their positions [n] among the batch's new tokens). Admission charged them
    (`prefill_charge`); they go back once the forward has been issued."""
    seq_lens = step.seq_lens
    waiting = torch.zeros(len(step.req_indices), dtype=torch.bool)
    for group in state.groups:
        guided = state.guided(state.budgets(group, step.req_indices), seq_lens)
        if guided is not None:
            waiting |= guided & ~step.partial
    if not bool(waiting.any()):
        return (), None
    positions = ranges(indptr(step.extend_lens)[:-1][waiting], step.extend_lens[waiting])
    rows = state.guide_rows(positions.numel())
    state.counters.guide_rows_peak = max(state.counters.guide_rows_peak, rows)
    taken = state.take_for_forward(rows).view(state.layout.num_columns, -1)
    return tuple(taken[:, : positions.numel()]), positions


def _use_store(
    state: SparseState, step: ExtendStep, prefix_ids: Sequence[torch.Tensor], new_ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(the prefixes' store rows [num_columns, n_prefix], the stored new tokens' store rows
    [num_columns, n_stored], those tokens' positions among the batch's new tokens [n_stored]).

    A last chunk's held blocks are pinned for this forward; the tokens of chunks before a
    prompt's last are stored (admission charged their rows) and their request holds its prompt so
    far for its next chunk; only then, best effort, the other new tokens get store rows, which may
    reclaim unpinned, unheld store blocks."""
    store, index, partial, extend = state.store, step.req_indices, step.partial, step.extend_lens
    parts = [ids.to("cpu", torch.int64) for ids in prefix_ids]
    prefix = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
    prefix_rows = store.lookup(prefix)
    store.touch(prefix)
    for req_idx in index[~partial].tolist():
        state.read_held(req_idx)  # pinned before any heap row is taken below, which may reclaim the store
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


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """start..start+length-1 for each pair, concatenated."""
    if lengths.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    offsets = torch.arange(int(lengths.sum())) - (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths)
    return starts.repeat_interleave(lengths) + offsets


def indptr(lengths: torch.Tensor) -> torch.Tensor:
    """[B+1] int64 boundaries of these lengths (host)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = lengths.cumsum(0)
    return out
