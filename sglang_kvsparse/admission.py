"""What admission charges for the sparse layers, one scheduling round at a time (no SGLang).

SGLang admits a request when its full-pool tokens fit the pool, less what the running requests
may still decode. In the one KV heap its full-pool ids and the sparse entries draw from the same
rows, so SGLang's own budget does the whole check once it is told about the sparse entries
(`patches/admission.py`, `patches/allocator.py`):

* a new request is charged, on top of SGLang's charge, the most sparse rows it can hold at its
  own budget: `SparseState.rows_to_hold(final length, budget)`, final length = prompt + its
  (clipped) max_new_tokens, exactly as SGLang charges its full-pool tokens;
* a running request is charged what its sparse rows may still grow by, scaled by SGLang's
  `new_token_ratio` as SGLang scales its remaining tokens, so a request no longer than the budget
  (every layer keeps every token) is charged exactly what stock SGLang charges it;
* a request reusing a cached prefix pins the prefix's store blocks, which stop counting as free.

* a chunk before a prompt's last is charged the prefix-store rows its tokens take
  (`SparseState.prefill_charge`), and SGLang's cut is moved so that the last chunk holds the
  whole observation window (`window_safe_cut`).

A burst of requests sharing a new system prompt, prefilled in one batch, would all miss the cache.
So a request that shares at least `SHARED_PREFIX_WAIT_TOKENS` more tokens with a prompt admitted
in this round than its own cache hit waits one round (`should_wait`), and then hits that prompt's
prefix. (Stock SGLang gets part of that from its chunks when the shared prompt is longer than a
chunk; the wait also covers shorter ones.)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from sglang_kvsparse.sparse_state import SparseState

#: Tokens a prompt admitted this round must add to a waiting request's cache hit for it to wait.
SHARED_PREFIX_WAIT_TOKENS = 256


def running_growth(state: SparseState, running: Iterable[tuple[int, int, float]]) -> float:
    """Sparse rows the running requests (row, final length, SGLang's ratio for it) may still take."""
    return sum(
        ratio * max(state.row_rows_to_hold(row, final_len) - state.rows_held(row), 0)
        for row, final_len, ratio in running
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
    prefill's waiting tokens, `SparseState.prefill_guide_rows`)."""

    def __init__(self) -> None:
        self._prompts: list[Sequence[int]] = []
        self.transient_rows = 0

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
