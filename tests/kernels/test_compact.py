"""Triton compaction against its torch reference: bit-exact copies, including in-place overlap."""

import pytest
import torch

from sglang_kvsparse.kernels import compact_kv, select_kept
from sglang_kvsparse.kernels.testing import make_ragged_batch


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compact_in_place_matches_reference(dtype, head_dim, device):
    """Eviction: every request keeps a per-head subset and moves it into its own first slots."""
    kv_lens = [50, 9, 33]
    batch = make_ragged_batch([0, 0, 0], kv_lens, 3, 1, head_dim, dtype, device, seed=head_dim)
    gen = torch.Generator().manual_seed(1)
    scores = torch.rand(batch.kv_indices.numel(), 3, generator=gen).to(device)
    kept, kept_lens = select_kept(scores, batch.kv_indptr, budget=20, sink=2, window=3)
    src, dst = [], []
    for b, start in enumerate(batch.kv_indptr[:-1].tolist()):
        n = kept_lens[b].item()
        slots = batch.kv_indices[start : start + kv_lens[b]]
        src.append(slots[kept[b, :, :n].T])  # [n, H]: per-head source slots
        dst.append(slots[:n])  # the request's own first n slots: overlaps the sources
    src_slots, dst_slots = torch.cat(src), torch.cat(dst)
    score_buf = torch.rand(batch.k_buf.shape[:2], generator=gen).to(device)
    bufs = {}
    for backend in ("triton", "torch"):
        bufs[backend] = (batch.k_buf.clone(), batch.v_buf.clone(), score_buf.clone())
        compact_kv(*bufs[backend], src_slots, dst_slots, backend=backend)
    for got, want in zip(bufs["triton"], bufs["torch"]):
        assert torch.equal(got, want)
    assert not torch.equal(bufs["torch"][0], batch.k_buf)


def test_compact_rejects_bad_shapes():
    k = torch.zeros(8, 2, 16)
    with pytest.raises(ValueError):
        compact_kv(k, k.clone(), torch.zeros(8, 2), torch.zeros(3, 1, dtype=torch.int64), torch.arange(3))
    with pytest.raises(ValueError):
        compact_kv(k, k.clone(), torch.zeros(8, 2), torch.zeros(3, 2, dtype=torch.int64), torch.arange(4))
