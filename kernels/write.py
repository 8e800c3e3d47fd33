"""A decode step's new entries into their slots: K, V and first score in one launch.

Each request of a decode step appends one entry per sparse layer: its key and value go to the
entry's row of the layer's lane and its first score (its policy's `first_score` kind,
`first_scores.py`: zero for the attention-based ones) to the entry's score slot. As plain torch
that is four launches per layer or more (two K/V scatters, the first scores, a score scatter);
this kernel does it in one, which matters where the layers run eagerly (no captured graph) and
the host pays for every launch, and computes each entry's first score in registers by its own
kind, so that requests of different policies share one launch (and one captured graph). Into FP8
buffers the K/V are quantized on the way (divided by the layer's scales in float32, rounded to
nearest even), as SGLang's pool writes them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import FP8_DTYPES, Backend, interpreting, quantize, use_triton
from .first_scores import HASH_MIX, FirstScore, first_score_index, first_scores, first_scores_by_row


@triton.jit
def _write_entries_kernel(
    K_buf,
    V_buf,
    S_buf,
    K_new,
    V_new,
    positions,
    kinds,
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
    stride_kind,
    heads,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KIND: tl.constexpr,  # index into FIRST_SCORES, or -1: each entry's own in `kinds`
    MIX: tl.constexpr,
):
    """Program (b, h): entry b's K/V of KV head h into row slots[b], its first score into
    score_slots[b]."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slots + b).to(tl.int64)
    score_slot = tl.load(score_slots + b).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k = tl.load(K_new + b * stride_kn + h * stride_khn + offs_d, mask=d_ok, other=0.0).to(tl.float32)
    tl.store(K_buf + slot * stride_kb + h * stride_kh + offs_d, (k / k_scale).to(K_buf.dtype.element_ty), mask=d_ok)
    v = tl.load(V_new + b * stride_vn + h * stride_vhn + offs_d, mask=d_ok).to(tl.float32) / v_scale
    tl.store(V_buf + slot * stride_vb + h * stride_vh + offs_d, v.to(V_buf.dtype.element_ty), mask=d_ok)
    if KIND < 0:
        kind = tl.load(kinds + b * stride_kind)
    else:
        kind = KIND
    position = tl.load(positions + b).to(tl.int64)
    x = (position * heads + h + 1) & 0xFFFFFFFF  # `position_hash`, in int64 as its reference
    x = (((x >> 16) ^ x) * MIX) & 0xFFFFFFFF
    x = (((x >> 16) ^ x) * MIX) & 0xFFFFFFFF
    x = (x >> 16) ^ x
    score = tl.where(kind == 1, -tl.sqrt(tl.sum(k * k, 0)), 0.0)
    score = tl.where(kind == 2, position.to(tl.float32), score)
    score = tl.where(kind == 3, x.to(tl.float32) / 4294967296.0, score)
    tl.store(S_buf + score_slot * stride_sb + h * stride_sh, score)


def _check(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    first_kinds: torch.Tensor | None,
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
    if positions.shape != (n,) or (first_kinds is not None and first_kinds.shape != (n,)):
        raise ValueError(f"positions and first_kinds must be [N={n}]")


def write_entries_triton(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    first_score: FirstScore = "zero",
    first_kinds: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Triton implementation; see :func:`write_entries` for the contract."""
    _check(k_buf, v_buf, score_buf, slots, score_slots, k, v, positions, first_kinds)
    kind = first_score_index(first_score) if first_kinds is None else -1
    n, heads, head_dim = k.shape
    if n == 0:
        return
    real_k = k
    if interpreting() and k_buf.dtype in FP8_DTYPES:
        # The interpreter's float32 -> FP8 cast is not round-to-nearest (subnormals, some e5m2
        # exponents): quantize as the reference does; the kernel then copies the FP8 values exactly.
        k, v, k_scale, v_scale = quantize(k, k_buf.dtype, k_scale), quantize(v, v_buf.dtype, v_scale), 1.0, 1.0
    kinds = first_kinds if first_kinds is not None else slots  # a valid pointer the kernel never reads
    _write_entries_kernel[(n, heads)](
        k_buf,
        v_buf,
        score_buf,
        k,
        v,
        positions,
        kinds,
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
        kinds.stride(0),
        heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        KIND=kind,
        MIX=HASH_MIX,
        num_warps=1,
    )
    if real_k is not k:  # the kernel saw the quantized keys: the real keys' first scores, as the reference
        score_buf[score_slots] = _first_scores(real_k, positions, first_score, first_kinds)


def write_entries_torch(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    first_score: FirstScore = "zero",
    first_kinds: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Plain-torch reference."""
    _check(k_buf, v_buf, score_buf, slots, score_slots, k, v, positions, first_kinds)
    k_buf[slots] = quantize(k, k_buf.dtype, k_scale)
    v_buf[slots] = quantize(v, v_buf.dtype, v_scale)
    score_buf[score_slots] = _first_scores(k, positions, first_score, first_kinds)


def _first_scores(
    k: torch.Tensor, positions: torch.Tensor, first_score: FirstScore, first_kinds: torch.Tensor | None
) -> torch.Tensor:
    """[N, H_kv] the entries' first scores: each by its own kind, or all by `first_score`."""
    if first_kinds is not None:
        return first_scores_by_row(first_kinds, k, positions)
    return first_scores(first_score, k, positions)


def write_entries(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    slots: torch.Tensor,
    score_slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    *,
    first_score: FirstScore = "zero",
    first_kinds: torch.Tensor | None = None,
    backend: Backend = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """In place, for every new entry b: k_buf[slots[b]] = k[b], v_buf[slots[b]] = v[b] (cast to
    the buffers' dtype: into FP8 divided by `k_scale` / `v_scale` first, `common.quantize`) and
    score_buf[score_slots[b]] = its first score (`first_scores.first_scores` of the real key k[b]
    at positions[b]).

    Args:
        k_buf, v_buf: [num_slots, H_kv, D]; score_buf: [num_score_slots, H_kv] float32.
        slots, score_slots: [N] int distinct slots.
        k, v: [N, H_kv, D]; positions: [N] int, the entries' positions in their sequences.
        first_score: every entry's kind; first_kinds: [N] int32 (any stride), each entry's own
            kind as an index into `FIRST_SCORES` (overrides `first_score`).
        backend: "auto" (Triton on CUDA), "triton" or "torch".
    """
    impl = write_entries_triton if use_triton(backend, k_buf, v_buf, score_buf, slots, k) else write_entries_torch
    impl(k_buf, v_buf, score_buf, slots, score_slots, k, v, positions, first_score, first_kinds, k_scale, v_scale)
