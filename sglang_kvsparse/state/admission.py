"""What admission charges for the sparse layers, one scheduling round at a time (no SGLang).

SGLang admits a request when its full-pool tokens fit the pool, less what the running requests
may still decode. In the one KV heap its full-pool ids and the sparse entries draw from the same
rows, so SGLang's own budget does the whole check once it is told about the sparse entries
(`patches/admission.py`, `patches/allocator.py`):

* a new request is charged, on top of SGLang's charge, the most sparse rows it can hold at its
  own budget: `rows_to_hold(state, final length, budget)`, final length = prompt + its
  (clipped) max_new_tokens, exactly as SGLang charges its full-pool tokens;
* a running request is charged what its sparse rows may still grow by, scaled by SGLang's
  `new_token_ratio` as SGLang scales its remaining tokens, so a request no longer than the budget
  (every layer keeps every token) is charged exactly what stock SGLang charges it;
* a request reusing a cached prefix pins the prefix's store blocks, which stop counting as free.

* a chunk before a prompt's last is charged the prefix-store rows its tokens take
  (`prefill_charge`), and SGLang's cut is moved so that the last chunk holds the
  whole observation window (`window_safe_cut`).

A burst of requests sharing a new system prompt, prefilled in one batch, would all miss the cache.
So a request that shares at least `SHARED_PREFIX_WAIT_TOKENS` more tokens with a prompt admitted
in this round than its own cache hit waits one round (`should_wait`), and then hits that prompt's
prefix. (Stock SGLang gets part of that from its chunks when the shared prompt is longer than a
chunk; the wait also covers shorter ones.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from sglang_kvsparse.config import ResolvedSparsity
    from sglang_kvsparse.state.layout import HeapLayout
    from sglang_kvsparse.state.prefix_store import PrefixStore
    from sglang_kvsparse.state.sparse_state import SparseState

#: Tokens a prompt admitted this round must add to a waiting request's cache hit for it to wait.
SHARED_PREFIX_WAIT_TOKENS = 256


def rows_to_hold(state: SparseState, final_len: int, budget: int = 0) -> int:
    """Most heap rows a request reaching `final_len` tokens holds in the sparse columns
    (`budget`: its own, `RequestSparsity.own_budget`; 0 for the groups')."""
    return sum(state.layout.sparse_rows(group.spec, final_len, budget) for group in state.groups)


def request_rows_to_hold(state: SparseState, req_idx: int, final_len: int) -> int:
    """`rows_to_hold` of the request at `req_idx`, at its own budget."""
    return rows_to_hold(state, final_len, int(state.requests.budget[req_idx]))


def prefill_peak_rows(state: SparseState, prompt_len: int, chunk_size: int | None, budget: int = 0) -> int:
    """Most heap rows a prompt's prefill holds: its SGLang ids and entries (`rows_held`) and
    what its prefill holds beyond them (`prefill_extra_rows`)."""
    guided = waits_for_guide(state.resolved, state.layout, prompt_len, budget)
    extra = prefill_extra_rows(state.layout, state.store, prompt_len, chunk_size, guided)
    return state.layout.rows_held(prompt_len, budget) + extra


def prefill_extra_rows(
    layout: HeapLayout, store: PrefixStore | None, prompt_len: int, chunk_size: int | None, guided: bool
) -> int:
    """Heap rows a prompt's prefill holds at its peak beyond the request's own: prefilled in
    chunks of `chunk_size` (with a prefix `store`), its earlier chunks in the store until the
    last chunk has read them, and, kept by the guide (`guided`), its last forward's tokens for
    the length of that forward (`guide_rows`): together at most one row per sparse layers'
    column and token, and in the sliding columns what they still read
    (`PrefixStore.chunked_rows`)."""
    if store is not None and chunk_size is not None and 0 < chunk_size < prompt_len:
        return store.chunked_rows(prompt_len, chunk_size)
    return layout.guide_rows(prompt_len) if guided else 0


def prefill_charge(
    state: SparseState, prefix_len: int, end: int, fill_len: int, final_len: int, budget: int = 0
) -> int:
    """Heap rows a prefill of tokens [prefix_len, end) of a request whose prefill reaches
    `fill_len` takes beyond SGLang's own ids: a chunk before the last stores its tokens in the
    prefix store (whole blocks), the last chunk (or the whole prompt) the request's entries
    (at its own `budget`, 0 for the groups') and, when it keeps by the guide, the rows its
    new tokens wait in until the guide has chosen (`guide_rows`, back after the forward)."""
    if end >= fill_len or state.store is None:
        return rows_to_hold(state, final_len, budget) + prefill_guide_rows(state, prefix_len, end, fill_len, budget)
    blocks = -(-(end - prefix_len) // state.page_size)
    return blocks * state.store.rows_per_block


def prefill_guide_rows(state: SparseState, prefix_len: int, end: int, fill_len: int, budget: int = 0) -> int:
    """Of `prefill_charge`, the rows a guided prefill's last forward (tokens [prefix_len, end)
    of a prefill reaching `fill_len`) takes only until it has been issued (`guide_rows`)."""
    if end < fill_len and state.store is not None:  # a chunk before the last: stored, not waiting
        return 0
    return (
        state.layout.guide_rows(end - prefix_len)
        if waits_for_guide(state.resolved, state.layout, fill_len, budget)
        else 0
    )


def waits_for_guide(resolved: ResolvedSparsity, layout: HeapLayout, seq_len: int, budget: int = 0) -> bool:
    """Whether a prefill reaching `seq_len` tokens at this `budget` (0: each group's) keeps by
    the guide in some group (`GroupSpec.guided`), so that its new tokens wait for it
    (`guide_rows`)."""
    lengths = torch.tensor([seq_len])
    for spec in layout.groups:
        guided = spec.guided(resolved, torch.tensor([budget]), lengths)
        if guided is not None and bool(guided.any()):
            return True
    return False


def rows_for_next_decode(state: SparseState, req_indices: list[int]) -> int:
    """Fresh heap rows the next decode step of these requests takes in the sparse columns (the
    rows an eviction frees come back only after the forward, so they are not netted)."""
    index = torch.tensor(req_indices, dtype=torch.int64)
    total = 0
    for group in state.groups:
        held = group.table.counts[index]
        kept = torch.where(held == state.max_entries(group, index), state.budgets(group, index), held)
        total += int((kept % state.page_size == 0).sum()) * group.columns * state.page_size
    return total


def decode_reserve(state: SparseState) -> int:
    """Heap rows the running requests may take in their coming decode steps before their own
    evictions give rows back: per group and request, the pages from what it holds up to the
    most it will hold (its `max_entries`, or its final length when shorter), and one more."""
    running = state.requests.running_requests()
    page = state.page_size
    total = 0
    for group in state.groups:
        holding = running[group.table.active[running]]
        final = state.requests.final_len[holding]
        final = torch.where(final == 0, state.resolved.context_len, final)
        most = torch.minimum(state.max_entries(group, holding), final)
        pages = (most + page - 1) // page - (group.table.counts[holding] + page - 1) // page
        total += int((pages.clamp(min=0) + 1).sum()) * page * group.columns
    return total


def running_growth(state: SparseState, running: Iterable[tuple[int, int, float]]) -> float:
    """Sparse rows the running requests (request index, final length, SGLang's ratio for it) may
    still take."""
    return sum(
        ratio * max(request_rows_to_hold(state, req_idx, final_len) - state.rows_held(req_idx), 0)
        for req_idx, final_len, ratio in running
    )


def window_safe_cut(chunk: int, remaining: int, window: int, page_size: int) -> int:
    """The length of a chunk cut from `remaining` prompt tokens (starting on a page edge) such
    that what is left is nothing or at least `window` tokens: `chunk` itself, or shorter, on a
    page edge; 0 when no cut works."""
    if chunk >= remaining or remaining - chunk >= window:
        return chunk
    return max(remaining - window, 0) // page_size * page_size


class AdmissionRound:
    """The prompts admitted in one scheduling round, for `should_wait`, and the heap rows their
    prefills hold only until their forward has been issued (`transient_rows`: a guided
    prefill's waiting tokens, `prefill_guide_rows`)."""

    def __init__(self) -> None:
        self._prompts: list[Sequence[int]] = []
        self.transient_rows = 0
        #: While SGLang decides on one request: the sparse rows its prefill takes, by the
        #: prefill's end (prefix + extend tokens); what the heap allocator adds to SGLang's charge.
        self.charge: Callable[[int], int] | None = None

    @contextmanager
    def charging(self, charge: Callable[[int], int]) -> Iterator[None]:
        """While SGLang decides on one request, `charge` (the sparse rows of its prefill, by the
        prefill's end) is what the heap allocator adds to SGLang's charge."""
        self.charge = charge
        try:
            yield
        finally:
            self.charge = None

    def should_wait(self, token_ids: Sequence[int], prefix_len: int) -> bool:
        """Whether the request is better prefilled next round, when a prompt admitted in this
        one, sharing at least `SHARED_PREFIX_WAIT_TOKENS` more tokens with it than its cache hit,
        will be in the cache."""
        shared = prefix_len + SHARED_PREFIX_WAIT_TOKENS
        head = token_ids[:shared]
        return len(head) == shared and any(other[:shared] == head for other in self._prompts)

    def admitted(self, token_ids: Sequence[int], transient_rows: int = 0) -> None:
        self._prompts.append(token_ids)
        self.transient_rows += transient_rows

    def short_for_now(self) -> bool:
        """Whether a request refused for memory this round may fit the next: rows this round's
        prefills hold come back once their forward has been issued. (SGLang marks the batch
        full after a refusal and admits nothing more until a running request leaves.)"""
        return self.transient_rows > 0
