"""PrefixStore: full-pool ids to store slots, borrowed from a slot pool and given back on demand."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kvsparse.index_map import SlotPool
from sglang_kvsparse.prefix_store import PrefixStore


def ids(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop)


def test_put_lookup_and_the_leading_run_of_entries():
    store = PrefixStore(SlotPool(16), num_full_ids=64)
    slots = store.put(ids(10, 15))
    assert slots.numel() == 5 and bool((slots > 0).all()) and slots.unique().numel() == 5
    assert torch.equal(store.lookup(ids(10, 15)), slots)
    assert store.valid_prefix_len(ids(10, 15)) == 5
    assert store.valid_prefix_len(torch.tensor([10, 11, 40, 12])) == 2  # stops at the first miss
    assert store.valid_prefix_len(torch.tensor([], dtype=torch.int64)) == 0
    assert store.slots() == 5 and store.pool.available_slots() == 11


def test_invalidated_ids_are_forgotten_and_their_page_goes_at_eviction():
    store = PrefixStore(SlotPool(8), num_full_ids=64)
    first = store.put(ids(1, 5))
    store.invalidate(ids(3, 4))  # SGLang allocated id 3 to a new token
    assert store.valid_prefix_len(ids(1, 5)) == 2
    again = store.put(ids(3, 4))  # the new token is a prompt token: stored afresh
    assert store.lookup(ids(3, 4)).item() == again.item() != first[2].item()
    store.reclaim(store.pool.available_pages() + 4)  # the first put's 4 pages, the stale one too
    assert store.slots() == 1 and store.lookup(ids(3, 4)).item() == again.item()  # id 3's new entry stays
    assert int(store.lookup(torch.tensor([1, 2, 4])).count_nonzero()) == 0


def test_eviction_takes_least_recently_used_pages_and_tails_before_heads():
    store = PrefixStore(SlotPool(8), num_full_ids=64)
    store.put(ids(1, 4))  # sequence A, used first
    store.put(ids(10, 14))  # sequence B
    store.touch(store.lookup(ids(1, 4)))  # A is read again: now B is the older one
    store.reclaim(store.pool.available_pages() + 2)
    assert store.valid_prefix_len(ids(1, 4)) == 3
    assert store.valid_prefix_len(ids(10, 14)) == 2  # B lost its tail, kept its head


def test_pinned_pages_survive_reclaim_and_best_effort_puts():
    store = PrefixStore(SlotPool(4), num_full_ids=64)
    store.put(ids(1, 5))
    store.pin(ids(1, 3))
    assert store.unpinned_pages_of(ids(1, 5)) == 2 and store.evictable_pages() == 2
    stored = store.put(ids(20, 25))  # needs 5 pages: gets the 2 unpinned ones
    assert stored.numel() == 2 and store.valid_prefix_len(ids(1, 5)) == 2
    assert store.valid_prefix_len(ids(20, 25)) == 2
    store.unpin_all()
    store.clear()
    assert store.slots() == 0 and store.pool.available_slots() == 4


def test_pages_larger_than_one_slot():
    store = PrefixStore(SlotPool(12, page_size=4), num_full_ids=64)
    slots = store.put(ids(1, 7))  # 6 entries in 2 pages
    assert store.pages() == 2 and store.slots() == 8 and slots.numel() == 6
    store.pin(ids(1, 2))
    assert store.evictable_pages() == 1
    store.reclaim(3)
    assert store.valid_prefix_len(ids(1, 7)) == 4  # the second page (entries 5..6) went


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "invalidate", "pin", "unpin", "rows", "free_rows"]),
                          st.integers(1, 40), st.integers(1, 9)), max_size=40))
def test_entries_and_pages_stay_consistent(ops):
    """Whatever happens, each entry points at a store page that names its id, pinned pages keep
    their entries, and the pool's used pages are the store's plus the rows'."""
    pool = SlotPool(24, page_size=2)
    store = PrefixStore(pool, num_full_ids=64)
    rows: list[torch.Tensor] = []
    for op, start, n in ops:
        span = ids(start, start + n)
        if op == "put":
            store.invalidate(span)
            store.put(span)
        elif op == "invalidate":
            store.invalidate(span)
        elif op == "pin":
            store.pin(span)
        elif op == "unpin":
            store.unpin_all()
        elif op == "rows":  # a request row takes pages, evicting store pages if it must
            pinned_before = {int(i) for i in torch.nonzero(store.slot_of).flatten()
                             if store.pinned[store.slot_of[i] // 2]}
            if n <= pool.available_pages() + store.evictable_pages():
                store.reclaim(n)
                rows.append(pool.alloc_pages(n))
            assert all(store.slot_of[i] > 0 for i in pinned_before)
        elif rows:
            pool.free(rows.pop())
        live = torch.nonzero(store.slot_of).flatten()
        slots = store.slot_of[live]
        assert torch.equal(store.page_ids.reshape(-1)[slots], live)
        assert bool((store.last_use[slots // 2] >= 0).all())
        row_pages = sum(r.numel() for r in rows) // 2
        assert pool.num_pages - pool.available_pages() == store.pages() + row_pages
