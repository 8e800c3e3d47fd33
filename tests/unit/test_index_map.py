"""Slot pools and index maps: deterministic cases and a random-sequence conservation test."""

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sglang_kvsparse.config import SparsityConfig
from sglang_kvsparse.index_map import (
    IndexMapError,
    LayerIndexMap,
    SlotPool,
    SlotPoolExhausted,
    SparseIndexMaps,
    round_up,
)


def slot_list(tensor: torch.Tensor) -> list[int]:
    return tensor.tolist()


# ---- SlotPool --------------------------------------------------------------------------------


def test_pool_reserves_padding_page_and_hands_out_pages():
    pool = SlotPool(num_slots=8, page_size=4)
    assert pool.num_slots == 8 and pool.buffer_slots == 12 and pool.available_pages() == 2
    first = pool.alloc_pages(1)
    assert slot_list(first) == [4, 5, 6, 7]  # page 0 (slots 0..3) is padding
    assert slot_list(pool.alloc_pages(1)) == [8, 9, 10, 11]
    assert pool.alloc_pages(1) is None  # exhausted: None, nothing changed
    assert pool.available_slots() == 0 and pool.slots_in_use() == 8
    pool.free(first)
    assert pool.available_slots() == 4
    assert slot_list(pool.alloc_pages(1)) == [4, 5, 6, 7]


def test_pool_rejects_bad_frees():
    pool = SlotPool(num_slots=8, page_size=2)
    slots = pool.alloc_pages(2)
    with pytest.raises(IndexMapError, match="whole number of pages"):
        pool.free(slots[:1])
    with pytest.raises(IndexMapError, match="whole pages in page order"):
        pool.free(slots.flip(0))
    with pytest.raises(IndexMapError, match="padding"):
        pool.free(torch.tensor([0, 1]))
    pool.free(slots)
    with pytest.raises(IndexMapError, match="double free"):
        pool.free(slots)
    assert pool.available_slots() == 8
    with pytest.raises(ValueError):
        SlotPool(num_slots=7, page_size=2)


def test_pool_alloc_zero_pages():
    pool = SlotPool(num_slots=0, page_size=4)
    assert pool.alloc_pages(0).numel() == 0
    assert pool.alloc_pages(1) is None


# ---- LayerIndexMap ---------------------------------------------------------------------------


def make_map(num_slots=32, page_size=4, max_requests=3, max_entries=10) -> LayerIndexMap:
    return LayerIndexMap(SlotPool(num_slots, page_size), max_requests, max_entries)


def test_assign_append_shrink_release():
    m = make_map()
    assert m.row_capacity == 12
    slots = m.assign(0, 5)
    assert slot_list(slots) == [4, 5, 6, 7, 8]
    assert m.length(0) == 5 and m.slots_in_use() == 8
    assert m.pages_needed_to_append(0) == 0
    assert [m.append(0) for _ in range(3)] == [9, 10, 11]
    assert m.pages_needed_to_append(0) == 1
    assert m.append(0) == 12  # new page 3
    assert slot_list(m.slots(0)) == list(range(4, 13))
    assert m.slots_in_use() == 12
    assert m.table[0].tolist() == list(range(4, 16))  # the last page's reserved slots follow
    assert m.lengths[0].item() == 9
    assert slot_list(m.shrink(0, 4)) == list(range(8, 16))
    assert m.table[0].tolist() == [4, 5, 6, 7] + [0] * 8
    assert m.slots_in_use() == 4
    assert m.release(0) == 4
    assert m.slots_in_use() == 0 and m.table[0].tolist() == [0] * 12 and m.lengths[0].item() == 0


def test_shrink_keeps_partial_page():
    m = make_map()
    m.assign(1, 10)
    assert slot_list(m.shrink(1, 6)) == [12, 13, 14, 15]
    assert m.slots_in_use() == 8
    assert m.append(1) == 10 and m.append(1) == 11  # reuses the reserved rest of page 2


def test_misuse_raises():
    m = make_map()
    with pytest.raises(IndexMapError, match="outside"):
        m.assign(3, 1)
    with pytest.raises(IndexMapError, match="holds no slots"):
        m.append(0)
    with pytest.raises(IndexMapError, match="holds no slots"):
        m.release(0)
    with pytest.raises(IndexMapError, match="must be in 0..10"):
        m.assign(0, 11)
    m.assign(0, 10)
    with pytest.raises(IndexMapError, match="already holds"):
        m.assign(0, 1)
    with pytest.raises(IndexMapError, match="evict before appending"):
        m.append(0)
    with pytest.raises(IndexMapError, match="must be in 0..10"):
        m.shrink(0, 11)
    m.release(0)
    with pytest.raises(IndexMapError, match="already released"):
        m.release(0)
    assert m.slots_in_use() == 0


def test_exhaustion_raises_and_changes_nothing():
    m = make_map(num_slots=8, page_size=4)
    m.assign(0, 4)
    m.assign(1, 4)
    with pytest.raises(SlotPoolExhausted):
        m.assign(2, 1)
    assert not m.is_active(2)
    with pytest.raises(SlotPoolExhausted):
        m.append_rows([0, 1])
    assert m.length(0) == 4 and m.length(1) == 4 and m.slots_in_use() == 8


def test_append_rows_batch():
    m = make_map(page_size=2)
    m.assign(0, 1)
    m.assign(2, 2)
    assert m.append_rows([2, 0]).tolist() == [6, 3]
    assert m.lengths.tolist() == [2, 0, 3]
    with pytest.raises(IndexMapError, match="twice"):
        m.append_rows([0, 0])


def test_assign_zero_then_append():
    m = make_map()
    assert m.assign(0, 0).numel() == 0 and m.slots_in_use() == 0
    assert m.append(0) == 4
    assert m.active_rows() == [0]


