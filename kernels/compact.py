"""Per-KV-head move of kept entries (K, V and score) into target slots.

Selection is per KV head, so entry j of KV head h comes from its own source slot ``src[j, h]``
while all heads of entry j land in one destination slot ``dst[j]``. Scores may live in a slot
space of their own (the heap keeps them apart from the K/V rows): then their source and
destination slots are given separately. Eviction compacts a request in
place, so sources and destinations may overlap; the result is defined as "gather every source
first, then scatter", which the Triton path realises by staging through a temporary (two launches
of one copy kernel) rather than relying on an ordering between programs, which Triton cannot give.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .common import Backend, use_triton


@triton.jit
def _copy_entries_kernel(
    K_src,
    V_src,
    S_src,
    K_dst,
    V_dst,
    S_dst,
    src_index,
    dst_index,
    score_src_index,
    score_dst_index,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_ss,
    stride_sh,
    stride_kd,
    stride_kdh,
    stride_vd,
    stride_vdh,
    stride_sd,
    stride_sdh,
    stride_src_j,
    stride_src_h,
    stride_dst_j,
    stride_dst_h,
    stride_ssrc_j,
    stride_ssrc_h,
    stride_sdst_j,
    stride_sdst_h,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dst[dst_index[j, h], h] = src[src_index[j, h], h] for K and V (rows of HEAD_DIM), and the
    same for the scores with their own indices."""
    j = tl.program_id(0)
    h = tl.program_id(1)
    src = tl.load(src_index + j * stride_src_j + h * stride_src_h).to(tl.int64)
    dst = tl.load(dst_index + j * stride_dst_j + h * stride_dst_h).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    k = tl.load(K_src + src * stride_ks + h * stride_kh + offs_d, mask=d_ok)
    tl.store(K_dst + dst * stride_kd + h * stride_kdh + offs_d, k, mask=d_ok)
    v = tl.load(V_src + src * stride_vs + h * stride_vh + offs_d, mask=d_ok)
    tl.store(V_dst + dst * stride_vd + h * stride_vdh + offs_d, v, mask=d_ok)
    s_src = tl.load(score_src_index + j * stride_ssrc_j + h * stride_ssrc_h).to(tl.int64)
    s_dst = tl.load(score_dst_index + j * stride_sdst_j + h * stride_sdst_h).to(tl.int64)
    tl.store(S_dst + s_dst * stride_sd + h * stride_sdh, tl.load(S_src + s_src * stride_ss + h * stride_sh))


def _check(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    score_src: torch.Tensor,
    score_dst: torch.Tensor,
) -> None:
    """Shape checks that turn silent out-of-range copies into errors."""
    heads = k_buf.shape[1]
    for name, src, dst in (("", src_slots, dst_slots), ("score_", score_src, score_dst)):
        if src.dim() != 2 or src.shape[1] != heads:
            raise ValueError(f"{name}src_slots must be [N, H_kv={heads}], got {tuple(src.shape)}")
        if dst.shape != (src_slots.shape[0],) or src.shape[0] != src_slots.shape[0]:
            raise ValueError(f"{name}dst_slots must be [N={src_slots.shape[0]}], got {tuple(dst.shape)}")
    if v_buf.shape != k_buf.shape or score_buf.dim() != 2 or score_buf.shape[1] != heads:
        raise ValueError("k_buf and v_buf must share [num_slots, H_kv, D]; score_buf is [num_score_slots, H_kv]")


