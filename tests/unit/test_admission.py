"""What admission charges for the sparse layers (`sglang_kvsparse.state.admission`), without SGLang.

`admit` below is SGLang's admission rule over the heap, as `patches/admission.py` feeds it: a new
request fits when its full-pool tokens plus its sparse rows are below the heap's free and
reclaimable rows, less what the running requests may still take.
"""

import torch

from sglang_kvsparse.state.admission import AdmissionRound, rows_to_hold, running_growth

from .heap import grow, make_state

BUDGET, EVICT_PAGE, PAGE = 8, 4, 2  # max_entries 12: 6 pages of 2
SCORE_ROWS = 2  # head dim 8 in float32: 8 entries' scores per row, 12 entries in 2 rows (a page)


def state_on_heap(rows: int, prefix_cache: bool = False):
    # 4 layers: layer 0 full (one lane), layers 1..3 sparse (three columns)
    return make_state(
        num_layers=4, rows=rows, page=PAGE, budget=BUDGET, evict_page=EVICT_PAGE, window=2, prefix_cache=prefix_cache
    )


def test_requests_are_charged_their_largest_footprint_capped_at_max_entries():
    state, _ = state_on_heap(rows=240)
    assert rows_to_hold(state, 3) == 3 * 4  # 3 columns, 2 pages of 2
    # Budget + eviction page, whatever the length, and the score rows of a request that evicts.
    assert rows_to_hold(state, 100) == 3 * (12 + SCORE_ROWS)
    assert rows_to_hold(state, 12) == 3 * 12  # never evicts: no scores
    # Below the budget every sparse layer keeps every token: full + sparse = stock's rows.
    full_rows = 4
    assert full_rows + rows_to_hold(state, 4) == state.layout.dense_rows(4)


def test_running_requests_are_charged_what_they_may_still_grow_by_scaled_as_sglang_scales():
    state, _ = state_on_heap(rows=240)
    state.expect([1, 2], [40, 5])
    grow(state, [1], [20])  # holds 8 entries = 4 pages per column (and scores), may grow to 12 = 6 pages
    grow(state, [2], [3])  # holds 2 pages per column, ends at 5 tokens = 3 pages (no scores)
    assert state.rows_held(1) == 3 * (8 + SCORE_ROWS) and state.rows_held(2) == 3 * 4
    assert running_growth(state, [(1, 40, 1.0), (2, 5, 1.0)]) == 3 * (4 + 2)
    # SGLang charges a running request ratio * its remaining tokens; a request below the budget
    # grows by one row per column per token, so its sparse charge scales by the same ratio.
    assert running_growth(state, [(2, 5, 0.5)]) == 0.5 * 3 * 2


def test_admitted_requests_decode_to_their_end_without_exhausting_the_heap():
    """What admission promises holds: every admitted request decodes to its final length."""
    state, heap = state_on_heap(rows=160)
    finals = {1: 40, 2: 9, 3: 30, 4: 12}
    admitted: dict[int, torch.Tensor] = {}
    lengths: dict[int, int] = {}
    for row, final in finals.items():
        running = [(r, finals[r], 1.0) for r in admitted]
        stock = sum(finals[r] - lengths[r] for r in admitted)  # SGLang's own reserve (ratio 1)
        remaining = heap.free_rows() + state.heap.reclaimable_rows() - stock - running_growth(state, running)
        prompt = final // 2
        charge = prompt + (final - prompt) + PAGE + rows_to_hold(state, final)
        if charge < remaining:
            state.expect([row], [final])
            admitted[row] = heap.sglang_alloc(-(-prompt // PAGE) * PAGE)
            grow(state, [row], [prompt])
            lengths[row] = prompt
    assert sorted(admitted) == [1, 2]  # rows 3 and 4 would not fit beside them
    while any(lengths[row] < finals[row] for row in admitted):
        rows = [row for row in admitted if lengths[row] < finals[row]]
        for row in rows:
            if lengths[row] % PAGE == 0:
                admitted[row] = torch.cat([admitted[row], heap.sglang_alloc(PAGE)])
        grow(state, rows, [lengths[row] + 1 for row in rows])  # never HeapExhausted
        state.finish_forward()
        for row in rows:
            state.groups[0].evictions.pop(row, None)  # the forward moved the survivors
            lengths[row] += 1
            assert state.rows_held(row) <= rows_to_hold(state, finals[row])


def test_a_pinned_prefix_stops_counting_as_free():
    state, heap = state_on_heap(rows=240, prefix_cache=True)
    ids = heap.sglang_alloc(12)
    state.store.put(ids, state.heap.take_for_store(12 * 3))  # a finished prompt's 12 tokens, evictable
    assert state.heap.reclaimable_rows() == 36
    assert state.store.unpinned_rows_of(ids[:8]) == 24
    state.pin_prefix(ids[:8])  # a request reusing 8 of them is admitted
    assert state.heap.reclaimable_rows() == 12 and state.store.unpinned_rows_of(ids) == 12
    state.unpin_prefix(ids[:8])  # ...or refused after all
    assert state.heap.reclaimable_rows() == 36
    state.pin_prefix(ids[:8])
    state.finish_forward()  # its forward was issued
    assert state.heap.reclaimable_rows() == 36


def test_a_request_sharing_a_prompt_admitted_this_round_waits_for_its_prefix():
    system = list(range(1000, 1300))  # a 300-token system prompt nobody has cached yet
    round_ = AdmissionRound()
    first = system + [1, 2, 3]
    assert not round_.should_wait(first, prefix_len=0)  # nothing admitted yet: it goes first
    round_.admitted(first)
    assert round_.should_wait(system + [7, 8], prefix_len=0)  # would share 300 tokens
    assert not round_.should_wait(system + [7, 8], prefix_len=100)  # only 200 more than its hit
    assert not round_.should_wait([5] + system, prefix_len=0)  # shares nothing
    assert not AdmissionRound().should_wait(system + [7, 8], prefix_len=0)  # next round
