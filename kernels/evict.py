"""A decode eviction in one launch per lane: select the kept entries and move them, in place.

A decode eviction cuts rows that hold ``n`` entries back to ``budget``: per row (a layer's
request) and KV head it keeps the first ``sink`` and last ``window`` positions and the best-ranked
rest, and moves the kept entries in position order into the row's first ``budget`` entries (K, V
and stored score). As plain torch that is a chain of sorts, gathers and scatters per lane; here one
program per (row, KV head) does all of it, so a step's eviction costs a launch per lane whatever
the numbers of layers, requests and heads.

Selection drops the ``n - budget`` lowest-ranked unprotected positions one at a time (of equal
ranks the latest goes first, so the earlier are kept, as the reference's stable sort keeps them):
``n - budget`` is the configuration's ``evict_page``, a handful of passes over a row held in
registers. The move walks the row in chunks from the first dropped position: a kept entry only
ever moves to an earlier position, and a barrier between a chunk's loads and its stores keeps
every source read before anything lands on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Backend, use_triton
from .selection import select_rows

#: Positions moved per pass of the move loop (K and V rows of HEAD_DIM each).
MOVE_CHUNK = 32
#: Dropped positions compared per pass when a chunk asks which of its positions were dropped.
DROP_CHUNK = 16


@triton.jit
def _evict_rows_kernel(
    K,
    V,
    S,
    ranked,
    slots,
    score_slots,
    dropped,
    n,
    drop,
    sink,
    window,
    requests,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ss,
    stride_sh,
    stride_rr,
    stride_rn,
    stride_rh,
    stride_tc,
    stride_tr,
    stride_tn,
    stride_uc,
    stride_ur,
    stride_un,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MOVE: tl.constexpr,
    DROPS: tl.constexpr,
):
    """Program (row, h): row = column * requests + request. Phase 1 writes the `drop` dropped
    positions to `dropped[row, h, :]`; phase 2 moves the kept entries down."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    heads = tl.num_programs(1)
    column = row // requests
    request = row % requests
    offs = tl.arange(0, BLOCK_N)
    valid = offs < n
    rank = tl.load(ranked + row * stride_rr + offs * stride_rn + h * stride_rh, mask=valid, other=0.0)
    rank = tl.where((offs < sink) | (offs >= n - window), float("inf"), rank.to(tl.float32))
    alive = valid
    own = dropped + (row * heads + h) * drop
    first = n
    for i in range(drop):
        low = tl.min(tl.where(alive, rank, float("inf")), axis=0)
        last = tl.max(tl.where(alive & (rank == low), offs, -1), axis=0)
        alive = alive & (offs != last)
        tl.store(own + i, last)
        first = tl.minimum(first, last)
    tl.debug_barrier()  # the dropped list is read back by every thread below

    table = slots + column * stride_tc + request * stride_tr
    score_table = score_slots + column * stride_uc + request * stride_ur
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    start = (first // MOVE) * MOVE
    placed = start  # kept positions before the chunk: every one below the first dropped
    for chunk in range(start, n, MOVE):
        pos = chunk + tl.arange(0, MOVE)
        inside = pos < n
        hit = tl.zeros([MOVE], dtype=tl.int32)
        for d0 in range(0, drop, DROPS):
            d = d0 + tl.arange(0, DROPS)
            gone = tl.load(own + d, mask=d < drop, other=-1)
            hit += tl.sum((pos[:, None] == gone[None, :]).to(tl.int32), axis=1)
        kept = inside & (hit == 0)
        dest = placed + tl.cumsum(kept.to(tl.int32), axis=0) - 1
        placed += tl.sum(kept.to(tl.int32), axis=0)
        move = kept & (dest != pos)
        src_slot = tl.load(table + pos * stride_tn, mask=move, other=0).to(tl.int64)
        dst_slot = tl.load(table + dest * stride_tn, mask=move, other=0).to(tl.int64)
        src_score = tl.load(score_table + pos * stride_un, mask=move, other=0).to(tl.int64)
        dst_score = tl.load(score_table + dest * stride_un, mask=move, other=0).to(tl.int64)
        both = move[:, None] & d_ok[None, :]
        k = tl.load(K + src_slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :], mask=both)
        v = tl.load(V + src_slot[:, None] * stride_vs + h * stride_vh + offs_d[None, :], mask=both)
        s = tl.load(S + src_score * stride_ss + h * stride_sh, mask=move)
        tl.debug_barrier()  # every source of the chunk read before any entry lands
        tl.store(K + dst_slot[:, None] * stride_ks + h * stride_kh + offs_d[None, :], k, mask=both)
        tl.store(V + dst_slot[:, None] * stride_vs + h * stride_vh + offs_d[None, :], v, mask=both)
        tl.store(S + dst_score * stride_ss + h * stride_sh, s, mask=move)
        tl.debug_barrier()  # landed before the next chunk reads


