"""A forward's state changes happen in its named step (`SparseState.begin_extend` /
`begin_decode`); building its plan (`planning.build_extend` / `build_decode`) only reads the
host state (it brings the device mirrors up to date, which no host decision reads)."""

import dataclasses

import torch

from sglang_kvsparse.forward.planning import build_decode, build_extend
from sglang_kvsparse.state.requests import Phase

from .heap import grow, make_state


def host_state(state, heap) -> dict:
    """Everything a host decision of the sparse layers reads, copied."""
    requests = state.requests
    store = state.store
    return {
        "counters": dataclasses.asdict(state.counters),
        "requests": [t.clone() for t in (requests.length, requests.final_len, requests.budget, requests.phase)],
        "held": {i: tuple(b.clone() for b in held) for i, held in store.held_by.items()},
        "tables": [(g.table.table.clone(), g.table.counts.clone(), g.score_table.clone()) for g in state.groups],
        "evictions": [sorted(g.evictions) for g in state.groups],
        "free": heap.free_rows(),
        "deferred": state.heap.deferred_rows(),
        "store": None if store is None else [t.clone() for t in (store.entry_of, store.pins, store.holds, store.wide)],
    }


def assert_same(before: dict, after: dict) -> None:
    assert before.keys() == after.keys()
    for key in before:
        a, b = before[key], after[key]
        flat_a = torch.utils._pytree.tree_flatten(a)[0]
        flat_b = torch.utils._pytree.tree_flatten(b)[0]
        assert len(flat_a) == len(flat_b), key
        for x, y in zip(flat_a, flat_b):
            assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, key


def test_the_step_changes_the_state_and_the_plan_only_reads_it():
    # A guided prefill with a prefix store (its new tokens wait in rows of their own), a chunk
    # before a prompt's last (stored and held), then decode steps up to an eviction.
    state, heap = make_state(context=128, budget=8, evict_page=4, rows=1024, prefix_cache=True, guide_from=0.5)
    state.expect([1, 2], [60, 60], [40, 40])
    grow(state, [1, 2], [40, 16])  # request 2 prefills a first chunk of 16 tokens
    new_ids = torch.arange(1, 57)
    before_step = host_state(state, heap)
    step = state.begin_extend([1, 2], [0, 0], [40, 16], [torch.empty(0), torch.empty(0)], new_ids)
    after_step = host_state(state, heap)
    assert step.partial.tolist() == [False, True] and len(step.work_rows) == state.layout.num_columns
    # the phase follows the allocations, not the plan: request 1's prefill is allocated, 2's first chunk
    assert state.requests.phase[[1, 2]].tolist() == [Phase.PREFILLING, Phase.CHUNKED]
    assert after_step["deferred"] > before_step["deferred"]  # the guide's rows, back after the forward
    assert 2 in state.store.held_by  # the chunk's store blocks, held for its next chunk
    build_extend(state, step)
    assert_same(after_step, host_state(state, heap))
    state.finish_forward()
    grow(state, [1], [41])  # its first decode token: the prefill has run
    assert state.requests.phase[1] == Phase.DECODING
    state.begin_decode([1])
    state.finish_forward()
    for length in range(42, 54):
        grow(state, [1], [length])
        evicting = state.begin_decode([1])
        before_plan = host_state(state, heap)
        plan = build_decode(state, [1], evicting)
        assert_same(before_plan, host_state(state, heap))
        assert len(plan.evictions) == len(evicting)
        state.finish_forward()
    assert state.counters.evictions > 0
