"""Admission to the sparse pools for one scheduling round (no SGLang imports).

SGLang admits a new request when its full-pool tokens fit; a sparse server must also check the
sparse pools. Every request is charged, in every group of sparse layers, the pages it can hold at
most: min(final length, max_entries) entries, where the final length is its prompt plus its
max_new_tokens. Running requests are charged what they may still grow by, so a decode step never
finds a sparse pool empty: the sparse pools are never over-committed, and only SGLang's own full
pool can run short (then SGLang retracts, as in stock, and the retracted row's slots come back).

`patches/admission.py` builds one `SparseAdmission` per SGLang `PrefillAdder` (one round) and asks
it before each candidate request.
"""

from __future__ import annotations

from collections.abc import Iterable

from sglang_kvsparse.sparse_state import SparseState


class SparseAdmission:
    """Pages each sparse group can still promise to new requests in this round."""

    def __init__(self, state: SparseState, running: Iterable[tuple[int, int]]) -> None:
        """`running`: (row, final length) of every request that holds sparse slots now."""
        self.state = state
        self.free_pages = [index_map.pool.available_pages() for index_map in state.maps]
        for row, final_len in running:
            growth = [
                max(need - held, 0)
                for need, held in zip(state.pages_to_hold(final_len), state.pages_held(row))
            ]
            self.free_pages = [free - g for free, g in zip(self.free_pages, growth)]
        self.admitted = 0

    def fits(self, final_len: int) -> bool:
        """Whether a new request that may reach `final_len` tokens fits every sparse group."""
        return all(need <= free for need, free in zip(self.state.pages_to_hold(final_len), self.free_pages))

    def reserve(self, final_len: int) -> None:
        """Charge an admitted request (call only after `fits` said yes)."""
        self.free_pages = [free - need for free, need in zip(self.free_pages, self.state.pages_to_hold(final_len))]
        self.admitted += 1
