"""The two interfaces between the sparse layers' state and SGLang, stated once (no SGLang imports).

`AuxCache` is what SGLang 0.5.23 expects of a per-request side table attached with
`ReqToTokenPool.attach_aux_cache` (MiniCPM's sparse attention is the in-tree precedent): SGLang
calls it on every allocation and release path, so the sparse layers' rows follow each request's
lifecycle without hooks of our own. `HeapRows` is what the state needs of the one KV heap: raw
access to SGLang's token allocator, which hands out every heap row (`patches/allocator.py`
implements it; the unit tests use a plain free list).
"""

from __future__ import annotations

from typing import Protocol

import torch


class AuxCache(Protocol):
    """A side table SGLang keeps in step with its requests (`ReqToTokenPool`, by request index)."""

    #: Tokens the scheduler may plan with (`ReqToTokenPool.schedulable_token_capacity`).
    dense_capacity: int

    def alloc_to_lengths(self, *, req_pool_indices_cpu: torch.Tensor, target_seq_lens_cpu: torch.Tensor) -> None:
        """Requests grow to the target lengths: a new one after its prefill's allocation, a running
        one by a decode token. Called after SGLang allocated their full-pool ids; if this
        raises, SGLang frees those ids and re-raises, so it must change nothing when it fails."""

    def free(self, req_idx: int) -> None:
        """The request at `req_idx` finished, was aborted or retracted: release what it holds."""

    def clear(self) -> None:
        """Every request is released (SGLang's flush, or its pools' clear)."""

    def reset_allocator(self) -> None:
        """SGLang reset its token allocator: nothing handed out before is held any more."""


class HeapRows(Protocol):
    """Raw rows of the KV heap: SGLang's token allocator, without the project's own hooks."""

    page_size: int
    #: Times `take` or `reserve` had to read free rows back from the device (a host wait).
    refills: int

    def take(self, rows: int) -> torch.Tensor | None:
        """`rows` (a multiple of the page size) free rows, page by page, as a host int64 tensor,
        or None if fewer are free."""

    def give(self, rows: torch.Tensor) -> None:
        """Return rows (whole pages, a host tensor) to the free list."""

    def free_rows(self) -> int:
        """Rows on the free list."""

    def reserve(self, rows: int) -> None:
        """Keep at least `rows` free rows where `take` hands them out without waiting on the
        device (called where the host may wait: a prefill's allocation)."""

    def evict_cache(self, rows: int) -> None:
        """Let SGLang's radix tree free cached tokens until `rows` are free or reclaimable (or it
        has nothing unlocked left); a no-op without a tree."""
