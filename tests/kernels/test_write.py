"""Triton store of a decode step's new entries against its torch reference: the K/V rows (cast
to the buffers' dtype) and the first scores land exactly where the reference puts them, and
nothing else changes."""

import pytest
import torch

from sglang_kvsparse.kernels import write_entries


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize(("dtype", "new_dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float32)])
@pytest.mark.parametrize("with_scores", [False, True])
def test_store_matches_reference(dtype, new_dtype, head_dim, with_scores, device):
    gen = torch.Generator().manual_seed(head_dim)
    slots_total, heads, n = 40, 3, 7
    k_buf = torch.randn(slots_total, heads, head_dim, generator=gen).to(device, dtype)
    v_buf = torch.randn(slots_total, heads, head_dim, generator=gen).to(device, dtype)
    score_buf = torch.rand(slots_total * 2, heads, generator=gen).to(device)
    slots = torch.randperm(slots_total, generator=gen)[:n].to(device)
    score_slots = torch.randperm(slots_total * 2, generator=gen)[:n].to(device, torch.int32)
    k = torch.randn(n, heads, head_dim, generator=gen).to(device, new_dtype)
    v = torch.randn(n, heads, head_dim, generator=gen).to(device, new_dtype)
    scores = torch.rand(n, heads, generator=gen).to(device) if with_scores else None
    bufs = {}
    for backend in ("triton", "torch"):
        bufs[backend] = (k_buf.clone(), v_buf.clone(), score_buf.clone())
        write_entries(*bufs[backend], slots, score_slots, k, v, scores, backend=backend)
    for got, want in zip(bufs["triton"], bufs["torch"]):
        assert torch.equal(got, want)
    stored_k, _, stored_scores = bufs["torch"]
    assert torch.equal(stored_k[slots], k.to(dtype))
    expected = torch.zeros(n, heads, device=device) if scores is None else scores
    assert torch.equal(stored_scores[score_slots.long()], expected)
    untouched = torch.ones(slots_total, dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.equal(stored_k[untouched.to(device)], k_buf[untouched.to(device)])


def test_store_rejects_bad_shapes():
    buf, scores = torch.zeros(8, 2, 16), torch.zeros(8, 2)
    slots = torch.arange(3)
    with pytest.raises(ValueError, match="k and v"):
        write_entries(buf, buf.clone(), scores, slots, slots, torch.zeros(3, 2, 8), torch.zeros(3, 2, 8))
    with pytest.raises(ValueError, match="scores"):
        write_entries(buf, buf.clone(), scores, slots, slots, torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), scores)
    with pytest.raises(ValueError, match="slots"):
        write_entries(buf, buf.clone(), scores, slots, slots[:2], torch.zeros(3, 2, 16), torch.zeros(3, 2, 16))
