"""Pooling of key scores and choice of the kept set per request and KV head (plain torch).

These are a handful of vectorised torch ops that run on the GPU as they are, so they have no
Triton twin. Pooling smooths scores over neighbouring keys so that selection keeps spans rather
than isolated tokens; it never mixes keys of different requests.
"""

from __future__ import annotations

from typing import Literal

import torch

from .common import Segments


def pool_scores(
    scores: torch.Tensor,
    keys: Segments,
    kernel_size: int,
    kind: Literal["max", "avg"] = "max",
) -> torch.Tensor:
    """Sliding max or mean of ``scores`` [total_kv, H] along keys, within each request of ``keys``.

    The window is centred (``kernel_size`` must be odd) and clipped at request boundaries: "avg"
    divides by the number of in-request neighbours, so edge keys are not penalised for padding.
    Returns a new tensor of the same shape and dtype.
    """
    if kernel_size < 1 or kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be a positive odd number, got {kernel_size}")
    if kind not in ("max", "avg"):
        raise ValueError(f"kind must be 'max' or 'avg', got {kind!r}")
    radius = kernel_size // 2
    if kind == "max":
        return _window_max(scores, keys, radius, radius)
    return _pool_mean(scores, keys, radius)


def spread_scores(scores: torch.Tensor, keys: Segments, follow: int) -> torch.Tensor:
    """Each key's score raised to the best of the ``follow`` keys before it in its request.

    A key the selection keeps then brings the ``follow`` keys after it along: the rest of a
    many-token span (a number, a name) whose first token drew the attention. Returns a new tensor.
    """
    if follow < 0:
        raise ValueError(f"follow must be >= 0, got {follow}")
    return _window_max(scores, keys, follow, 0)


def peaks(
    scores: torch.Tensor, keys: Segments, count: int, radius: int, skip_first: int, skip_last: int
) -> torch.Tensor:
    """[total_kv, H] bool: per request and head, the ``count`` best peaks (ties included).

    A peak is a key whose score is the largest within ``radius`` keys either side of it in its
    request, and that lies at least ``skip_first`` keys after the request's start and
    ``skip_last`` keys before its end. `span` gives its best peak a longer follow: the one key a
    question's attention lands on hardest usually precedes the answer, and a long answer (a UUID,
    29-37 tokens in SmolLM2's tokenizer) needs more than the follow every other key gets.
    """
    if count < 0 or radius < 0 or skip_first < 0 or skip_last < 0:
        raise ValueError(
            f"need count, radius, skip_first, skip_last >= 0; got {count}, {radius}, {skip_first}, {skip_last}"
        )
    if keys.total == 0 or count == 0:
        return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    padded = keys.to_dense(scores.float(), float("-inf"), radius, radius)  # [B, H, radius + L + radius]
    values = padded[..., radius : radius + keys.max_len]
    position = torch.arange(keys.max_len, device=scores.device)
    inside = (position >= skip_first) & (position < (keys.lengths - skip_last)[:, None])  # [B, L]
    peak = (values == _max_pool(padded, 2 * radius + 1)) & inside[:, None, :]
    ranked = torch.where(peak, values, float("-inf"))
    # The count-th best peak of each request and head (-inf where it has fewer).
    threshold = ranked.amax(-1, keepdim=True) if count == 1 else _kth_largest(ranked, count)
    return keys.from_dense(peak & (values >= threshold))


def _kth_largest(ranked: torch.Tensor, count: int) -> torch.Tensor:
    """[B, H, 1]: the ``count``-th largest of each row of ``ranked`` [B, H, L] (-inf if L < count)."""
    if count > ranked.shape[-1]:
        return ranked.new_full((*ranked.shape[:-1], 1), float("-inf"))
    return torch.topk(ranked, count, dim=-1).values[..., -1:]


def _window_max(scores: torch.Tensor, keys: Segments, before: int, after: int) -> torch.Tensor:
    """Max of each key's score over the keys from ``before`` keys before it to ``after`` keys
    after it, clipped to its request: a max pool over the requests laid out as rows padded with
    -inf, so its cost in launches does not grow with the window or the batch."""
    if keys.total == 0 or before + after == 0:
        return scores.clone()
    padded = keys.to_dense(scores, float("-inf"), before, after)
    return keys.from_dense(_max_pool(padded, before + after + 1))


def _max_pool(rows: torch.Tensor, width: int) -> torch.Tensor:
    """[B, H, n - width + 1]: the max of every ``width`` consecutive entries of ``rows`` [B, H, n]
    (exact: a max rounds nothing)."""
    return torch.nn.functional.max_pool1d(rows, width, stride=1)


