"""Radix-cache hits with sparse layers (SGLang 0.5.23): cap every match at what the prefix store
can serve.

SGLang's tree caches every token a request held, decoded ones included, but a sparse layer can
reuse only prompt tokens whose prefill K/V the prefix store still keeps
(`sglang_kvsparse.state.prefix_store`), and the prefill must keep the observation window's queries to
score as it would without the hit when it selects (`SparseState.reusable_prefix_len`). AROUND `match_kv_cache`
(the one place SGLang adopts a match as a request's prefix, for every scheduling policy): when the
tree matched more than that, match again with SGLang's own `max_prefix_len` limit, so the tree
splits its node there and the request's prefix, lock and `cached_tokens` are exactly what will be
reused. Full layers then recompute the few tokens past the cap, which keeps every layer's prefix
the same length. A fault while capping fails the request alone (`patches/faults.py`).

AROUND the tree's `insert` (`UnifiedRadixCache`, SGLang's default, and `RadixCache`; every
insert: a chunk's checkpoint, a finished request): where the tree already held some of the
inserted tokens under other ids, SGLang frees the inserted duplicates; their store entries move to
the tree's ids before they are forgotten (`ReleasedIds.adopting`, `ReleasedIds.adopt`). That
lets a conversation's turn k reuse turn k-1's whole prompt: the tree holds the previous answer
under its decode-time ids, which have no entries, and turn k-1's prefill computed the same tokens
under ids the insert frees.
"""

from __future__ import annotations

from typing import Any

from . import context, faults
from .admission import setting


def cap_match(
    original: Any,
    req: Any,
    tree_cache: Any,
    token_ids: Any = None,
    *,
    cow_mamba: bool = False,
    max_prefix_len: int | None = None,
) -> Any:
    """The AROUND hook: SGLang's match, shortened to the reusable prefix."""
    result = original(req, tree_cache, token_ids, cow_mamba=cow_mamba, max_prefix_len=max_prefix_len)
    if not req.prefix_len:
        return result
    usable = 0  # a request failed by a fault reuses nothing; it retires in the next round
    with faults.request_guard(req, "prefix match"):
        faults.inject("match", req)
        seq_len = len(req.origin_input_ids) + len(req.output_ids) if token_ids is None else len(token_ids)
        state = context.state()
        prefix = tree_cache.prefix_device_indices(req).to("cpu")
        usable = state.reusable_prefix_len(prefix, seq_len, setting(req).own_budget(state.resolved))
    if usable >= req.prefix_len:
        return result
    limit = usable if max_prefix_len is None else min(usable, max_prefix_len)
    return original(req, tree_cache, token_ids, cow_mamba=cow_mamba, max_prefix_len=limit)


def adopt_duplicates(original: Any, tree_cache: Any, params: Any) -> Any:
    """The AROUND hook on `RadixCache.insert`: SGLang's insert, then the adoption of the doc."""
    state = context.current()
    if state is None or state.released is None or params.value is None:
        return original(tree_cache, params)
    with state.released.adopting():
        result = original(tree_cache, params)
        start = getattr(params, "prev_prefix_len", 0) or 0  # below it the values are the tree's own
        if result.prefix_len > start and result.last_device_node is not None:
            theirs = tree_cache.path_device_indices(result.last_device_node)[start : result.prefix_len]
            state.released.adopt(params.value[start : result.prefix_len], theirs)
    return result
