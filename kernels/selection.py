"""Pooling of key scores and choice of the kept set per request and KV head (plain torch).

These are a handful of vectorised torch ops that run on the GPU as they are, so they have no
Triton twin. Pooling smooths scores over neighbouring keys so that selection keeps spans rather
than isolated tokens; it never mixes keys of different requests.
"""

from __future__ import annotations

from typing import Literal

import torch

from .common import keys_after_in_segment, positions_in_segment, segment_ids, segment_lengths


def pool_scores(
    scores: torch.Tensor,
    kv_indptr: torch.Tensor,
    kernel_size: int,
    kind: Literal["max", "avg"] = "max",
) -> torch.Tensor:
    """Sliding max or mean of ``scores`` [total_kv, H] along keys, within each request.

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
        return _window_max(scores, kv_indptr, radius, radius)
    return _pool_mean(scores, kv_indptr, radius)


def spread_scores(scores: torch.Tensor, kv_indptr: torch.Tensor, follow: int) -> torch.Tensor:
    """Each key's score raised to the best of the ``follow`` keys before it in its request.

    A key the selection keeps then brings the ``follow`` keys after it along: the rest of a
    many-token span (a number, a name) whose first token drew the attention. Returns a new tensor.
    """
    if follow < 0:
        raise ValueError(f"follow must be >= 0, got {follow}")
    return _window_max(scores, kv_indptr, follow, 0)


def peaks(
    scores: torch.Tensor, kv_indptr: torch.Tensor, count: int, radius: int, skip_first: int, skip_last: int
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
    total = scores.shape[0]
    if total == 0 or count == 0:
        return torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    seg = segment_ids(kv_indptr, total)
    inside = (positions_in_segment(kv_indptr, total) >= skip_first) & (
        keys_after_in_segment(kv_indptr, total) >= skip_last
    )
    peak = (scores == _window_max(scores, kv_indptr, radius, radius)) & inside[:, None]
    values = scores.float()
    ranked = torch.where(peak, values, float("-inf"))
    threshold = _best_peak(ranked, seg, kv_indptr) if count == 1 else _count_th_peak(ranked, seg, kv_indptr, count)
    return peak & (values >= threshold[seg])


def _best_peak(ranked: torch.Tensor, seg: torch.Tensor, kv_indptr: torch.Tensor) -> torch.Tensor:
    """[B, H]: each request's highest of ``ranked`` (-inf off its peaks): one scatter instead of
    `_count_th_peak`'s two sorts over every key (7 ms against 290 ms at 131,072 keys x 8 heads
    on this project's CPU)."""
    batch, heads = kv_indptr.numel() - 1, ranked.shape[1]
    lowest = torch.full((batch, heads), float("-inf"), dtype=ranked.dtype, device=ranked.device)
    return lowest.scatter_reduce(0, seg[:, None].expand(-1, heads), ranked, reduce="amax")


def _count_th_peak(ranked: torch.Tensor, seg: torch.Tensor, kv_indptr: torch.Tensor, count: int) -> torch.Tensor:
    """[B, H]: each request's ``count``-th highest of ``ranked`` (-inf off its peaks, and where it
    has fewer): peaks sorted by score, then stably by request, so each request's peaks lie in its
    own range of rows, best first."""
    total = ranked.shape[0]
    by_score = torch.sort(ranked, dim=0, descending=True, stable=True)
    by_request = torch.sort(seg[by_score.indices], dim=0, stable=True).indices
    best_first = torch.gather(by_score.values, 0, by_request)
    starts = kv_indptr[:-1].to(torch.int64)
    last = torch.maximum(starts, kv_indptr[1:].to(torch.int64) - 1)
    return best_first[torch.minimum(starts + count - 1, last).clamp(max=total - 1)]


