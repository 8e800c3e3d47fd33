"""Paged decode attention that also accumulates each key's attention probability into a score.

One query token per request attends to all of its request's keys, read through ``kv_indices`` (a
layer's own index map, so sparse layers can keep different slots). Split-K: stage 1 gives each
(request, KV head, split) program a contiguous chunk of keys, handles all G query heads of the KV
head in one tile, and writes a partial output, its LSE and the raw logits to scratch. Stage 2, per
(request, KV head, split), merges the partial LSEs into the final LSE, turns its chunk's logits into
probabilities, sums them over the G heads and adds them to ``score_buf[slot, kv_head]``; the split-0
program also merges the partial outputs. Saving logits (4*G bytes per key) is cheaper than reading
K again (2*D bytes per key) to recompute them once the final LSE is known. Every slot belongs to one
request and one split, so the score updates are plain read-add-write without atomics.
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
class DecodeConfig:
    """``block_n`` keys per step (power of two >= 16) and launch hints."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


def default_decode_config() -> DecodeConfig:
    """Large tiles in the interpreter, whose cost scales with program count x loop steps."""
    if interpreting():
        return DecodeConfig(block_n=128, num_warps=1, num_stages=1)
    return DecodeConfig()


@triton.jit
def _decode_partial_kernel(
    Q,
    K,
    V,
    MID_O,
    MID_LSE,
    LOGITS,
    kv_indptr,
    kv_indices,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_lgt,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start
    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)

    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    head = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = tl.arange(0, BLOCK_N)
    q = tl.load(
        Q + req * stride_qb + head[:, None] * stride_qh + offs_d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        n_ok = n < end
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
        if UPCAST:
            kt = kt.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # log2 units
        s = tl.where(n_ok[None, :], s, float("-inf"))
        tl.store(
            LOGITS + (kv_start + n)[None, :].to(tl.int64) * stride_lgt + head[:, None],
            s,
            mask=h_ok[:, None] & n_ok[None, :],
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    nonempty = l_i > 0.0
    part_o = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    part_lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    tl.store(
        MID_O + req * stride_mob + head[:, None] * stride_moh + split * stride_mos + offs_d[None, :],
        part_o,
        mask=h_ok[:, None] & d_ok[None, :],
    )
    tl.store(MID_LSE + req * stride_mlb + head * stride_mlh + split, part_lse, mask=h_ok)


@triton.jit
def _decode_finalize_kernel(
    Out,
    SCORES,
    MID_O,
    MID_LSE,
    LOGITS,
    kv_indptr,
    score_indices,
    stride_ob,
    stride_oh,
    stride_st,
    stride_sh,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_lgt,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_start = tl.load(kv_indptr + req)
    kv_len = tl.load(kv_indptr + req + 1) - kv_start
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    head = kv_head * GROUP + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    o_ptr = Out + req * stride_ob + head[:, None] * stride_oh + offs_d[None, :]
    if kv_len == 0:  # nothing to attend to: defined as a zero output
        if split == 0:
            tl.store(
                o_ptr, tl.zeros([BLOCK_H, BLOCK_D], dtype=Out.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :]
            )
        return

    offs_s = tl.arange(0, BLOCK_S)
    part_lse = tl.load(
        MID_LSE + req * stride_mlb + head[:, None] * stride_mlh + offs_s[None, :],
        mask=h_ok[:, None] & (offs_s < NUM_SPLITS)[None, :],
        other=float("-inf"),
    )
    # Padding heads get a finite LSE of 0 so that their masked logits give exp2(-inf) = 0.
    m = tl.where(h_ok, tl.max(part_lse, 1), 0.0)
    total = tl.where(h_ok, tl.sum(tl.exp2(part_lse - m[:, None]), 1), 1.0)
    lse = m + tl.log2(total)  # log2 units

    if split == 0:
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for s in range(NUM_SPLITS):
            s_lse = tl.load(MID_LSE + req * stride_mlb + head * stride_mlh + s, mask=h_ok, other=0.0)
            s_o = tl.load(
                MID_O + req * stride_mob + head[:, None] * stride_moh + s * stride_mos + offs_d[None, :],
                mask=h_ok[:, None] & d_ok[None, :],
                other=0.0,
            )
            acc += tl.exp2(s_lse - lse)[:, None] * s_o
        tl.store(o_ptr, acc.to(Out.dtype.element_ty), mask=h_ok[:, None] & d_ok[None, :])

    chunk = tl.cdiv(tl.cdiv(kv_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, kv_len)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        n_ok = n < end
        logits = tl.load(
            LOGITS + (kv_start + n)[None, :].to(tl.int64) * stride_lgt + head[:, None],
            mask=h_ok[:, None] & n_ok[None, :],
            other=float("-inf"),
        )
        prob = tl.sum(tl.exp2(logits - lse[:, None]), 0)
        slot = tl.load(score_indices + kv_start + n, mask=n_ok, other=0).to(tl.int64)
        ptr = SCORES + slot * stride_st + kv_head * stride_sh
        tl.store(ptr, tl.load(ptr, mask=n_ok, other=0.0) + prob, mask=n_ok)


def decode_attention_with_scores_triton(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    score_buf: torch.Tensor,
    sm_scale: float,
    *,
    score_indices: torch.Tensor | None = None,
    num_kv_splits: int = 8,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Triton implementation; see :func:`decode_attention_with_scores` for the contract."""
    if num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    group = check_group(q.shape[1], k_buf.shape[1])
    cfg = config or default_decode_config()
    batch, num_q_heads, head_dim = q.shape
    o = torch.empty_like(q) if out is None else out
    if batch == 0:
        return o
    dev = q.device
    mid_o = torch.empty((batch, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32, device=dev)
    mid_lse = torch.empty((batch, num_q_heads, num_kv_splits), dtype=torch.float32, device=dev)
    logits = torch.empty((kv_indices.numel(), num_q_heads), dtype=torch.float32, device=dev)
    grid = (batch, k_buf.shape[1], num_kv_splits)
    block_d = triton.next_power_of_2(head_dim)
    block_h = max(16, triton.next_power_of_2(group))  # tl.dot needs M >= 16 on NVIDIA
    _decode_partial_kernel[grid](
        q,
        k_buf,
        v_buf,
        mid_o,
        mid_lse,
        logits,
        kv_indptr,
        kv_indices,
        sm_scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        logits.stride(0),
        GROUP=group,
        NUM_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        BLOCK_N=cfg.block_n,
        UPCAST=upcast_dots(q.dtype),
        PRECISION=dot_precision(q.dtype),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    _decode_finalize_kernel[grid](
        o,
        score_buf,
        mid_o,
        mid_lse,
        logits,
        kv_indptr,
        kv_indices if score_indices is None else score_indices,
        o.stride(0),
        o.stride(1),
        score_buf.stride(0),
        score_buf.stride(1),
        mid_o.stride(0),
        mid_o.stride(1),
        mid_o.stride(2),
        mid_lse.stride(0),
        mid_lse.stride(1),
        logits.stride(0),
        GROUP=group,
        NUM_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_N=cfg.block_n,
        num_warps=cfg.num_warps,
    )
    return o


def decode_attention_with_scores_torch(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    score_buf: torch.Tensor,
    sm_scale: float,
    *,
    score_indices: torch.Tensor | None = None,
    num_kv_splits: int = 8,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
) -> torch.Tensor:
    """Plain-torch reference, one request at a time, in at least float32.

    ``num_kv_splits`` and ``config`` only shape the Triton launch and are accepted for signature
    parity (splitting does not change the result beyond rounding).
    """
    del num_kv_splits, config
    group = check_group(q.shape[1], k_buf.shape[1])
    o = torch.empty_like(q) if out is None else out
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    kv = kv_indptr.tolist()
    score_indices = kv_indices if score_indices is None else score_indices
    for b in range(q.shape[0]):
        slots = kv_indices[kv[b] : kv[b + 1]].long()
        if slots.numel() == 0:  # nothing to attend to: defined as a zero output
            o[b] = 0
            continue
        k = k_buf[slots].to(acc_dtype)  # [L, H_kv, D]
        v = v_buf[slots].to(acc_dtype)
        qb = q[b].to(acc_dtype).unflatten(0, (k.shape[1], group))  # [H_kv, G, D]
        logits = torch.einsum("hgd,nhd->hgn", qb, k) * sm_scale
        probs = torch.softmax(logits, dim=-1)
        o[b] = torch.einsum("hgn,nhd->hgd", probs, v).flatten(0, 1).to(o.dtype)
        score_slots = score_indices[kv[b] : kv[b + 1]].long()
        score_buf.index_add_(0, score_slots, probs.sum(dim=1).T.to(score_buf.dtype))
    return o


def decode_attention_with_scores(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    score_buf: torch.Tensor,
    sm_scale: float,
    *,
    score_indices: torch.Tensor | None = None,
    num_kv_splits: int = 8,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    backend: Backend = "auto",
) -> torch.Tensor:
    """One decode step of attention that also adds each key's probability into ``score_buf``.

    Args:
        q: [B, H_q, D], one query token per request; H_q = G * H_kv.
        k_buf, v_buf: [num_slots, H_kv, D] pool buffers of one layer.
        kv_indptr: int32 [B+1]; kv_indices: int32/int64 slots of each request's keys (no mask:
            every listed key is visible). Each slot must appear at most once in the batch.
        score_buf: [num_score_slots, H_kv] float32, updated in place: score_buf[s, h] += sum over
            the G query heads of KV head h of softmax(q.k * sm_scale)[key], where s is the key's
            entry in `score_indices` (aligned with kv_indices; default: kv_indices itself). Each
            score slot must appear at most once in the batch, except slots whose scores are never
            read (their sums are then undefined).
        sm_scale: logit scale; num_kv_splits: key chunks per request (split-K parallelism).
        out: optional [B, H_q, D] output; config: Triton tiles; backend: as usual.

    Returns:
        o [B, H_q, D] in q's dtype.
    """
    impl = (
        decode_attention_with_scores_triton
        if use_triton(backend, q, k_buf, v_buf, kv_indices, score_buf)
        else decode_attention_with_scores_torch
    )
    return impl(
        q,
        k_buf,
        v_buf,
        kv_indptr,
        kv_indices,
        score_buf,
        sm_scale,
        score_indices=score_indices,
        num_kv_splits=num_kv_splits,
        out=out,
        config=config,
    )
