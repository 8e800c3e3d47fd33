"""Random ragged batches in the kernels' layout, shared by the tests and bench/kernels.py.

Slots are a random permutation of a pool larger than the batch, so a kernel that ignores
``kv_indices`` or mixes requests reads the wrong keys and fails.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RaggedBatch:
    """Inputs of one layer for a batch: request b has q_lens[b] new queries over kv_lens[b] keys."""

    q: torch.Tensor  # [sum(q_lens), H_q, D]
    k_buf: torch.Tensor  # [num_slots, H_kv, D]
    v_buf: torch.Tensor  # [num_slots, H_kv, D]
    qo_indptr: torch.Tensor  # int32 [B+1]
    kv_indptr: torch.Tensor  # int32 [B+1]
    kv_indices: torch.Tensor  # int64 [sum(kv_lens)], distinct slots
    sm_scale: float

    @property
    def q_lens(self) -> list[int]:
        return (self.qo_indptr[1:] - self.qo_indptr[:-1]).tolist()

    @property
    def kv_lens(self) -> list[int]:
        return (self.kv_indptr[1:] - self.kv_indptr[:-1]).tolist()


def indptr_from_lens(lens: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """int32 CSR pointers [0, l0, l0 + l1, ...] for per-request lengths."""
    out = torch.zeros(len(lens) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
    return out.to(device)


def make_ragged_batch(
    q_lens: Sequence[int],
    kv_lens: Sequence[int],
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_slots: int = 37,
) -> RaggedBatch:
    """Random inputs; each q_len must be in [0, kv_len] (the new tokens are the keys' tail)."""
    if len(q_lens) != len(kv_lens) or any(not 0 <= q <= k for q, k in zip(q_lens, kv_lens)):
        raise ValueError(f"need 0 <= q_len <= kv_len per request; got {q_lens}, {kv_lens}")
    gen = torch.Generator().manual_seed(seed)
    total_kv = sum(kv_lens)
    num_slots = total_kv + spare_slots
    shape = (num_slots, num_kv_heads, head_dim)
    q = torch.randn(sum(q_lens), num_kv_heads * group, head_dim, generator=gen)
    k_buf = torch.randn(shape, generator=gen)
    v_buf = torch.randn(shape, generator=gen)
    kv_indices = torch.randperm(num_slots, generator=gen)[:total_kv]
    return RaggedBatch(
        q=q.to(device=device, dtype=dtype),
        k_buf=k_buf.to(device=device, dtype=dtype),
        v_buf=v_buf.to(device=device, dtype=dtype),
        qo_indptr=indptr_from_lens(q_lens, device),
        kv_indptr=indptr_from_lens(kv_lens, device),
        kv_indices=kv_indices.to(device),
        sm_scale=head_dim**-0.5,
    )


def as_table(batch: RaggedBatch, flat: torch.Tensor | None = None, extra: int = 5, seed: int = 3) -> torch.Tensor:
    """A per-key array of the batch (default: its slots) as the decode kernel's rows, [B, W] with
    W = longest request + `extra`; padding past each length holds random slots of the pool, so a
    kernel that reads past a length reads wrong keys and fails."""
    flat = batch.kv_indices if flat is None else flat
    lens = batch.kv_lens
    gen = torch.Generator().manual_seed(seed)
    width = max(lens, default=0) + extra
    table = torch.randint(0, batch.k_buf.shape[0], (len(lens), width), generator=gen).to(flat.device, flat.dtype)
    starts = batch.kv_indptr.tolist()
    for b, n in enumerate(lens):
        table[b, :n] = flat[starts[b] : starts[b] + n]
    return table


def kv_lens_of(batch: RaggedBatch) -> torch.Tensor:
    """int32 [B] keys per request, on the batch's device."""
    return (batch.kv_indptr[1:] - batch.kv_indptr[:-1]).to(torch.int32)


def decode_queries(batch: RaggedBatch, seed: int = 1) -> torch.Tensor:
    """One random query token per request, [B, H_q, D], matching the batch's dtype and device."""
    gen = torch.Generator().manual_seed(seed)
    shape = (len(batch.kv_lens), batch.q.shape[1], batch.q.shape[2])
    return torch.randn(shape, generator=gen).to(device=batch.q.device, dtype=batch.q.dtype)


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Normwise relative error max|a - e| / max|e| (inf if either has a NaN: poisoned leftovers)."""
    a, e = actual.double(), expected.double()
    if torch.isnan(a).any() or torch.isnan(e).any():
        return float("inf")
    return ((a - e).abs().max() / e.abs().max().clamp_min(1e-30)).item()
