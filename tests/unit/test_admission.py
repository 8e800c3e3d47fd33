"""Admission to the sparse pools (`sglang_kvsparse.admission`), without SGLang."""

import torch

from sglang_kvsparse.admission import SparseAdmission
from sglang_kvsparse.config import SparsityConfig
from sglang_kvsparse.sparse_state import SparseState

BUDGET, EVICT_PAGE, PAGE = 8, 4, 2  # max_entries 12: 6 pages of 2


def make_state(slots: int, prefix_cache: bool = False) -> SparseState:
    config = SparsityConfig(full_layers=(0,), budget=BUDGET, sink=1, window=2, evict_page=EVICT_PAGE)
    resolved = config.resolve(3, 64)
    return SparseState(
        resolved,
        slots_per_layer={1: slots, 2: slots},
        max_requests=8,
        num_kv_heads=2,
        head_dim=4,
        dtype=torch.float32,
        dense_capacity=1000,
        page_size=PAGE,
        prefix_cache=prefix_cache,
    )


def grow(state: SparseState, rows, lengths) -> None:
    state.alloc_to_lengths(req_pool_indices_cpu=torch.tensor(rows), target_seq_lens_cpu=torch.tensor(lengths))


def test_requests_are_charged_their_largest_footprint_capped_at_max_entries():
    state = make_state(slots=24)  # 12 pages
    assert state.pages_to_hold(3) == [2] and state.pages_to_hold(100) == [6]
    admission = SparseAdmission(state, running=[])
    assert admission.fits(100)
    admission.reserve(100)
    admission.reserve(5)  # 3 pages
    assert admission.free_pages == [3] and admission.admitted == 2
    assert not admission.fits(100) and admission.fits(6)


def test_running_requests_are_charged_what_they_may_still_grow_by():
    state = make_state(slots=24)
    grow(state, [1], [20])  # holds 8 entries = 4 pages, may grow to 12 entries = 6 pages
    grow(state, [2], [3])  # holds 2 pages, ends at 5 tokens = 3 pages
    admission = SparseAdmission(state, running=[(1, 40), (2, 5)])
    assert admission.free_pages == [12 - 4 - 2 - 2 - 1]
    assert admission.fits(6) and not admission.fits(7)


def test_admitted_requests_never_exhaust_the_pool_while_they_grow():
    """What admission promises holds: every admitted request decodes to its final length."""
    state = make_state(slots=24)
    finals = {1: 40, 2: 9, 3: 30, 4: 12}
    admitted = []
    for row, final in finals.items():
        admission = SparseAdmission(state, running=[(r, finals[r]) for r in admitted])
        if admission.fits(final):
            grow(state, [row], [final // 2])
            admitted.append(row)
    assert admitted == [1, 2]  # 6 + 5 pages promised; a third would need 6 more
    lengths = {row: finals[row] // 2 for row in admitted}
    while any(lengths[row] < finals[row] for row in admitted):
        rows = [row for row in admitted if lengths[row] < finals[row]]
        grow(state, rows, [lengths[row] + 1 for row in rows])
        state.plan_decode(rows)
        lengths.update({row: lengths[row] + 1 for row in rows})
        for row in admitted:  # no SlotPoolExhausted above, and each row within its charge
            assert state.pages_held(row) <= state.pages_to_hold(finals[row])
    assert state.pages_held(2) == [5]


def test_cached_prefixes_count_as_free_until_a_request_pins_its_own():
    state = make_state(slots=24, prefix_cache=True)  # 12 pages
    store = state.stores[0]
    store.put(torch.arange(1, 13))  # a finished prompt's 12 entries: 6 pages, evictable
    assert SparseAdmission(state, running=[]).free_pages == [12]
    admission = SparseAdmission(state, running=[])
    reuse = torch.arange(1, 9)  # a request reusing 8 of them pins 4 pages
    assert admission.fits(100, reuse)  # 6 pages for its row + 4 pinned <= 12
    admission.reserve(100, reuse)
    assert admission.free_pages == [2] and store.evictable_pages() == 2
    assert not admission.fits(5, torch.arange(1, 13))  # 3 + the 2 pages still unpinned > 2
    assert SparseAdmission(state, running=[]).free_pages == [12]  # a new round unpins


def test_a_request_sharing_a_prompt_admitted_this_round_waits_for_its_prefix():
    state = make_state(slots=24, prefix_cache=True)
    system = list(range(1000, 1300))  # a 300-token system prompt nobody has cached yet
    admission = SparseAdmission(state, running=[])
    first = system + [1, 2, 3]
    assert not admission.should_wait(first, prefix_len=0)  # nothing admitted yet: it goes first
    admission.reserve(10, token_ids=first)
    assert admission.should_wait(system + [7, 8], prefix_len=0)  # would share 300 tokens
    assert not admission.should_wait(system + [7, 8], prefix_len=100)  # only 200 more than its hit
    assert not admission.should_wait([5] + system, prefix_len=0)  # shares nothing
    assert not SparseAdmission(state, running=[]).should_wait(system + [7, 8], prefix_len=0)  # next round