def _window_max(scores: torch.Tensor, kv_indptr: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """Max of each key's score over the keys from ``before`` keys before it to ``after`` keys
    after it, clipped to its request: the max of a look-back and a look-ahead running max."""
    total = scores.shape[0]
    if total == 0 or before + after == 0:
        return scores.clone()
    pooled = _running_max(scores, positions_in_segment(kv_indptr, total), before, -1)
    if after:
        pooled = torch.maximum(pooled, _running_max(scores, keys_after_in_segment(kv_indptr, total), after, 1))
    return pooled


def _running_max(scores: torch.Tensor, room: torch.Tensor, width: int, direction: int) -> torch.Tensor:
    """Max over each key and the ``width`` keys beside it in ``direction`` (-1 before, +1 after),
    of which only ``room`` [total] exist in its request: O(log width) ops, not O(width) shifts.

    While m[i] covers ``span`` keys, m[i] = max(m[i], m[i + direction * step]) with step = span
    (the last time, the remainder up to width + 1) where ``room`` allows it; where it does not,
    m[i] already reaches the request's edge. Max is exact in any order, so the result is the
    plain sliding max to the bit.
    """
    pooled, span = scores, 1
    while span < width + 1:
        step = min(span, width + 1 - span)
        pooled = torch.where((room >= step)[:, None], torch.maximum(pooled, _shifted(pooled, direction * step)), pooled)
        span += step
    return pooled


def _shifted(x: torch.Tensor, shift: int) -> torch.Tensor:
    """Rows ``x[i + shift]`` where they exist, other rows of ``x`` elsewhere (callers mask those):
    two contiguous slices, which the CPU copies faster than it gathers rows by index."""
    if shift > 0:
        return torch.cat((x[shift:], x[-shift:]))
    return torch.cat((x[:-shift], x[:shift]))


def _pool_mean(scores: torch.Tensor, kv_indptr: torch.Tensor, radius: int) -> torch.Tensor:
    """Mean of each key's score and its in-request neighbours up to ``radius`` away: differences
    of one running sum (in float64), so the cost does not grow with ``radius``."""
    total = scores.shape[0]
    if radius == 0 or total == 0:
        return scores.clone()
    sums = torch.cat([scores.new_zeros((1, scores.shape[1]), dtype=torch.float64), scores.double().cumsum(0)])
    index = torch.arange(total, device=scores.device)
    first = index - positions_in_segment(kv_indptr, total).clamp(max=radius)
    last = index + keys_after_in_segment(kv_indptr, total).clamp(max=radius)
    count = (last - first + 1).to(torch.float64)[:, None]
    return ((sums[last + 1] - sums[first]) / count).to(scores.dtype)


def select_kept(
    scores: torch.Tensor,
    kv_indptr: torch.Tensor,
    budget: int | torch.Tensor,
    sink: int,
    window: int,
    max_len: int | None = None,
    budget_on_device: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions to keep per request and KV head: protected ones plus the best-scored rest.

    Args:
        scores: [total_kv, H_kv] (pooled) scores aligned with the requests' keys.
        kv_indptr: [B+1] request boundaries in ``scores``.
        budget: entries kept per request and head when the request is longer than its budget:
            one for every request, or each request's own ([B] int64, on the host).
        sink, window: the first ``sink`` and last ``window`` positions are always kept;
            ``sink + window`` must not exceed any budget.
        max_len: the longest request's length when the caller knows it (the decode step's
            eviction does); otherwise it is read from ``kv_indptr``, which waits on the device.
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
    total, heads = scores.shape
    lens = segment_lengths(kv_indptr)
    batch = lens.numel()
    if isinstance(budget, int):  # no host tensor: the decode step's eviction queues without a sync
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
    if max_len is None:
        max_len = int(lens.max().item()) if batch else 0
    keep = min(largest, max_len)
    if keep == 0:
        return torch.empty(batch, heads, 0, dtype=torch.int64, device=device), kept_lens
    seg = segment_ids(kv_indptr, total)
    pos = positions_in_segment(kv_indptr, total)
    length = lens[seg]
    own = budgets if isinstance(budgets, int) else budgets[seg]
    protected = (pos < sink) | (pos >= length - window) | (length <= own)
    # Rank: protected first (+inf), then by score; padding of short requests last (-inf).
    rank = torch.full((batch, max_len, heads), float("-inf"), dtype=torch.float32, device=device)
    rank[seg, pos] = torch.where(protected[:, None], float("inf"), scores.float())
    # A stable sort, not topk: of equal scores (pooling and `span` make many) the earliest
    # positions win whatever else is in the batch, where topk's choice depends on the batch.
    top = torch.sort(rank, dim=1, descending=True, stable=True).indices[:, :keep]  # [B, keep, H]
    top = torch.where(torch.arange(keep, device=device)[None, :, None] < kept_lens[:, None, None], top, max_len)
    kept = torch.sort(top, dim=1).values
    kept = torch.where(kept == max_len, -1, kept)
    return kept.transpose(1, 2).contiguous(), kept_lens


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
