"""The walkthrough in docs/architecture.md, step by step: one 4,000-token request at budget 256 on
the default preset's layout (SmolLM2's 30 layers, layer 0 full: 29 sparse columns on one lane), then a
second request sharing its first 3,950 tokens. The numbers in the page's table are what the state
does here, so the page cannot drift from the code (as `tests/integration/test_architecture_trace.py`
keeps the trace's names)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from sglang_kvsparse.config import PRESETS
from sglang_kvsparse.forward.planning import plan_decode, plan_extend
from sglang_kvsparse.state.admission import prefill_charge, waits_for_guide
from sglang_kvsparse.state.sparse_group import LaneBuffers
from sglang_kvsparse.state.sparse_state import SparseState

from .heap import FreeList, grow

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"
CONFIG = dataclasses.replace(PRESETS["default"], budget=256)
LANES = max(len(CONFIG.full_layers), 1)
#: The KV bytes of 8,192 dense tokens of a 30-layer model, as heap rows of the full layers' lanes.
HEAP_ROWS = 8192 * 30 // LANES
PROMPT, SHARED, NEW_TOKENS, MAX_NEW_TOKENS = 4000, 3950, 50, 64


def walkthrough() -> list[tuple[str, ...]]:
    """Each step: (what happens, heap rows free, A's sparse rows, B's sparse rows, store rows,
    rows that go back once the forward has been issued: a guided prefill's waiting tokens, an
    eviction's old entries)."""
    resolved = CONFIG.resolve(30, 8192)
    heap = FreeList(HEAP_ROWS)
    # SmolLM2's KV heads as the CPU server keeps them: 3 of dim 64 in float32, so a score row
    # holds 64 entries' scores (zeros are not touched: no memory until written).
    shape = (HEAP_ROWS + 1, 3, 64)
    lanes = [LaneBuffers.over(torch.zeros(shape), torch.zeros(shape)) for _ in range(LANES)]
    state = SparseState(resolved, heap=heap, lanes=lanes, max_requests=4, heap_rows=HEAP_ROWS, prefix_cache=True)
    heap.on_free = state.released.freed
    rows: list[tuple[str, ...]] = []

    def note(step: str) -> None:
        counts = (
            heap.free_rows(),
            state.rows_held(1),
            state.rows_held(2),
            state.store.rows(),
            state.heap.deferred_rows(),
        )
        rows.append((step, *map(str, counts)))

    note("start")
    final = PROMPT + MAX_NEW_TOKENS
    charge = prefill_charge(state, 0, PROMPT, PROMPT, final)
    ids_a = heap.sglang_alloc(PROMPT)
    state.expect([1], [final], [PROMPT])
    grow(state, [1], [PROMPT])
    guided = waits_for_guide(state.resolved, state.layout, PROMPT)
    note(f"A admitted (charge {charge}: guided {guided}), its ids and entries")
    plan_extend(state, [1], [0], [PROMPT], [torch.empty(0, dtype=torch.int64)], ids_a)
    note("A's prefill planned: its tokens stored, and waiting for the guide")
    state.finish_forward()
    note("A's prefill issued: the waiting rows back")
    length, evicted_at = PROMPT, None
    for step in range(1, 18):
        ids_a = torch.cat([ids_a, heap.sglang_alloc(1)])
        length += 1
        grow(state, [1], [length])
        plan = plan_decode(state, [1])
        if plan.evictions and evicted_at is None:
            evicted_at = step
            note(f"A's decode step {step}: the first eviction")
        state.finish_forward()
    note(f"A after 17 decode steps (evicted back to the budget at step {evicted_at})")
    state.free(1)
    heap.cached.append(ids_a)  # SGLang's tree keeps A's ids
    note("A finished: its sparse rows back; the tree keeps its ids, the store its tokens")

    prefix = ids_a[:SHARED]
    reuse = state.reusable_prefix_len(prefix, SHARED + NEW_TOKENS)
    state.pin_prefix(prefix[:reuse])
    charge = prefill_charge(
        state, reuse, SHARED + NEW_TOKENS, SHARED + NEW_TOKENS, SHARED + NEW_TOKENS + MAX_NEW_TOKENS
    )
    new_ids = heap.sglang_alloc(SHARED + NEW_TOKENS - reuse)
    state.expect([2], [SHARED + NEW_TOKENS + MAX_NEW_TOKENS], [SHARED + NEW_TOKENS])
    grow(state, [2], [SHARED + NEW_TOKENS])
    note(f"B admitted: reuses {reuse} tokens (charge {charge}), its new ids and entries")
    plan_extend(state, [2], [reuse], [SHARED + NEW_TOKENS - reuse], [prefix[:reuse]], new_ids)
    note("B's prefill planned: its new tokens stored, and waiting for the guide")
    state.finish_forward()
    note("B's prefill issued")
    return rows


def doc_rows() -> list[tuple[str, ...]]:
    text = DOC.read_text()
    table = text[text.index("| step | heap rows free |") :].split("\n\n")[0]
    return [tuple(cell.strip() for cell in line.strip("|").split("|")) for line in table.splitlines()[2:]]


def test_the_walkthrough_table_is_what_the_state_does():
    assert doc_rows() == walkthrough()