# ---- SparseIndexMaps -------------------------------------------------------------------------


def test_sparse_index_maps_build_and_release():
    resolved = SparsityConfig(full_layers=(0,), budget=(40, 48), sink=4, window=8, evict_page=8).resolve(3, 1000)
    maps = SparseIndexMaps.build(resolved, {1: 64, 2: 64}, max_requests=2, page_size=8)
    assert maps.layers == (1, 2) and 0 not in maps
    assert maps[1].max_entries == 48 and maps[2].max_entries == 56
    maps[1].assign(0, 40)
    maps[2].assign(0, 41)
    assert maps.slots_in_use() == {1: 40, 2: 48}
    assert maps.slots_total() == {1: 64, 2: 64}
    assert maps.release(0) == 88
    assert maps.slots_in_use() == {1: 0, 2: 0}
    with pytest.raises(IndexMapError, match="double release"):
        maps.release(0)
    maps[2].assign(1, 3)  # aborted before layer 1 was filled: release skips it
    assert maps.release(1) == 8
    with pytest.raises(ValueError, match="no pool size"):
        SparseIndexMaps.build(resolved, {1: 64}, max_requests=2)


# ---- random sequences keep every slot accounted for --------------------------------------------

LAYERS = {3: (2, 24, 9), 5: (4, 32, 12), 7: (1, 10, 6)}  # layer: (page_size, num_slots, max_entries)
ROWS = 4


class IndexMapMachine(RuleBasedStateMachine):
    """Random assign/append/evict(shrink)/release across rows and layers vs. a plain model."""

    def __init__(self):
        super().__init__()
        self.maps = SparseIndexMaps(
            {layer: LayerIndexMap(SlotPool(slots, page), ROWS, entries) for layer, (page, slots, entries) in LAYERS.items()}
        )
        self.model: dict[tuple[int, int], int] = {}  # (layer, row) -> length, for active rows

    def pages_free(self, layer: int) -> int:
        return self.maps[layer].pool.available_pages()

    @rule(layer=st.sampled_from(sorted(LAYERS)), row=st.integers(0, ROWS - 1), n=st.integers(0, 12))
    def assign(self, layer, row, n):
        m = self.maps[layer]
        if (layer, row) in self.model or n > m.max_entries:
            with pytest.raises(IndexMapError):
                m.assign(row, n)
        elif round_up(n, m.page_size) // m.page_size > self.pages_free(layer):
            with pytest.raises(SlotPoolExhausted):
                m.assign(row, n)
        else:
            assert m.assign(row, n).numel() == n
            self.model[(layer, row)] = n

    @rule(layer=st.sampled_from(sorted(LAYERS)), rows=st.sets(st.integers(0, ROWS - 1), min_size=1))
    def append(self, layer, rows):
        m = self.maps[layer]
        rows = sorted(rows)
        lengths = [self.model.get((layer, row)) for row in rows]
        if None in lengths or any(n >= m.max_entries for n in lengths):
            with pytest.raises(IndexMapError):
                m.append_rows(rows)
            return
        need = sum(1 for n in lengths if n % m.page_size == 0)
        if need > self.pages_free(layer):
            with pytest.raises(SlotPoolExhausted):
                m.append_rows(rows)
            return
        slots = m.append_rows(rows)
        for row, slot in zip(rows, slots.tolist()):
            self.model[(layer, row)] += 1
            assert m.slots(row)[-1].item() == slot

    @precondition(lambda self: self.model)
    @rule(data=st.data())
    def evict(self, data):
        layer, row = data.draw(st.sampled_from(sorted(self.model)))
        new_len = data.draw(st.integers(0, self.model[(layer, row)]))
        before = self.maps[layer].slots(row)
        freed = self.maps[layer].shrink(row, new_len)
        assert torch.equal(self.maps[layer].slots(row), before[:new_len])  # survivors keep their slots
        assert not set(freed.tolist()) & set(before[:new_len].tolist())
        self.model[(layer, row)] = new_len

    @rule(row=st.integers(0, ROWS - 1))
    def release(self, row):
        held = [layer for (layer, r) in self.model if r == row]
        if not held:
            with pytest.raises(IndexMapError):
                self.maps.release(row)
            return
        self.maps.release(row)
        for layer in held:
            del self.model[(layer, row)]

    @invariant()
    def slots_are_conserved(self):
        for layer, (page, num_slots, _) in LAYERS.items():
            m = self.maps[layer]
            pool = m.pool
            free_pages = set(pool._free[: pool._top].tolist())
            assert len(free_pages) == pool._top  # no page on the free list twice
            owned: set[int] = set()
            for row in range(ROWS):
                length = self.model.get((layer, row))
                held = 0 if length is None else round_up(length, page)
                assert m.is_active(row) == (length is not None)
                assert m.lengths[row].item() == (length or 0)
                row_slots = m.table[row, :held].tolist()
                assert all(s == 0 for s in m.table[row, held:].tolist())
                pages = {s // page for s in row_slots}
                assert len(pages) * page == held  # whole pages only
                assert row_slots == [p * page + i for p in [s // page for s in row_slots[::page]] for i in range(page)]
                assert not owned & set(row_slots)  # no slot owned twice
                owned |= set(row_slots)
                assert not pages & free_pages  # nothing both owned and free
                assert 0 not in pages  # padding page never handed out
            assert len(owned) + pool.available_slots() == num_slots
            assert pool.slots_in_use() == len(owned)

    def teardown(self):
        for row in range(ROWS):
            if any(r == row for (_, r) in self.model):
                self.maps.release(row)
        assert all(n == 0 for n in self.maps.slots_in_use().values())


TestIndexMapMachine = IndexMapMachine.TestCase
TestIndexMapMachine.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
