"""Paged decode attention that also updates each key's score with its attention probability.

One query token per request attends to all of its request's keys, read through its row of
``kv_indices`` (a layer's own index map, so sparse layers can keep different slots). The rows are
padded to one width and each request's length is in ``kv_lens``: that is the layout of a table the
scheduler keeps per request (a slice of it, gathered on the device, is a valid input), it has a
fixed shape for a captured CUDA graph, and nothing about it needs the host. Split-K: stage 1 gives each
(request, KV head, split) program a contiguous chunk of keys, handles all G query heads of the KV
head in one tile, and writes a partial output, its LSE and the raw logits to scratch. Stage 2, per
(request, KV head, split), merges the partial LSEs into the final LSE, turns its chunk's logits into
probabilities, sums them over the G heads and adds them to ``score_buf[slot, kv_head]`` (or
overwrites it, or leaves it: the scoring policy's ``score_update``); the split-0 program also
merges the partial outputs (with "none", stage 1 saves no logits and stage 2 stops there). Saving
logits (4*G bytes per key) is cheaper than reading K again (2*D bytes per key) to recompute them
once the final LSE is known. Every slot belongs to one request and one split, so the score updates
are plain read-add-write without atomics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

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

#: What a decode step does with each key's attention probability p (summed over its G query heads):
#: "add" accumulates it into the key's score (H2O, SnapKV), "replace" makes it the score (TOVA:
#: the latest query's attention), "none" leaves the score as written (position or key norm).
ScoreUpdate = Literal["add", "replace", "none"]
SCORE_UPDATES: tuple[ScoreUpdate, ...] = ("add", "replace", "none")


@dataclass(frozen=True)
class DecodeConfig:
    """``block_n`` keys per step (power of two >= 16) and launch hints."""

    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2


#: Programs a decode launch aims for per streaming multiprocessor: enough that every SM has work
#: with some left to hide a slow one, and no more, since each split adds a partial output to merge.
PROGRAMS_PER_SM = 4
#: The fewest keys a split is given (a chunk shorter than a few key blocks is mostly overhead).
MIN_SPLIT_KEYS = 128
#: The most splits a row is cut into.
MAX_SPLITS = 16


def decode_splits(batch: int, kv_heads: int, width: int, processors: int) -> int:
    """Key chunks per request for a launch of `batch` rows of `width` entries (the table's width:
    the longest a row can be, known without reading the lengths) over `kv_heads` heads on a device
    with `processors` SMs: as many as bring the launch to `PROGRAMS_PER_SM` programs per SM,
    chunks of at least `MIN_SPLIT_KEYS` keys, at most `MAX_SPLITS`; a power of two, so that a
    server compiles at most five variants of the kernel (the count is a compile-time constant)."""
    wanted = -(-PROGRAMS_PER_SM * processors // max(1, batch * kv_heads))
    by_width = -(-width // MIN_SPLIT_KEYS)
    most = max(1, min(MAX_SPLITS, wanted, by_width))
    return 1 << (most.bit_length() - 1)


def processor_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (1 off CUDA: the interpreter runs programs one by one)."""
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


#: Keys in a batch below which the torch reference's matmuls take all KV heads at once.
_FEW_KEYS = 4096

#: glibc's largest mmap threshold: an allocation above it is always mapped on its own and
#: unmapped when freed.
_MMAP_THRESHOLD = 32 << 20

#: The torch reference's large gathers on a CPU, by name and dtype: kept between calls.
_GATHERED: dict[tuple[str, torch.dtype], torch.Tensor] = {}


