"""Key importance from the observation window, reusing the prefill's softmax statistics.

For request b the window is its last ``min(window, q_len_b)`` new query tokens. The score of key j
for KV head h is the sum, over window queries that can see j and over the G query heads of h, of the
softmax probability ``exp(q.k * sm_scale - lse)``. Because the LSE is already known, one pass
suffices. Keys are
the outer loop (one program per request, key block and KV head) so each key's sum over queries is
a register-resident row sum that is stored once, with no atomics; only observed queries are read,
and query blocks that sit causally before the key block are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (
    LOG2E,
    Backend,
    check_group,
    dot_precision,
    interpreting,
    upcast_dots,
    use_triton,
)


@dataclass(frozen=True)
class WindowScoreConfig:
    """Tile sizes: ``block_n`` keys per program; ``block_rows`` (query token, head) rows per inner
    step, i.e. ``block_rows // G`` window queries. Powers of two >= 16."""

    block_n: int = 64
    block_rows: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_window_score_config(dtype: torch.dtype) -> WindowScoreConfig:
    """Large tiles in the interpreter, whose cost scales with program count x loop steps; on a
    GPU, float32's IEEE dots take small tiles to compile without spilling (`bench/compile_check.py`)."""
    if interpreting():
        return WindowScoreConfig(block_n=128, block_rows=128, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return WindowScoreConfig(block_n=16, block_rows=16)
    return WindowScoreConfig()


# Triton kernels may only read module globals that are constexpr.
LOG2E_C = tl.constexpr(LOG2E)


@triton.jit
def _window_scores_kernel(
    Q,
    K,
    LSE,
    S,
    qo_indptr,
    kv_indptr,
    kv_indices,
    window,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_lt,
    stride_lh,
    stride_st,
    stride_sh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    nblk = tl.program_id(1)
    kv_head = tl.program_id(2)
    TOK: tl.constexpr = BLOCK_R // GROUP

    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start
    n0 = nblk * BLOCK_N
    if n0 >= kv_len:
        return
    q_end = tl.load(qo_indptr + req + 1)
    q_len = q_end - tl.load(qo_indptr + req)
    observed = tl.minimum(window, q_len)
    first_pos = kv_len - observed  # causal position of the first observed query

    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < kv_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    slot = tl.load(kv_indices + kv_start + offs_n, mask=n_ok, other=0).to(tl.int64)
    k = tl.load(
        K + slot[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
        mask=n_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
    else:
        k = k.to(Q.dtype.element_ty)  # FP8 keys dequantized in registers (the scale is in qk_scale)

    offs_r = tl.arange(0, BLOCK_R)
    head = kv_head * GROUP + offs_r % GROUP
    r_ok = offs_r < TOK * GROUP
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    # Observed queries before index (n0 - first_pos) cannot see any key of this block.
    i_first = tl.maximum(n0 - first_pos, 0)
    for i0 in range((i_first // TOK) * TOK, observed, TOK):
        i = i0 + offs_r // GROUP
        row_ok = r_ok & (i < observed)
        row_t = (q_end - observed + i).to(tl.int64)
        qt = tl.load(
            Q + row_t[None, :] * stride_qt + head[None, :] * stride_qh + offs_d[:, None],
            mask=row_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            qt = qt.to(tl.float32)
        lse = tl.load(LSE + row_t * stride_lt + head * stride_lh, mask=row_ok, other=0.0)
        s = tl.dot(k, qt, input_precision=PRECISION) * qk_scale  # [BLOCK_N, BLOCK_R], log2 units
        visible = (offs_n[:, None] <= (first_pos + i)[None, :]) & row_ok[None, :]
        p = tl.where(visible, tl.exp2(s - lse[None, :] * LOG2E_C), 0.0)
        acc += tl.sum(p, 1)
    tl.store(S + (kv_start + offs_n) * stride_st + kv_head * stride_sh, acc, mask=n_ok)


def check_window(window: int) -> None:
    """ValueError unless window >= 1."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")


def _scores_out(kv_indices: torch.Tensor, num_kv_heads: int, out: torch.Tensor | None) -> torch.Tensor:
    """Caller-provided scores buffer (tests poison it) or a fresh one."""
    if out is not None:
        return out
    return torch.empty((kv_indices.numel(), num_kv_heads), dtype=torch.float32, device=kv_indices.device)


def window_scores_triton(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    lse: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    window: int,
    sm_scale: float,
    *,
    max_kv_len: int | None = None,
    out: torch.Tensor | None = None,
    config: WindowScoreConfig | None = None,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """Triton implementation; see :func:`window_scores` for the contract."""
    check_window(window)
    group = check_group(q.shape[1], k_buf.shape[1])
    cfg = config or default_window_score_config(q.dtype)
    if cfg.block_rows < group:
        raise ValueError(f"block_rows={cfg.block_rows} is smaller than the GQA group {group}")
    scores = _scores_out(kv_indices, k_buf.shape[1], out)
    batch = kv_indptr.numel() - 1
    if max_kv_len is None:
        max_kv_len = int((kv_indptr[1:] - kv_indptr[:-1]).max().item()) if batch else 0
    if batch == 0 or max_kv_len == 0:
        return scores
    head_dim = q.shape[2]
    grid = (batch, triton.cdiv(max_kv_len, cfg.block_n), k_buf.shape[1])
    _window_scores_kernel[grid](
        q,
        k_buf,
        lse,
        scores,
        qo_indptr,
        kv_indptr,
        kv_indices,
        window,
        sm_scale * LOG2E * k_scale,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        lse.stride(0),
        lse.stride(1),
        scores.stride(0),
        scores.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_N=cfg.block_n,
        BLOCK_R=cfg.block_rows,
        UPCAST=upcast_dots(q.dtype),
        PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return scores


#: Observed queries the torch reference takes at once.
REFERENCE_ROWS = 256


def window_scores_torch(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    lse: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    window: int,
    sm_scale: float,
    *,
    max_kv_len: int | None = None,
    out: torch.Tensor | None = None,
    config: WindowScoreConfig | None = None,
    k_scale: float = 1.0,
) -> torch.Tensor:
    """Plain-torch reference, one request and `REFERENCE_ROWS` observed queries at a time (so
    a policy that observes every query, H2O, holds [rows, heads, keys] at most), in at least
    float32.

    ``max_kv_len`` and ``config`` only steer the Triton launch and are accepted for signature parity.
    """
    del max_kv_len, config
    check_window(window)
    group = check_group(q.shape[1], k_buf.shape[1])
    scores = _scores_out(kv_indices, k_buf.shape[1], out)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    qo = qo_indptr.tolist()
    kv = kv_indptr.tolist()
    for b in range(len(qo) - 1):
        kv_len, q_len = kv[b + 1] - kv[b], qo[b + 1] - qo[b]
        observed = min(window, q_len)
        k = k_buf[kv_indices[kv[b] : kv[b + 1]].long()].to(acc_dtype)  # [L, H_kv, D]
        keys = torch.arange(kv_len, device=q.device)
        total = torch.zeros(k.shape[1], kv_len, dtype=acc_dtype, device=q.device)
        for first in range(0, observed, REFERENCE_ROWS):
            count = min(REFERENCE_ROWS, observed - first)
            rows = slice(qo[b + 1] - observed + first, qo[b + 1] - observed + first + count)
            qw = q[rows].to(acc_dtype).unflatten(1, (k.shape[1], group))  # [W, H_kv, G, D]
            lw = lse[rows].to(acc_dtype).unflatten(1, (k.shape[1], group))  # [W, H_kv, G]
            logits = torch.einsum("whgd,nhd->whgn", qw, k) * (sm_scale * k_scale) - lw[..., None]
            pos = kv_len - observed + first + torch.arange(count, device=q.device)
            hidden = (keys[None, :] > pos[:, None])[:, None, None, :]  # [W, 1, 1, L]: causally after the query
            total += torch.exp(logits.masked_fill(hidden, float("-inf"))).sum(dim=(0, 2))
        scores[kv[b] : kv[b + 1]] = total.T.to(scores.dtype)
    return scores


def window_scores(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    lse: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    window: int,
    sm_scale: float,
    *,
    max_kv_len: int | None = None,
    out: torch.Tensor | None = None,
    config: WindowScoreConfig | None = None,
    backend: Backend = "auto",
    k_scale: float = 1.0,
) -> torch.Tensor:
    """Score every key of every request by the attention its observation window paid to it.

    Args:
        q, k_buf, qo_indptr, kv_indptr, kv_indices, sm_scale, k_scale: as for extend attention.
        lse: [num_q_tokens, H_q] float32 natural-log LSE from :func:`extend_attention_with_stats`.
        window: observation window size alpha (>= 1); request b uses its last min(alpha, q_len_b)
            new queries.
        max_kv_len: longest key sequence, if the caller knows it (avoids a device sync).
        out: optional [total_kv, H_kv] float32 buffer; config: Triton tiles; backend: as usual.

    Returns:
        [total_kv, H_kv] float32, row t aligned with kv_indices[t]: the sum over window queries
        that can see the key and over the G query heads of its KV head of softmax probabilities.
    """
    impl = window_scores_triton if use_triton(backend, q, k_buf, lse, kv_indices) else window_scores_torch
    return impl(
        q,
        k_buf,
        lse,
        qo_indptr,
        kv_indptr,
        kv_indices,
        window,
        sm_scale,
        max_kv_len=max_kv_len,
        out=out,
        config=config,
        k_scale=k_scale,
    )
