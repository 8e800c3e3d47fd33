"""Admission to the sparse pools for one scheduling round (no SGLang imports).

SGLang admits a new request when its full-pool tokens fit; a sparse server must also check the
sparse pools. Every request is charged, in every group of sparse layers, the pages it can hold at
most: min(final length, max_entries) entries, where the final length is its prompt plus its
max_new_tokens. Running requests are charged what they may still grow by, so a decode step never
finds a sparse pool empty: the sparse pools are never over-committed, and only SGLang's own full
pool can run short (then SGLang retracts, as in stock, and the retracted row's slots come back).
Pages the prefix store borrowed count as free, except those a request admitted in this round will
read (its matched prefix), which are pinned until the step is over.

A sparse server prefills each prompt in one piece (no chunked prefill), so a burst of requests
sharing a new system prompt would all miss the cache in one batch; stock SGLang's chunks let the
first one's prefix reach the cache before the others are prefilled. So a request that shares at
least `SHARED_PREFIX_WAIT_TOKENS` more tokens with a prompt admitted in this round than its own
cache hit waits one round (`should_wait`), and then hits that prompt's prefix.

`patches/admission.py` builds one `SparseAdmission` per SGLang `PrefillAdder` (one round) and asks
it before each candidate request.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from sglang_kvsparse.sparse_state import SparseState

#: Tokens a prompt admitted this round must add to a waiting request's cache hit for it to wait.
SHARED_PREFIX_WAIT_TOKENS = 256


class SparseAdmission:
    """Pages each sparse group can still promise to new requests in this round.

    A group's pages are its free ones plus the prefix store's evictable ones (the store gives
    them back on demand). A request that reuses a cached prefix also pins the prefix's store
    pages for this step, so those stop counting as evictable.
    """

    def __init__(self, state: SparseState, running: Iterable[tuple[int, int]]) -> None:
        """`running`: (row, final length) of every request that holds sparse slots now."""
        self.state = state
        state.begin_round()
        self.free_pages = [state.available_pages(group) for group in range(len(state.maps))]
        for row, final_len in running:
            growth = [
                max(need - held, 0)
                for need, held in zip(state.pages_to_hold(final_len), state.pages_held(row))
            ]
            self.free_pages = [free - g for free, g in zip(self.free_pages, growth)]
        self.admitted = 0
        self._prompts: list[Sequence[int]] = []  # token ids of the requests admitted this round

    def should_wait(self, token_ids: Sequence[int], prefix_len: int) -> bool:
        """Whether the request is better prefilled next round, when a prompt admitted in this
        one, sharing at least `SHARED_PREFIX_WAIT_TOKENS` more tokens with it than its cache hit,
        will be in the cache."""
        shared = prefix_len + SHARED_PREFIX_WAIT_TOKENS
        head = token_ids[:shared]
        return len(head) == shared and any(other[:shared] == head for other in self._prompts)

    def fits(self, final_len: int, prefix_ids: torch.Tensor | None = None) -> bool:
        """Whether a new request that may reach `final_len` tokens, reusing the cached prefix
        `prefix_ids` (SGLang's full-pool ids) if any, fits every sparse group."""
        return all(need <= free for need, free in zip(self._charge(final_len, prefix_ids), self.free_pages))

    def reserve(self, final_len: int, prefix_ids: torch.Tensor | None = None,
                token_ids: Sequence[int] = ()) -> None:
        """Charge an admitted request, pin its prefix and remember its prompt `token_ids` for
        `should_wait` (call only after `fits` said yes)."""
        charge = self._charge(final_len, prefix_ids)
        self.free_pages = [free - need for free, need in zip(self.free_pages, charge)]
        if prefix_ids is not None:
            self.state.pin_prefix(prefix_ids)
        self._prompts.append(token_ids)
        self.admitted += 1

    def _charge(self, final_len: int, prefix_ids: torch.Tensor | None) -> list[int]:
        rows = self.state.pages_to_hold(final_len)
        if prefix_ids is None:
            return rows
        return [r + p for r, p in zip(rows, self.state.prefix_pages_to_pin(prefix_ids))]