def _pool_mean(scores: torch.Tensor, keys: Segments, radius: int) -> torch.Tensor:
    """Mean of each key's score and its in-request neighbours up to ``radius`` away: differences
    of one running sum (in float64), so the cost does not grow with ``radius``."""
    total = keys.total
    if radius == 0 or total == 0:
        return scores.clone()
    sums = torch.cat([scores.new_zeros((1, scores.shape[1]), dtype=torch.float64), scores.double().cumsum(0)])
    index = torch.arange(total, device=scores.device)
    first = index - keys.positions.clamp(max=radius)
    last = index + keys.after.clamp(max=radius)
    count = (last - first + 1).to(torch.float64)[:, None]
    return ((sums[last + 1] - sums[first]) / count).to(scores.dtype)


def select_kept(
    scores: torch.Tensor,
    keys: Segments,
    budget: int | torch.Tensor,
    sink: int,
    window: int,
    budget_on_device: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions to keep per request and KV head: protected ones plus the best-scored rest.

    Args:
        scores: [total_kv, H_kv] (pooled) scores aligned with the requests' keys.
        keys: the requests' boundaries in ``scores``.
        budget: entries kept per request and head when the request is longer than its budget:
            one for every request, or each request's own ([B] int64, on the host).
        sink, window: the first ``sink`` and last ``window`` positions are always kept;
            ``sink + window`` must not exceed any budget.
        budget_on_device: a tensor ``budget`` already on the scores' device (a copy the caller
            made without waiting); otherwise it is copied here, which waits.

    Returns:
        ``(kept, kept_lens)``: kept [B, H_kv, budget_eff] int64 positions (0-based within the
        request, ascending per head, padded with -1), budget_eff = min(largest budget, longest
        request); kept_lens [B] int64 = min(budget, length). A request no longer than its budget
        keeps all; of equal scores the earlier positions, so a request keeps the same alone or
        in any batch.
    """
    device = scores.device
    heads = scores.shape[1]
    batch, lens = keys.batch, keys.lengths
    if isinstance(budget, int):
        smallest = largest = budget
        budgets: int | torch.Tensor = budget
    else:
        if budget.numel() != batch:
            raise ValueError(f"{budget.numel()} budgets for {batch} requests")
        smallest, largest = (int(budget.min()), int(budget.max())) if batch else (1, 1)
        budgets = budget.to(device) if budget_on_device is None else budget_on_device
    if smallest < 1 or sink < 0 or window < 0:
        raise ValueError(f"need budget >= 1, sink >= 0, window >= 0; got {smallest}, {sink}, {window}")
    if sink + window > smallest:
        raise ValueError(f"sink ({sink}) + window ({window}) exceeds the budget ({smallest})")
    kept_lens = lens.clamp(max=budgets) if isinstance(budgets, int) else torch.minimum(lens, budgets)
    keep = min(largest, keys.max_len)
    if keep == 0:
        return torch.empty(batch, heads, 0, dtype=torch.int64, device=device), kept_lens
    pos, length = keys.positions, lens[keys.ids]
    own = budgets if isinstance(budgets, int) else budgets[keys.ids]
    protected = (pos < sink) | (pos >= length - window) | (length <= own)
    # Rank: protected first (+inf), then by score; padding of short requests last (-inf).
    rank = keys.to_dense(torch.where(protected[:, None], float("inf"), scores.float()), float("-inf"))  # [B, H, L]
    # A stable sort, not topk: of equal scores (pooling and `span` make many) the earliest
    # positions win whatever else is in the batch, where topk's choice depends on the batch.
    top = torch.sort(rank, dim=-1, descending=True, stable=True).indices[..., :keep]  # [B, H, keep]
    padding = keys.max_len
    top = torch.where(torch.arange(keep, device=device) < kept_lens[:, None, None], top, padding)
    kept = torch.sort(top, dim=-1).values
    return torch.where(kept == padding, -1, kept), kept_lens


def select_rows(scores: torch.Tensor, budget: int, sink: int, window: int) -> torch.Tensor:
    """Positions to keep in rows that all hold ``n`` entries (a decode eviction's rows, every layer
    and request of one budget at once): per row and KV head the first ``sink`` and last
    ``window`` positions, then the best-scored rest up to ``budget``, ascending; of equal scores
    the earlier positions, as `select_kept` keeps them.

    Args:
        scores: [R, n, H_kv] scores, n >= budget >= sink + window.

    Returns:
        kept [R, budget, H_kv] int64 positions within each row. A fixed number of ops whatever R,
        and no value is read back.
    """
    n = scores.shape[1]
    if sink < 0 or window < 0 or not sink + window <= budget <= n:
        raise ValueError(f"need 0 <= sink ({sink}) + window ({window}) <= budget ({budget}) <= row length ({n})")
    rank = scores.to(torch.float32, copy=True)
    if sink:  # protected: ranked first
        rank[:, :sink] = float("inf")
    if window:
        rank[:, n - window :] = float("inf")
    # A stable sort, as in `select_kept`: of equal scores the earliest positions win.
    top = torch.sort(rank, dim=1, descending=True, stable=True).indices[:, :budget]
    return torch.sort(top, dim=1).values