def _gather_rows(name: str, buf: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``buf``'s rows at ``indices`` ([n, *buf.shape[1:]]). On a CPU a gather above glibc's mmap
    threshold goes into the buffer kept under ``name`` (valid until the next gather under that
    name; it grows to the largest batch seen and stays): a fresh tensor that size would fault in
    every page again, twice per layer. Smaller ones come from the heap, and on CUDA the caching
    allocator (or a captured graph's pool) serves them: those stay fresh tensors."""
    shape = (indices.numel(), *buf.shape[1:])
    need = math.prod(shape)
    if buf.device.type != "cpu" or need * buf.element_size() <= _MMAP_THRESHOLD:
        return buf.index_select(0, indices)
    kept = _GATHERED.get((name, buf.dtype))
    if kept is None or kept.numel() < need:
        kept = _GATHERED[(name, buf.dtype)] = torch.empty(need, dtype=buf.dtype)
    return torch.index_select(buf, 0, indices, out=kept[:need].view(shape))


def default_decode_config(dtype: torch.dtype) -> DecodeConfig:
    """Large tiles in the interpreter, whose cost scales with program count x loop steps; on a
    GPU, float32's IEEE dots take a small key block to compile without spilling
    (`bench/compile_check.py`)."""
    if interpreting():
        return DecodeConfig(block_n=128, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return DecodeConfig(block_n=16)
    return DecodeConfig()


@triton.jit
def _decode_partial_kernel(
    Q,
    K,
    V,
    MID_O,
    MID_LSE,
    LOGITS,
    kv_lens,
    kv_indices,
    qk_scale,
    v_scale,
    window,
    stride_ib,
    stride_in,
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
    stride_lgb,
    stride_lgn,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    SAVE_LOGITS: tl.constexpr,  # False when the scores are not updated: stage 2 never reads them
):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens + req)
    lo = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)  # the row's first visible key
    chunk = tl.cdiv(tl.cdiv(kv_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
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
        slot = tl.load(kv_indices + req * stride_ib + n * stride_in, mask=n_ok, other=0).to(tl.int64)
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
        kt = kt.to(q.dtype)  # FP8 K/V dequantized in registers (the scales are applied after the dots)
        v = v.to(q.dtype)
        s = tl.dot(q, kt, input_precision=PRECISION) * qk_scale  # log2 units, the K scale folded in
        s = tl.where(n_ok[None, :], s, float("-inf"))
        if SAVE_LOGITS:
            tl.store(
                LOGITS + req * stride_lgb + n[None, :].to(tl.int64) * stride_lgn + head[:, None],
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
    part_o = acc * (v_scale / tl.where(nonempty, l_i, 1.0))[:, None]
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
    kv_lens,
    score_indices,
    row_updates,
    window,
    stride_sib,
    stride_sin,
    stride_ru,
    stride_ob,
    stride_oh,
    stride_st,
    stride_sh,
    stride_mob,
    stride_moh,
    stride_mos,
    stride_mlb,
    stride_mlh,
    stride_lgb,
    stride_lgn,
    GROUP: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPDATE: tl.constexpr,  # index into SCORE_UPDATES, or -1: each request's own in `row_updates`
):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    kv_len = tl.load(kv_lens + req)
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
    if UPDATE < 0:
        update = tl.load(row_updates + req * stride_ru)
    else:
        update = UPDATE
    if update == 2:  # "none"
        return

    lo = tl.where(window > 0, tl.maximum(kv_len - window, 0), 0)
    chunk = tl.cdiv(tl.cdiv(kv_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * chunk
    end = tl.minimum(start + chunk, kv_len)
    offs_n = tl.arange(0, BLOCK_N)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + offs_n
        n_ok = n < end
        logits = tl.load(
            LOGITS + req * stride_lgb + n[None, :].to(tl.int64) * stride_lgn + head[:, None],
            mask=h_ok[:, None] & n_ok[None, :],
            other=float("-inf"),
        )
        prob = tl.sum(tl.exp2(logits - lse[:, None]), 0)
        slot = tl.load(score_indices + req * stride_sib + n * stride_sin, mask=n_ok, other=0).to(tl.int64)
        ptr = SCORES + slot * stride_st + kv_head * stride_sh
        if UPDATE < 0:
            prob += tl.load(ptr, mask=n_ok & (update == 0), other=0.0)
        elif UPDATE == 0:  # "add"
            prob += tl.load(ptr, mask=n_ok, other=0.0)
        tl.store(ptr, prob, mask=n_ok)


def decode_attention_with_scores_triton(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indices: torch.Tensor,
    score_buf: torch.Tensor,
    sm_scale: float,
    *,
    score_indices: torch.Tensor | None = None,
    score_update: ScoreUpdate = "add",
    row_updates: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
) -> torch.Tensor:
    """Triton implementation; see :func:`decode_attention_with_scores` for the contract."""
    _check_window(window)
    if num_kv_splits is not None and num_kv_splits < 1:
        raise ValueError(f"num_kv_splits must be >= 1, got {num_kv_splits}")
    update = _update_index(score_update) if row_updates is None else -1
    group = check_group(q.shape[1], k_buf.shape[1])
    score_indices = _check_table(q, kv_lens, kv_indices, score_indices, row_updates)
    cfg = config or default_decode_config(q.dtype)
    batch, num_q_heads, head_dim = q.shape
    o = torch.empty_like(q) if out is None else out
    if batch == 0:
        return o
    dev = q.device
    if num_kv_splits is None:
        num_kv_splits = decode_splits(batch, k_buf.shape[1], kv_indices.shape[1], processor_count(dev))
    mid_o = torch.empty((batch, num_q_heads, num_kv_splits, head_dim), dtype=torch.float32, device=dev)
    mid_lse = torch.empty((batch, num_q_heads, num_kv_splits), dtype=torch.float32, device=dev)
    save_logits = update < 0 or SCORE_UPDATES[update] != "none"
    logits_len = kv_indices.shape[1] if save_logits else 1
    logits = torch.empty((batch, logits_len, num_q_heads), dtype=torch.float32, device=dev)
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
        kv_lens,
        kv_indices,
        sm_scale * LOG2E * k_scale,
        v_scale,
        window,
        kv_indices.stride(0),
        kv_indices.stride(1),
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
        logits.stride(1),
        GROUP=group,
        NUM_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        BLOCK_N=cfg.block_n,
        UPCAST=upcast_dots(q.dtype),
        PRECISION=dot_precision(q.dtype),
        SAVE_LOGITS=save_logits,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    _decode_finalize_kernel[grid](
        o,
        score_buf,
        mid_o,
        mid_lse,
        logits,
        kv_lens,
        score_indices,
        row_updates if row_updates is not None else kv_lens,  # a valid pointer the kernel never reads
        window,
        score_indices.stride(0),
        score_indices.stride(1),
        0 if row_updates is None else row_updates.stride(0),
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
        logits.stride(1),
        GROUP=group,
        NUM_SPLITS=num_kv_splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_H=block_h,
        BLOCK_S=triton.next_power_of_2(num_kv_splits),
        BLOCK_N=cfg.block_n,
        UPDATE=update,
        num_warps=cfg.num_warps,
    )
    return o


def decode_attention_with_scores_torch(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indices: torch.Tensor,
    score_buf: torch.Tensor,
    sm_scale: float,
    *,
    score_indices: torch.Tensor | None = None,
    score_update: ScoreUpdate = "add",
    row_updates: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
) -> torch.Tensor:
    """Plain-torch reference in at least float32, the whole batch at once over the padded rows
    (masked past each length), so it never asks the host for a length: the CPU server's decode
    path has no per-request loop and no device-to-host synchronisation.

    ``num_kv_splits`` and ``config`` only shape the Triton launch and are accepted for signature
    parity (splitting does not change the result beyond rounding).
    """
    del num_kv_splits, config
    _check_window(window)
    _update_index(score_update)  # validates
    group = check_group(q.shape[1], k_buf.shape[1])
    score_indices = _check_table(q, kv_lens, kv_indices, score_indices, row_updates)
    o = torch.empty_like(q) if out is None else out
    acc_dtype = torch.promote_types(q.dtype, torch.float32)
    batch, width = kv_indices.shape
    heads, dim = k_buf.shape[1], k_buf.shape[2]
    # As few torch calls as the batch allows (on a CPU each costs more than the work at small
    # batches): one gather per buffer into a kept one (`_gather_rows`; index_select takes int32
    # indices and is much faster than advanced indexing) and one masked softmax. The matmuls: one
    # over all KV heads while the keys are few (its copy of them is cheap), one per KV head on
    # strided views (which the CPU's GEMM takes without a copy) once they are many.
    k = _gather_rows("k", k_buf, kv_indices.reshape(-1)).view(batch, width, heads, dim).to(acc_dtype)
    v = _gather_rows("v", v_buf, kv_indices.reshape(-1)).view(batch, width, heads, dim).to(acc_dtype)
    qb = q.to(acc_dtype).unflatten(1, (heads, group))  # [B, H_kv, G, D]
    entry = torch.arange(width, device=q.device)
    # Past each length (padding), and with a window before its last `window` keys: not attended,
    # scores left alone.
    padding = entry >= kv_lens[:, None]
    if window:
        padding |= entry < kv_lens[:, None] - window
    padding = padding[:, None, None, :]  # [B, 1, 1, W]
    out = o.view(batch, heads, group, dim)
    few = batch * width <= _FEW_KEYS
    if few:
        logits = torch.matmul(qb, k.permute(0, 2, 3, 1))
    else:
        logits = torch.stack([torch.bmm(qb[:, h], k[:, :, h].transpose(1, 2)) for h in range(heads)], 1)
    probs = torch.softmax(logits.mul_(sm_scale * k_scale).masked_fill_(padding, float("-inf")), dim=-1)
    probs.masked_fill_(padding, 0.0)  # a request with no keys (an all -inf row): zero output
    if few:
        values = torch.matmul(probs, v.transpose(1, 2))
    else:
        values = torch.stack([torch.bmm(probs[:, h], v[:, :, h]) for h in range(heads)], 1)
    out.copy_(values if v_scale == 1.0 else values * v_scale)
    if row_updates is None and score_update == "none":
        return o
    mass = probs.sum(dim=2).transpose(1, 2).reshape(batch * width, heads)  # [B * W, H_kv]
    # Padding (and keys before a window) add their zeros to slot 0, not to the slot they name
    # (another request's or their own, whose bytes an added zero could still change, e.g. a flushed
    # denormal): as the kernel, which skips them. So do the keys of a request whose update is "none".
    skipped = padding[:, 0, 0, :]
    if row_updates is not None:
        skipped = skipped | (row_updates == SCORE_UPDATES.index("none"))[:, None]
    slots = score_indices.masked_fill(skipped, 0).reshape(-1)
    pad = skipped.reshape(-1, 1)
    # "replace" is added as a difference: no boolean mask, so no wait on the device.
    if row_updates is not None:
        replacing = (row_updates == SCORE_UPDATES.index("replace"))[:, None].expand(batch, width).reshape(-1, 1)
        old = torch.where(replacing, score_buf.index_select(0, slots).to(mass.dtype), 0.0)
        mass = torch.where(pad, 0.0, mass - old)
    elif score_update == "replace":
        mass = torch.where(pad, 0.0, mass - score_buf.index_select(0, slots).to(mass.dtype))
    score_buf.index_add_(0, slots, mass.to(score_buf.dtype))
    return o


def decode_attention_with_scores(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indices: torch.Tensor,
    score_buf: torch.Tensor,
    sm_scale: float,
    *,
    score_indices: torch.Tensor | None = None,
    score_update: ScoreUpdate = "add",
    row_updates: torch.Tensor | None = None,
    num_kv_splits: int | None = None,
    out: torch.Tensor | None = None,
    config: DecodeConfig | None = None,
    backend: Backend = "auto",
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int = 0,
) -> torch.Tensor:
    """One decode step of attention that also updates each key's score with its probability.

    Args:
        q: [B, H_q, D], one query token per request; H_q = G * H_kv.
        k_buf, v_buf: [num_slots, H_kv, D] pool buffers of one layer, in q's dtype or FP8
            (`FP8_DTYPES`: dequantized in registers, the key times `k_scale`, the value times
            `v_scale`, as the layer's pool scales them).
        kv_lens: int32/int64 [B] keys per request.
        kv_indices: int32/int64 [B, W] (any strides): row b's first kv_lens[b] entries are the
            slots of request b's keys (no mask: every one is visible); entries past the length
            are ignored but must be valid slot numbers (padding, e.g. 0). Each slot must appear
            at most once among the batch's keys.
        score_buf: [num_score_slots, H_kv] float32, updated in place: score_buf[s, h] += sum over
            the G query heads of KV head h of softmax(q.k * sm_scale)[key], where s is the key's
            entry in `score_indices` ([B, W] aligned with kv_indices, padding valid as there;
            default: kv_indices itself); padding's slots are never written (the torch reference
            adds its zeros to slot 0). Each score slot must appear at most once among the
            batch's keys, except slots whose scores are never read (their sums are then undefined).
        score_update: "add" as above; "replace" writes the sum instead of adding it; "none"
            leaves `score_buf` untouched.
        row_updates: int32 [B] (any stride), each request's own update as an index into
            `SCORE_UPDATES` (overrides `score_update`): requests of different scoring policies in
            one launch, and in one captured graph.
        sm_scale: logit scale; num_kv_splits: key chunks per request (split-K parallelism;
            default `decode_splits` for the batch, the table's width and the device).
        out: optional [B, H_q, D] output; config: Triton tiles; backend: as usual.
        window: with W > 0 each request attends only to the last W entries of its row (a sliding
            window over a row in position order, the new token's own key the last); the entries
            before it are neither read nor scored. 0: every entry.

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
        kv_lens,
        kv_indices,
        score_buf,
        sm_scale,
        score_indices=score_indices,
        score_update=score_update,
        row_updates=row_updates,
        num_kv_splits=num_kv_splits,
        out=out,
        config=config,
        k_scale=k_scale,
        v_scale=v_scale,
        window=window,
    )


def _check_window(window: int) -> None:
    if window < 0:
        raise ValueError(f"window must be 0 (every entry) or positive, got {window}")


def _update_index(score_update: str) -> int:
    """The kernel's constexpr for an update; ValueError for an unknown one."""
    if score_update not in SCORE_UPDATES:
        raise ValueError(f"score_update must be one of {', '.join(SCORE_UPDATES)}; got {score_update!r}")
    return SCORE_UPDATES.index(score_update)


def _check_table(
    q: torch.Tensor,
    kv_lens: torch.Tensor,
    kv_indices: torch.Tensor,
    score_indices: torch.Tensor | None,
    row_updates: torch.Tensor | None = None,
) -> torch.Tensor:
    """Shape checks (no values read: nothing waits on the device); returns the score indices."""
    batch = q.shape[0]
    if kv_lens.shape != (batch,) or kv_indices.dim() != 2 or kv_indices.shape[0] != batch:
        raise ValueError(
            f"need kv_lens [B={batch}] and kv_indices [B, W]; got {tuple(kv_lens.shape)}, {tuple(kv_indices.shape)}"
        )
    if row_updates is not None and row_updates.shape != (batch,):
        raise ValueError(f"row_updates must be [B={batch}], got {tuple(row_updates.shape)}")
    if score_indices is None:
        return kv_indices
    if score_indices.shape != kv_indices.shape:
        raise ValueError(f"score_indices {tuple(score_indices.shape)} must match kv_indices {tuple(kv_indices.shape)}")
    return score_indices
