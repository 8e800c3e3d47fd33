"""A decode step's new entries into their slots: K, V and first score in one launch.

Each request of a decode step appends one entry per sparse layer: its key and value go to the
entry's row of the layer's lane and its first score (the policy's `new_key_scores`, zero for the
attention-based ones) to the entry's score slot. As plain torch that is four launches per layer
(two K/V scatters, a zero fill and a score scatter); this kernel does it in one, which matters
where the layers run eagerly (no captured graph) and the host pays for every launch. Into FP8
buffers the K/V are quantized on the way (divided by the layer's scales in float32, rounded to
nearest even), as SGLang's pool writes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP8_DTYPES, Backend, interpreting, quantize, use_triton


@triton.jit
def _write_entries_kernel(
    K_buf,
    V_buf,
    S_buf,
    K_new,
    V_new,
    S_new,
    slots,
    score_slots,
    k_scale,
    v_scale,
    stride_kb,
    stride_kh,
    stride_vb,
    stride_vh,
    stride_sb,
    stride_sh,
    stride_kn,
    stride_khn,
    stride_vn,
    stride_vhn,
    stride_sn,
    stride_shn,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_SCORES: tl.constexpr,
):
    """Program (b, h): entry b's K/V of KV head h into row slots[b], its score into score_slots[b]."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + b).to(tl.int64)
    score_slot = tl.load(score_slots + b).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k = tl.load(K_new + b * stride_kn + h * stride_khn + offs_d, mask=d_ok).to(tl.float32) / k_scale
    tl.store(K_buf + slot * stride_kb + h * stride_kh + offs_d, k.to(K_buf.dtype.element_ty), mask=d_ok)
    v = tl.load(V_new + b * stride_vn + h * stride_vhn + offs_d, mask=d_ok).to(tl.float32) / v_scale
    tl.store(V_buf + slot * stride_vb + h * stride_vh + offs_d, v.to(V_buf.dtype.element_ty), mask=d_ok)
    if HAS_SCORES:
        score = tl.load(S_new + b * stride_sn + h * stride_shn)
    else:
        score = 0.0
    tl.store(S_buf + score_slot * stride_sb + h * stride_sh, score)


def _check(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scores: torch.Tensor | None,
) -> None:
    """Shape checks that turn silent out-of-range writes into errors (no value is read)."""
    n, heads = slots.shape[0], k_buf.shape[1]
    if v_buf.shape != k_buf.shape or score_buf.dim() != 2 or score_buf.shape[1] != heads:
        raise ValueError("k_buf and v_buf must share [num_slots, H_kv, D]; score_buf is [num_score_slots, H_kv]")
    if slots.dim() != 1 or score_slots.shape != slots.shape:
        raise ValueError(
            f"slots and score_slots must both be [N], got {tuple(slots.shape)}, {tuple(score_slots.shape)}"
        )
    if k.shape != (n, heads, k_buf.shape[2]) or v.shape != k.shape:
        raise ValueError(f"k and v must be [N={n}, H_kv={heads}, D={k_buf.shape[2]}], got {tuple(k.shape)}")
    if scores is not None and scores.shape != (n, heads):
        raise ValueError(f"scores must be [N={n}, H_kv={heads}], got {tuple(scores.shape)}")


def write_entries_triton(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scores: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton implementation; see :func:`write_entries` for the contract."""
    _check(k_buf, v_buf, score_buf, slots, score_slots, k, v, scores)
    n, heads, head_dim = k.shape
    if n == 0:
        return
    if interpreting() and k_buf.dtype in FP8_DTYPES:
        # The interpreter's float32 -> FP8 cast is not round-to-nearest (subnormals, some e5m2
        # exponents): quantize as the reference does; the kernel then copies the FP8 values exactly.
        k, v, k_scale, v_scale = quantize(k, k_buf.dtype, k_scale), quantize(v, v_buf.dtype, v_scale), 1.0, 1.0
    given = scores if scores is not None else score_buf  # a valid pointer the kernel never reads
    _write_entries_kernel[(n, heads)](
        k_buf,
        v_buf,
        score_buf,
        k,
        v,
        given,
        slots,
        score_slots,
        k_scale,
        v_scale,
        k_buf.stride(0),
        k_buf.stride(1),
        v_buf.stride(0),
        v_buf.stride(1),
        score_buf.stride(0),
        score_buf.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        given.stride(0),
        given.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        HAS_SCORES=scores is not None,
        num_warps=1,
    )


def write_entries_torch(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scores: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain-torch reference."""
    _check(k_buf, v_buf, score_buf, slots, score_slots, k, v, scores)
    k_buf[slots] = quantize(k, k_buf.dtype, k_scale)
    v_buf[slots] = quantize(v, v_buf.dtype, v_scale)
    score_buf[score_slots] = 0.0 if scores is None else scores.to(score_buf.dtype)


def write_entries(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scores: torch.Tensor | None = None,
    *,
    backend: Backend = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """In place, for every new entry b: k_buf[slots[b]] = k[b], v_buf[slots[b]] = v[b] (cast to
    the buffers' dtype: into FP8 divided by `k_scale` / `v_scale` first, `common.quantize`) and
    score_buf[score_slots[b]] = scores[b] (zero when `scores` is None).

    Args:
        k_buf, v_buf: [num_slots, H_kv, D]; score_buf: [num_score_slots, H_kv] float32.
        slots, score_slots: [N] int distinct slots.
        k, v: [N, H_kv, D]; scores: [N, H_kv] or None.
        backend: "auto" (Triton on CUDA), "triton" or "torch".
    """
    impl = write_entries_triton if use_triton(backend, k_buf, v_buf, score_buf, slots, k) else write_entries_torch
    impl(k_buf, v_buf, score_buf, slots, score_slots, k, v, scores, k_scale=k_scale, v_scale=v_scale)
