"""Causal ragged extend (prefill) attention that also returns each query row's softmax LSE.

The LSE lets the window-scoring kernel turn any later logit into a probability with one
``exp(logit - lse)``: scores then come from the statistics attention already computed instead of a
second full softmax. Keys and values are read through ``kv_indices`` (slot ids of a request's keys in
sequence order), so the same kernel serves SGLang's ``req_to_token`` rows and per-layer sparse
tables. One program owns one KV head and packs the G query heads of that head for a block of query
tokens into one tile, so K/V are loaded once per group rather than once per query head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .common import (
    FP8_DTYPES,
    LOG2E,
    Backend,
    check_group,
    dot_precision,
    interpreting,
    upcast_dots,
    use_triton,
)


@dataclass(frozen=True)
class ExtendConfig:
    """Tile sizes. ``block_rows`` counts (query token, query head) rows: a program handles
    ``block_rows // G`` query tokens of all G heads of one KV head. Both must be powers of two >= 16."""

    block_rows: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 1


def default_extend_config(head_dim: int, dtype: torch.dtype, kv_dtype: torch.dtype) -> ExtendConfig:
    """Large tiles in the interpreter (its cost scales with program count x loop steps). On a
    GPU, tiles that compile for sm_90 without spilling (`bench/compile_check.py`): float32's IEEE
    dots run on the FMA units with every operand in registers, so they take small tiles; head dim
    256 halves the key block, and with FP8 K/V (dequantized in registers) the query block too."""
    if interpreting():
        return ExtendConfig(block_rows=128, block_n=128, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return ExtendConfig(block_rows=16, block_n=16, num_warps=4)
    if head_dim > 128:
        return ExtendConfig(block_rows=64 if kv_dtype in FP8_DTYPES else 128, block_n=32, num_warps=8)
    return ExtendConfig(block_rows=128, block_n=64, num_warps=4 if head_dim <= 64 else 8)


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q,
    K,
    V,
    kv_indices,
    kv_start,
    kv_len,
    n0,
    kv_head,
    pos,
    lower,
    qk_scale,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    offs_n,
    offs_d,
    d_ok,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """One online-softmax step over keys [n0, n0 + BLOCK_N); MASKED adds the causal/tail mask and
    each row's window (keys from `lower` on)."""
    n = n0 + offs_n
    if MASKED:
        n_ok = n < kv_len
        slot = tl.load(kv_indices + kv_start + n, mask=n_ok, other=0).to(tl.int64)
        kt = tl.load(
            K + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=n_ok[None, :] & d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            V + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask=n_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
    else:
        slot = tl.load(kv_indices + kv_start + n).to(tl.int64)
        kt = tl.load(
            K + slot[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None],
            mask=d_ok[:, None],
            other=0.0,
        )
        v = tl.load(
            V + slot[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
            mask=d_ok[None, :],
            other=0.0,
        )
    if UPCAST:
        kt = kt.to(tl.float32)
        v = v.to(tl.float32)
    kt = kt.to(q.dtype)  # FP8 K/V dequantized in registers (the scales are applied outside the dots)
    v = v.to(q.dtype)
    s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # the K scale folded in
    if MASKED:
        s = tl.where((n[None, :] <= pos[:, None]) & (n[None, :] >= lower[:, None]) & n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _extend_fwd_kernel(
    Q,
    K,
    V,
    Out,
    LSE,
    qo_indptr,
    kv_indptr,
    kv_indices,
    qk_scale,
    v_scale,
    window,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_lt,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    STORE_LSE: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    blk = tl.program_id(2)
    TOK: tl.constexpr = BLOCK_R // GROUP

    q_start = tl.load(qo_indptr + req)
    q_len = tl.load(qo_indptr + req + 1) - q_start
    if blk * TOK >= q_len:
        return
    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start

    offs_r = tl.arange(0, BLOCK_R)
    tok = blk * TOK + offs_r // GROUP
    head = kv_head * GROUP + offs_r % GROUP
    row_ok = (offs_r < TOK * GROUP) & (tok < q_len)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)

    row_t = (q_start + tok).to(tl.int64)
    q = tl.load(
        Q + row_t[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    # Causal position of each row inside the request's key sequence.
    pos = kv_len - q_len + tok

    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_R], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_R], dtype=tl.float32)

    first_pos = kv_len - q_len + blk * TOK
    last_pos = kv_len - q_len + tl.minimum(blk * TOK + TOK, q_len) - 1
    # With a window each row sees keys from `lower` to its own position; without, from 0.
    lower = tl.where(window > 0, pos - window + 1, 0)
    lo_start = (tl.maximum(tl.where(window > 0, first_pos - window + 1, 0), 0) // BLOCK_N) * BLOCK_N
    lo_full = tl.cdiv(tl.maximum(tl.where(window > 0, last_pos - window + 1, 0), 0), BLOCK_N) * BLOCK_N
    # Keys in [lo_full, the block's first position] are visible to every row: no mask needed.
    full_end = ((first_pos + 1) // BLOCK_N) * BLOCK_N
    for n0 in range(lo_start, tl.minimum(lo_full, full_end), BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, K, V, kv_indices, kv_start, kv_len, n0, kv_head, pos, lower, qk_scale,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_n, offs_d, d_ok,
            MASKED=True, UPCAST=UPCAST, PRECISION=PRECISION,
        )  # fmt: skip
    for n0 in range(lo_full, full_end, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, K, V, kv_indices, kv_start, kv_len, n0, kv_head, pos, lower, qk_scale,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_n, offs_d, d_ok,
            MASKED=False, UPCAST=UPCAST, PRECISION=PRECISION,
        )  # fmt: skip
    for n0 in range(full_end, last_pos + 1, BLOCK_N):
        acc, m_i, l_i = _attend_block(
            acc, m_i, l_i, q, K, V, kv_indices, kv_start, kv_len, n0, kv_head, pos, lower, qk_scale,
            stride_kt, stride_kh, stride_vt, stride_vh, offs_n, offs_d, d_ok,
            MASKED=True, UPCAST=UPCAST, PRECISION=PRECISION,
        )  # fmt: skip

    l_safe = tl.where(row_ok, l_i, 1.0)
    out = acc * (v_scale / l_safe)[:, None]
    tl.store(
        Out + row_t[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(Out.dtype.element_ty),
        mask=row_ok[:, None] & d_ok[None, :],
    )
    if STORE_LSE:
        lse = (m_i + tl.log2(l_safe)) * 0.6931471805599453
        tl.store(LSE + row_t * stride_lt + head * stride_lh, lse, mask=row_ok)


def _check_window(window: int) -> None:
    if window < 0:
        raise ValueError(f"window must be 0 (every key) or positive, got {window}")


def _outputs(
    q: torch.Tensor, with_stats: bool, out: torch.Tensor | None, lse_out: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Caller-provided buffers (the server's, or NaN-poisoned ones in tests) or fresh ones."""
    o = torch.empty_like(q) if out is None else out
    if not with_stats:
        return o, None
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if lse_out is None else lse_out
    return o, lse


def extend_attention_with_stats_triton(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    *,
    with_stats: bool = True,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    config: ExtendConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton implementation; see :func:`extend_attention_with_stats` for the contract."""
    _check_window(window)
    group = check_group(q.shape[1], k_buf.shape[1])
    head_dim = q.shape[2]
    cfg = config or default_extend_config(head_dim, q.dtype, k_buf.dtype)
    if cfg.block_rows < group:
        raise ValueError(f"block_rows={cfg.block_rows} is smaller than the GQA group {group}")
    o, lse = _outputs(q, with_stats, out, lse_out)
    batch = qo_indptr.numel() - 1
    if max_q_len is None:
        max_q_len = int((qo_indptr[1:] - qo_indptr[:-1]).max().item()) if batch else 0
    if batch == 0 or max_q_len == 0:
        return o, lse
    grid = (batch, k_buf.shape[1], triton.cdiv(max_q_len, cfg.block_rows // group))
    lse_arg = lse if lse is not None else o  # never written when STORE_LSE is False
    _extend_fwd_kernel[grid](
        q,
        k_buf,
        v_buf,
        o,
        lse_arg,
        qo_indptr,
        kv_indptr,
        kv_indices,
        sm_scale * LOG2E * k_scale,
        v_scale,
        window,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        o.stride(0),
        o.stride(1),
        lse.stride(0) if lse is not None else 0,
        lse.stride(1) if lse is not None else 0,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_R=cfg.block_rows,
        BLOCK_N=cfg.block_n,
        STORE_LSE=lse is not None,
        UPCAST=upcast_dots(q.dtype),
        PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return o, lse


def extend_attention_with_stats_torch(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    *,
    with_stats: bool = True,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    config: ExtendConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Plain-torch reference, one request at a time, computed in at least float32; on the CPU
    through PyTorch's flash attention (`_cpu_flash_attention`), elsewhere from the score matrix.

    ``max_q_len`` and ``config`` only steer the Triton launch and are accepted for signature parity.
    """
    del max_q_len, config
    _check_window(window)
    group = check_group(q.shape[1], k_buf.shape[1])
    o, lse = _outputs(q, with_stats, out, lse_out)
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    qo = qo_indptr.tolist()
    kv = kv_indptr.tolist()
    for b in range(len(qo) - 1):
        q_len, kv_len = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        if q_len == 0:
            continue
        # With a window, the keys before the first query's window are read by no query.
        first = max(kv_len - q_len - window + 1, 0) if window else 0
        slots = kv_indices[kv[b] + first : kv[b + 1]].long()
        k = k_buf[slots].to(acc_dtype)  # [L, H_kv, D]
        v = v_buf[slots].to(acc_dtype)
        qb = q[qo[b] : qo[b + 1]].to(acc_dtype)  # [T, H_q, D]
        pos = kv_len - q_len + torch.arange(q_len, device=q.device)
        keys = torch.arange(first, kv_len, device=q.device)[None, :]
        visible = keys <= pos[:, None]  # [T, L]
        if window:
            visible &= keys > pos[:, None] - window
        if q.device.type == "cpu":
            plain_causal = q_len == kv_len and not 0 < window < kv_len  # no prefix, no window cut
            ob, row_lse = _cpu_flash_attention(qb, k, v, None if plain_causal else visible, sm_scale * k_scale, group)
        else:
            ob, row_lse = _explicit_attention(qb, k, v, visible, sm_scale * k_scale, group)
        o[qo[b] : qo[b + 1]] = (ob if v_scale == 1.0 else ob * v_scale).to(o.dtype)
        if lse is not None:
            lse[qo[b] : qo[b + 1]] = row_lse.to(lse.dtype)
    return o, lse


def _explicit_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor, sm_scale: float, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention from the full score matrix: q [T, H_q, D], k/v [L, H_kv, D], visible
    [T, L]; returns o [T, H_q, D] and lse [T, H_q]."""
    qg = q.unflatten(1, (k.shape[1], group))  # [T, H_kv, G, D]
    logits = torch.einsum("thgd,nhd->hgtn", qg, k) * sm_scale
    logits = logits.masked_fill(~visible, float("-inf"))
    row_lse = torch.logsumexp(logits, dim=-1)  # [H_kv, G, T]
    probs = torch.exp(logits - row_lse[..., None])
    o = torch.einsum("hgtn,nhd->thgd", probs, v).flatten(1, 2)
    return o, row_lse.permute(2, 0, 1).flatten(1, 2)


def _cpu_flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor | None, sm_scale: float, group: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_explicit_attention` through PyTorch's tiled CPU flash attention, which also returns the
    LSE: the same numbers (tests hold both to float64 attention) without the [H, T, L] score
    matrix, so a sparse server's prefill on the CPU costs about what stock SDPA costs. `visible`
    None: plain causal attention over a square (the kernel's own causal path, no mask built)."""
    qh = q.transpose(0, 1)[None]  # [1, H_q, T, D]
    kh = k.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    vh = v.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    causal = visible is None
    mask = (
        None
        if causal
        else torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
    )
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        qh, kh, vh, 0.0, causal, attn_mask=mask, scale=sm_scale
    )
    return o[0].transpose(0, 1), lse[0].transpose(0, 1)


def extend_attention_with_stats(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float,
    *,
    with_stats: bool = True,
    max_q_len: int | None = None,
    out: torch.Tensor | None = None,
    lse_out: torch.Tensor | None = None,
    config: ExtendConfig | None = None,
    backend: Backend = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Causal attention of a ragged batch of new query tokens over their requests' pooled keys.

    Args:
        q: [num_q_tokens, H_q, D], fp16/bf16/fp32; H_q = G * H_kv, query head h reads KV head h // G.
        k_buf, v_buf: [num_slots, H_kv, D] pool buffers of one layer (new tokens already written),
            in q's dtype or FP8 (dequantized in registers: keys times `k_scale`, values times
            `v_scale`, as the layer's pool scales them).
        qo_indptr: int32 [B+1]; request b's queries are q[qo_indptr[b]:qo_indptr[b+1]].
        kv_indptr: int32 [B+1]; kv_indices: int32/int64 slot ids of each request's keys in order.
        sm_scale: logit scale (usually D ** -0.5).
        with_stats: also return the LSE; False lets benchmarks time the plain kernel.
        max_q_len: largest query count per request, if the caller knows it (avoids a device sync).
        out, lse_out: optional output buffers.
        config: Triton tile sizes; ``backend``: "auto" (Triton on CUDA), "triton" or "torch".
        window: with W > 0 each query sees only the last W keys up to its own position (a sliding
            window, its own key included: keys position - W + 1 .. position, as Gemma 3's window
            layers attend); 0 for every key.

    Returns:
        ``(o, lse)``: o [num_q_tokens, H_q, D] in q's dtype; lse [num_q_tokens, H_q] float32, the
        natural-log log-sum-exp of the scaled logits (None when ``with_stats`` is False). The i-th
        new query of request b sits at position kv_len_b - q_len_b + i and sees keys 0..position.
    """
    impl = (
        extend_attention_with_stats_triton
        if use_triton(backend, q, k_buf, v_buf, kv_indices)
        else extend_attention_with_stats_torch
    )
    return impl(
        q,
        k_buf,
        v_buf,
        qo_indptr,
        kv_indptr,
        kv_indices,
        sm_scale,
        with_stats=with_stats,
        max_q_len=max_q_len,
        out=out,
        lse_out=lse_out,
        config=config,
        k_scale=k_scale,
        v_scale=v_scale,
        window=window,
    )