def _check(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    ranked: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    budget: int,
    sink: int,
    window: int,
) -> None:
    """Shape and range checks that turn silent out-of-range moves into errors."""
    heads = k_buf.shape[1]
    if v_buf.shape != k_buf.shape or score_buf.dim() != 2 or score_buf.shape[1] != heads:
        raise ValueError("k_buf and v_buf must share [num_slots, H_kv, D]; score_buf is [num_score_slots, H_kv]")
    if slots.dim() != 3 or score_slots.shape != slots.shape:
        raise ValueError(f"slots and score_slots must share [columns, N, n], got {tuple(slots.shape)}")
    columns, requests, n = slots.shape
    if ranked.shape != (columns * requests, n, heads):
        raise ValueError(
            f"ranked must be [columns * N = {columns * requests}, n = {n}, H_kv = {heads}], got {tuple(ranked.shape)}"
        )
    if sink < 0 or window < 0 or not sink + window <= budget <= n:
        raise ValueError(f"need 0 <= sink ({sink}) + window ({window}) <= budget ({budget}) <= row length ({n})")


def evict_rows_triton(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    ranked: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    budget: int,
    sink: int,
    window: int,
) -> None:
    """Triton implementation; see :func:`evict_rows` for the contract."""
    _check(k_buf, v_buf, score_buf, ranked, slots, score_slots, budget, sink, window)
    columns, requests, n = slots.shape
    heads, head_dim = k_buf.shape[1], k_buf.shape[2]
    drop = n - budget
    if drop == 0 or columns * requests == 0:
        return
    dropped = torch.empty((columns * requests, heads, drop), dtype=torch.int32, device=k_buf.device)
    block_n = triton.next_power_of_2(n)
    _evict_rows_kernel[(columns * requests, heads)](
        k_buf,
        v_buf,
        score_buf,
        ranked,
        slots,
        score_slots,
        dropped,
        n,
        drop,
        sink,
        window,
        requests,
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        score_buf.stride(0),
        score_buf.stride(1),
        ranked.stride(0),
        ranked.stride(1),
        ranked.stride(2),
        slots.stride(0),
        slots.stride(1),
        slots.stride(2),
        score_slots.stride(0),
        score_slots.stride(1),
        score_slots.stride(2),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=block_n,
        MOVE=MOVE_CHUNK,
        DROPS=DROP_CHUNK,
        num_warps=min(16, max(4, block_n // 512)),  # a row of a large budget spread over more threads
    )


def evict_rows_torch(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    ranked: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    budget: int,
    sink: int,
    window: int,
) -> None:
    """Plain-torch reference: `select_rows`, then a column at a time every kept entry gathered
    before any is written. A column's rows are its own, so this is the whole batch at once; it
    holds one column's kept K and V at a time, where all of a group's columns at once would hold
    every layer's (gigabytes at Llama-3.1-8B's KV shape with a dozen requests)."""
    _check(k_buf, v_buf, score_buf, ranked, slots, score_slots, budget, sink, window)
    columns, requests, n = slots.shape
    heads = k_buf.shape[1]
    if columns * requests == 0:
        return
    kept = select_rows(ranked, budget, sink, window).view(columns, requests, budget, heads)
    head = torch.arange(heads, device=k_buf.device)[None, :]

    def sources(table: torch.Tensor, column: int) -> torch.Tensor:
        rows = table[column, :, :, None].expand(requests, n, heads)
        return torch.gather(rows, 1, kept[column]).reshape(-1, heads).long()

    for column in range(columns):
        dst = slots[column, :, :budget].reshape(-1).long()
        src = sources(slots, column)
        k_buf[dst] = k_buf[src, head]
        v_buf[dst] = v_buf[src, head]
        score_dst = score_slots[column, :, :budget].reshape(-1).long()
        score_buf[score_dst] = score_buf[sources(score_slots, column), head]


def evict_rows(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    ranked: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    budget: int,
    sink: int,
    window: int,
    *,
    backend: Backend = "auto",
) -> None:
    """In place, per row (column c's request r, all `n` entries long) and KV head h: keep the
    first `sink` and last `window` positions and the best-ranked rest up to `budget` (of equal
    ranks the earlier, as `select_rows`), and move the kept entries in position order into the
    row's first `budget` entries: K and V of heap row `slots[c, r, j]` and the score at
    `score_slots[c, r, j]`, head h only. Entries past `budget` are left as they were.

    Args:
        k_buf, v_buf: [num_slots, H_kv, D]; score_buf: [num_score_slots, H_kv] float32.
        ranked: [columns * N, n, H_kv] ranks (the policy's `eviction_scores`), any strides.
        slots, score_slots: [columns, N, n] the rows' entries in position order, any strides,
            distinct across rows.
        budget, sink, window: as `select_rows`.
        backend: "auto" (Triton on CUDA), "triton" or "torch".
    """
    tensors = (k_buf, v_buf, score_buf, ranked, slots, score_slots)
    impl = evict_rows_triton if use_triton(backend, *tensors) else evict_rows_torch
    impl(k_buf, v_buf, score_buf, ranked, slots, score_slots, budget, sink, window)
