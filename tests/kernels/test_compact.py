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


def test_compact_moves_scores_by_their_own_slots(device):
    """Scores in a slot space of their own: K/V by `src`/`dst`, scores by `score_src`/`score_dst`,
    overlapping in place, the Triton path bit-exact with the reference."""
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(12, 2, 16, generator=gen).to(device)
    scores = torch.rand(40, 2, generator=gen).to(device)
    src = torch.tensor([[3, 5], [4, 3], [7, 6]], device=device)
    dst = torch.tensor([3, 4, 5], device=device)
    score_src = torch.tensor([[20, 22], [21, 20], [24, 23]], device=device)
    score_dst = torch.tensor([20, 21, 22], device=device)
    results = {}
    for backend in ("triton", "torch"):
        bufs = (k.clone(), k.clone() * 2, scores.clone())
        compact_kv(*bufs, src, dst, score_src=score_src, score_dst=score_dst, backend=backend)
        results[backend] = bufs
    for got, want in zip(results["triton"], results["torch"]):
        assert torch.equal(got, want)
    k_out, _, s_out = results["torch"]
    assert torch.equal(k_out[4, 0], k[4, 0]) and torch.equal(k_out[4, 1], k[3, 1])
    assert torch.equal(s_out[21], torch.stack([scores[21, 0], scores[20, 1]]))
    assert torch.equal(s_out[30:], scores[30:])  # outside the moved slots nothing changes
