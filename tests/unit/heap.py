"""A `HeapRows` test double and a `SparseState` built on it, for the unit tests.

`FreeList` is the heap as SGLang's allocator would hand it out (pages of `page_size` rows, ids
from 1), with the checks a test needs: a double free or a partial page raises, and
`cached`/`evict_cache` stand in for SGLang's radix tree (ids it holds, freed on demand).
"""

from __future__ import annotations

import torch

from sglang_kvsparse.config import SparsityConfig
from sglang_kvsparse.policies import SnapKVPolicy
from sglang_kvsparse.sparse_state import LaneBuffers, SparseState

H_KV, D = 2, 8


class FreeList:
    def __init__(self, rows: int, page_size: int = 1) -> None:
        assert rows % page_size == 0
        self.page_size = page_size
        self.rows = rows
        self.free = list(range(rows // page_size, 0, -1))  # page ids, low ids taken first
        self.in_use = torch.zeros(rows // page_size + 1, dtype=torch.bool)
        self.cached: list[torch.Tensor] = []  # "radix tree" entries: SGLang ids, oldest first
        self.on_free = None  # SGLang's free of its own ids reaches the state (as the allocator hook does)

    def take(self, rows: int) -> torch.Tensor | None:
        assert rows % self.page_size == 0
        pages = rows // self.page_size
        if pages > len(self.free):
            return None
        taken = torch.tensor([self.free.pop() for _ in range(pages)], dtype=torch.int64)
        assert not bool(self.in_use[taken].any())
        self.in_use[taken] = True
        return (taken[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def give(self, rows: torch.Tensor) -> None:
        rows = rows.reshape(-1).long()
        if rows.numel() == 0:
            return
        assert rows.numel() % self.page_size == 0, "partial page"
        pages = rows.view(-1, self.page_size)
        assert torch.equal(pages, pages[:, :1] + torch.arange(self.page_size)), "not whole pages"
        ids = pages[:, 0] // self.page_size
        assert bool(self.in_use[ids].all()) and ids.unique().numel() == ids.numel(), "double free"
        self.in_use[ids] = False
        self.free.extend(ids.tolist())

    def free_rows(self) -> int:
        return len(self.free) * self.page_size

    def sglang_alloc(self, tokens: int) -> torch.Tensor:
        """SGLang's own allocation of full-pool ids (no reclaim: tests make room themselves)."""
        rows = self.take(tokens)
        assert rows is not None, "heap exhausted"
        return rows

    def sglang_free(self, ids: torch.Tensor) -> None:
        self.give(ids)
        if self.on_free is not None:
            self.on_free(ids)

    def evict_cache(self, rows: int) -> None:
        while self.cached and self.free_rows() < rows:
            self.sglang_free(self.cached.pop(0))


def make_state(
    num_layers=4,
    full_layers=(0,),
    context=64,
    rows=256,
    page=1,
    max_requests=8,
    budget=None,
    window=2,
    evict_page=16,
    prefix_cache=False,
    pool_kernel=1,
) -> tuple[SparseState, FreeList]:
    """A state of `num_layers` layers (`full_layers` full, one lane per full layer) on a heap of
    `rows` rows. pool_kernel 1: no pooling, so no score ties."""
    config = SparsityConfig(
        full_layers=full_layers,
        budget=budget or context,
        sink=1,
        window=window,
        policy=SnapKVPolicy(pool_kernel=pool_kernel),
        evict_page=evict_page,
    )
    resolved = config.resolve(num_layers, context)
    heap = FreeList(rows, page)
    lanes = [
        LaneBuffers.over(torch.zeros(rows + page, H_KV, D), torch.zeros(rows + page, H_KV, D))
        for _ in range(max(len(full_layers), 1))
    ]
    state = SparseState(
        resolved, heap=heap, lanes=lanes, max_requests=max_requests, heap_rows=rows, prefix_cache=prefix_cache
    )
    heap.on_free = state.forget_full_ids
    return state, heap


def grow(state: SparseState, rows, lengths) -> None:
    state.alloc_to_lengths(req_pool_indices_cpu=torch.tensor(rows), target_seq_lens_cpu=torch.tensor(lengths))