def _launch_copy(
    src: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    dst: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    index: tuple[torch.Tensor, torch.Tensor],
    score_index: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """One launch of the copy kernel over [N, H_kv] entries: K/V by `index` (source, destination),
    scores by `score_index` (index tensors may be stride-0 views)."""
    (ks, vs, ss), (kd, vd, sd) = src, dst
    (src_index, dst_index), (score_src, score_dst) = index, score_index
    head_dim = ks.shape[2]
    _copy_entries_kernel[(src_index.shape[0], src_index.shape[1])](
        ks,
        vs,
        ss,
        kd,
        vd,
        sd,
        src_index,
        dst_index,
        score_src,
        score_dst,
        ks.stride(0),
        ks.stride(1),
        vs.stride(0),
        vs.stride(1),
        ss.stride(0),
        ss.stride(1),
        kd.stride(0),
        kd.stride(1),
        vd.stride(0),
        vd.stride(1),
        sd.stride(0),
        sd.stride(1),
        src_index.stride(0),
        src_index.stride(1),
        dst_index.stride(0),
        dst_index.stride(1),
        score_src.stride(0),
        score_src.stride(1),
        score_dst.stride(0),
        score_dst.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        num_warps=1,
    )


def compact_kv_triton(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    score_src: torch.Tensor | None = None,
    score_dst: torch.Tensor | None = None,
) -> None:
    """Triton implementation; see :func:`compact_kv` for the contract."""
    score_src = src_slots if score_src is None else score_src
    score_dst = dst_slots if score_dst is None else score_dst
    _check(k_buf, v_buf, score_buf, src_slots, dst_slots, score_src, score_dst)
    n, heads = src_slots.shape
    if n == 0:
        return
    head_dim = k_buf.shape[2]
    dev = k_buf.device
    stage = (
        torch.empty((n, heads, head_dim), dtype=k_buf.dtype, device=dev),
        torch.empty((n, heads, head_dim), dtype=v_buf.dtype, device=dev),
        torch.empty((n, heads), dtype=score_buf.dtype, device=dev),
    )
    rows = torch.arange(n, device=dev)[:, None].expand(n, heads)
    _launch_copy((k_buf, v_buf, score_buf), stage, (src_slots, rows), (score_src, rows))
    dst = dst_slots[:, None].expand(n, heads)
    _launch_copy(stage, (k_buf, v_buf, score_buf), (rows, dst), (rows, score_dst[:, None].expand(n, heads)))


def compact_kv_torch(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    score_src: torch.Tensor | None = None,
    score_dst: torch.Tensor | None = None,
) -> None:
    """Plain-torch reference: advanced indexing gathers everything before the scatter."""
    score_src = src_slots if score_src is None else score_src
    score_dst = dst_slots if score_dst is None else score_dst
    _check(k_buf, v_buf, score_buf, src_slots, dst_slots, score_src, score_dst)
    heads = torch.arange(k_buf.shape[1], device=k_buf.device)[None, :]
    src = src_slots.long()
    dst = dst_slots.long()
    k_buf[dst] = k_buf[src, heads]
    v_buf[dst] = v_buf[src, heads]
    score_buf[score_dst.long()] = score_buf[score_src.long(), heads]


def compact_kv(
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    score_buf: torch.Tensor,
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    *,
    score_src: torch.Tensor | None = None,
    score_dst: torch.Tensor | None = None,
    backend: Backend = "auto",
) -> None:
    """In place, for every entry j and KV head h: buf[dst_slots[j], h] = buf[src_slots[j, h], h]
    for buf in (k_buf, v_buf), and score_buf[score_dst[j], h] = score_buf[score_src[j, h], h], as
    if all sources were read before any write.

    Args:
        k_buf, v_buf: [num_slots, H_kv, D]; score_buf: [num_score_slots, H_kv] float32.
        src_slots: int64 [N, H_kv] source slot per entry and head.
        dst_slots: int64 [N] distinct destination slots (duplicates leave an arbitrary winner).
        score_src, score_dst: the scores' own slots, shaped as src_slots and dst_slots (default:
            the same slots as K and V).
        backend: "auto" (Triton on CUDA), "triton" or "torch".
    """
    impl = compact_kv_triton if use_triton(backend, k_buf, v_buf, score_buf, src_slots, dst_slots) else compact_kv_torch
    impl(k_buf, v_buf, score_buf, src_slots, dst_slots, score_src=score_src, score_dst=score_dst)
