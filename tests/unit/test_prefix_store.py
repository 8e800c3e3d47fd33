"""PrefixStore: full-pool ids to heap rows of every sparse column, in borrowed blocks."""

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kvsparse.state.prefix_store import PrefixStore

from .heap import FreeList


def ids(start: int, stop: int) -> torch.Tensor:
    return torch.arange(start, stop)


def make(rows: int = 64, columns: int = 2, page: int = 1) -> tuple[PrefixStore, FreeList]:
    heap = FreeList(rows, page)
    return PrefixStore(num_full_ids=128, columns=columns, page_size=page, max_blocks=rows // (columns * page)), heap


def put(store: PrefixStore, heap: FreeList, span: torch.Tensor) -> torch.Tensor:
    """Store the span in as many blocks as the heap's free rows allow (best effort)."""
    blocks = min(-(-span.numel() // store.page_size), heap.free_rows() // store.rows_per_block)
    rows = heap.take(blocks * store.rows_per_block) if blocks else torch.empty(0, dtype=torch.int64)
    return store.put(span, rows)


def test_put_lookup_and_the_leading_run_of_entries():
    store, heap = make()
    rows = put(store, heap, ids(10, 15))
    assert rows.shape == (5, 2) and rows.unique().numel() == 10
    assert torch.equal(store.lookup(ids(10, 15)), rows)
    assert store.valid_prefix_len(ids(10, 15)) == 5
    assert store.valid_prefix_len(torch.tensor([10, 11, 40, 12])) == 2  # stops at the first miss
    assert store.valid_prefix_len(torch.tensor([], dtype=torch.int64)) == 0
    assert store.rows() == 10 and heap.free_rows() == 54


def test_a_freed_id_is_forgotten_and_an_emptied_block_gives_its_rows_back():
    store, heap = make(page=2)
    put(store, heap, ids(1, 5))  # 2 blocks of 2 tokens, 4 rows each
    assert heap.give(store.forget(ids(3, 4))) is None and store.rows() == 8  # block 2 still holds id 4
    assert store.valid_prefix_len(ids(1, 5)) == 2
    heap.give(store.forget(ids(4, 5)))
    assert store.rows() == 4 and heap.free_rows() == 60
    again = put(store, heap, ids(3, 4))  # SGLang gave id 3 to a new prompt token: stored afresh
    assert store.valid_prefix_len(ids(3, 4)) == 1 and again.shape == (1, 2)


def test_reclaim_takes_least_recently_used_blocks_and_tails_before_heads():
    store, heap = make(rows=14)
    put(store, heap, ids(1, 4))  # sequence A, used first
    put(store, heap, ids(10, 14))  # sequence B
    store.touch(ids(1, 4))  # A is read again: now B is the older one
    heap.give(store.reclaim(4))  # two blocks' worth
    assert store.valid_prefix_len(ids(1, 4)) == 3
    assert store.valid_prefix_len(ids(10, 14)) == 2  # B lost its tail, kept its head


def test_pinned_blocks_are_not_reclaimable_until_unpinned():
    store, heap = make(rows=8)
    put(store, heap, ids(1, 5))
    store.pin(ids(1, 3))
    store.pin(ids(1, 2))  # pins count: two requests read id 1
    assert store.unpinned_rows_of(ids(1, 5)) == 4 and store.reclaimable_rows() == 4
    heap.give(store.reclaim(8))
    assert store.valid_prefix_len(ids(1, 5)) == 2
    store.unpin(ids(1, 3))
    assert store.reclaimable_rows() == 2  # id 1 is still pinned once
    store.unpin_all()
    heap.give(store.clear())
    assert store.rows() == 0 and heap.free_rows() == 8


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["put", "forget", "pin", "unpin", "take", "give"]), st.integers(1, 40), st.integers(1, 9)
        ),
        max_size=40,
    )
)
def test_entries_and_rows_stay_consistent(ops):
    """Whatever happens, each entry's block names its id, pinned blocks keep their entries, the
    heap's used rows are the store's plus the other owners', and the reclaimable count is right."""
    store, heap = make(rows=48, columns=2, page=2)
    taken: list[torch.Tensor] = []
    live: set[int] = set()  # ids SGLang holds (stored ones among them)
    for op, start, n in ops:
        span = ids(start, start + n)
        fresh = torch.tensor([i for i in span.tolist() if i not in live], dtype=torch.int64)
        if op == "put" and fresh.numel():
            live.update(fresh.tolist())
            put(store, heap, fresh)
        elif op == "forget":
            live.difference_update(span.tolist())
            heap.give(store.forget(span))
        elif op == "pin":
            store.pin(span)
        elif op == "unpin":
            store.unpin_all()
        elif op == "take":  # another owner takes rows, reclaiming store blocks if it must
            pinned = {i for i in range(128) if store.entry_of[i] and store.pins[store.entry_of[i] // 2]}
            rows = 2 * n
            if rows <= heap.free_rows() + store.reclaimable_rows():
                heap.give(store.reclaim(rows - heap.free_rows()))
                taken.append(heap.take(rows))
            assert all(store.entry_of[i] > 0 for i in pinned)
        elif taken:
            heap.give(taken.pop())
        entries = torch.nonzero(store.entry_of).flatten()
        blocks, offsets = store.entry_of[entries] // 2, store.entry_of[entries] % 2
        assert torch.equal(store.ids[blocks, offsets], entries)
        assert bool((store.last_use[blocks] >= 0).all())
        assert set(entries.tolist()) <= live
        assert 48 - heap.free_rows() == store.rows() + sum(t.numel() for t in taken)
        unpinned = (store.last_use >= 0) & (store.pins == 0) & (store.holds == 0)
        assert store.reclaimable_rows() == int(unpinned.sum()) * store.rows_per_block  # the cached count


def test_adopt_moves_entries_to_the_trees_ids_for_the_same_tokens():
    """A conversation's turn 2 prefilled turn 1's answer under new ids (20..23) that the tree,
    holding the answer under decode-time ids (60..63, no entries), is about to free."""
    store, heap = make(page=2)
    rows = put(store, heap, ids(20, 24))
    put(store, heap, ids(70, 72))  # id 70..71 already have entries of their own
    moved = store.adopt(torch.tensor([20, 21, 22, 23, 30]), torch.tensor([60, 61, 70, 23, 31]))
    assert moved == 2  # 22 -> 70 refused (70 has one), 23 is the same id, 30 has none
    assert torch.equal(store.lookup(torch.tensor([60, 61])), rows[:2])
    assert store.valid_prefix_len(torch.tensor([60, 61, 22, 23])) == 4
    heap.give(store.forget(ids(20, 24)))  # SGLang frees the duplicates: 22 and 23 go, the moved stay
    assert store.valid_prefix_len(torch.tensor([60, 61])) == 2 and store.rows() == 8
    heap.give(store.forget(torch.tensor([60, 61, 70, 71])))
    assert store.rows() == 0 and heap.free_rows() == 64


def test_held_blocks_outlive_their_entries_until_released():
    store, heap = make(page=2)
    put(store, heap, ids(10, 14))
    blocks = store.blocks_of(ids(10, 14))
    store.hold(blocks)
    assert store.reclaimable_rows() == 0 and store.reclaim(64).numel() == 0
    assert store.forget(ids(10, 14)).numel() == 0  # a chunked prompt still reads the blocks
    assert store.rows() == 8
    heap.give(store.release(blocks))
    assert store.rows() == 0 and heap.free_rows() == 64


def test_a_held_prompts_sliding_pages_past_its_sinks_and_window_are_given_back_on_demand():
    """Columns (a sparse layer's, a sliding one), pages of 2, sink 1, window 4: a chunked prompt
    of 12 tokens holds blocks 1..6; the sliding pages of blocks 2..4 (tokens 2-7) are read by no
    later chunk.
    Reclaiming takes unheld cache blocks whole first, then those pages (oldest first); a
    narrowed block reads as the padding row in its sliding column; a pin for the last chunk's
    forward keeps the window's pages; everything comes back."""
    heap = FreeList(64, 2)
    store = PrefixStore(128, 2, 2, 32, sliding=(False, True), sliding_reads=(1, 4))
    prompt, other = ids(1, 13), ids(40, 42)
    put(store, heap, other)  # a cache entry, unheld: goes first
    put(store, heap, prompt)
    heap.give(store.hold_for(7, prompt))
    assert store.rows() == 28 and store.reclaimable_rows() == 4 + 3 * 2
    assert store.chunked_rows(12, 4) == 6 * 2 + min(6, 1 + 2 + 2 + 2) * 2
    heap.give(store.reclaim(6))  # the cache entry (4 rows), then one block's sliding page
    assert store.valid_prefix_len(other) == 0 and store.rows() == 22 and heap.free_rows() == 64 - 22
    heap.give(store.reclaim(64))
    assert store.rows() == 12 + 3 * 2 and store.reclaimable_rows() == 0
    rows = store.lookup(prompt)
    assert (rows[2:8, 1] == 0).all() and (rows[:2, 1] > 0).all() and (rows[8:, 1] > 0).all()
    assert (rows[:, 0] > 0).all()  # the sparse layer's column keeps every token
    assert store.valid_prefix_len(prompt) == 12  # its sinks and last window are wide
    assert store.valid_prefix_len(prompt[:6], limit=6) == 2  # inside the narrowed part: the sinks' page
    heap.give(store.read_held(7))  # the last chunk: pinned for its forward, the window's pages too
    assert store.reclaimable_rows() == 0
    store.unpin_all()  # now a cache entry
    assert store.reclaimable_rows() == store.rows() == 18
    heap.give(store.forget(prompt))
    assert store.rows() == 0 and heap.free_rows() == 64
