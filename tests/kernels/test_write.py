"""Triton store of a decode step's new entries against its torch reference: the K/V rows (cast
to the buffers' dtype) and the first scores, of one kind for every entry or each entry's own, land
exactly where the reference puts them, and nothing else changes; the first scores are those of
`first_scores`, whose kinds are checked against plain formulas."""

import pytest
import torch

from sglang_kvsparse.kernels import FIRST_SCORES, first_scores, position_hash, write_entries
from sglang_kvsparse.kernels.first_scores import first_scores_by_row

#: Entries per test and KV heads.
N, HEADS = 7, 3


def _store(dtype, new_dtype, head_dim, device, **kinds):
    """Both backends' buffers after one store of N random entries; and the entries."""
    gen = torch.Generator().manual_seed(head_dim)
    slots_total = 40
    k_buf = torch.randn(slots_total, HEADS, head_dim, generator=gen).to(device, dtype)
    v_buf = torch.randn(slots_total, HEADS, head_dim, generator=gen).to(device, dtype)
    score_buf = torch.rand(slots_total * 2, HEADS, generator=gen).to(device)
    slots = torch.randperm(slots_total, generator=gen)[:N].to(device)
    score_slots = torch.randperm(slots_total * 2, generator=gen)[:N].to(device, torch.int32)
    k = torch.randn(N, HEADS, head_dim, generator=gen).to(device, new_dtype)
    v = torch.randn(N, HEADS, head_dim, generator=gen).to(device, new_dtype)
    positions = torch.randint(0, 1 << 20, (N,), generator=gen).to(device)
    bufs = {}
    for backend in ("triton", "torch"):
        bufs[backend] = (k_buf.clone(), v_buf.clone(), score_buf.clone())
        write_entries(*bufs[backend], slots, score_slots, k, v, positions, backend=backend, **kinds)
    return bufs, (k_buf, slots, score_slots, k, positions)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize(("dtype", "new_dtype"), [(torch.float32, torch.float32), (torch.float16, torch.float32)])
@pytest.mark.parametrize("first_score", FIRST_SCORES)
def test_store_matches_reference(dtype, new_dtype, head_dim, first_score, device):
    bufs, (k_buf, slots, score_slots, k, positions) = _store(
        dtype, new_dtype, head_dim, device, first_score=first_score
    )
    for got, want in zip(bufs["triton"][:2], bufs["torch"][:2]):
        assert torch.equal(got, want)
    # A norm's sum may run in another order: within float32 rounding; every other kind exactly.
    torch.testing.assert_close(bufs["triton"][2], bufs["torch"][2], rtol=1e-6, atol=0)
    stored_k, _, stored_scores = bufs["torch"]
    assert torch.equal(stored_k[slots], k.to(dtype))
    assert torch.equal(stored_scores[score_slots.long()], first_scores(first_score, k, positions))
    untouched = torch.ones(k_buf.shape[0], dtype=torch.bool)
    untouched[slots.cpu()] = False
    assert torch.equal(stored_k[untouched.to(device)], k_buf[untouched.to(device)])


def test_each_entry_takes_its_own_kind(device):
    """Per-entry kinds (a strided column, as a plan's `row_kinds[:, 1]`): each entry's score is
    its own kind's, in both backends."""
    kinds = torch.tensor([[0, 3], [0, 1], [1, 0], [2, 2], [0, 3], [2, 1], [0, 0]], dtype=torch.int32)[:, 1]
    bufs, (_, _, score_slots, k, positions) = _store(
        torch.float32, torch.float32, 64, device, first_kinds=kinds.to(device)
    )
    for backend in ("triton", "torch"):
        stored = bufs[backend][2][score_slots.long()]
        for entry, kind in enumerate(kinds.tolist()):
            want = first_scores(FIRST_SCORES[kind], k[entry : entry + 1], positions[entry : entry + 1])[0]
            torch.testing.assert_close(stored[entry], want, rtol=1e-6, atol=0)


def test_first_score_kinds_are_their_formulas():
    k = torch.randn(5, 2, 16, dtype=torch.float64)
    positions = torch.tensor([0, 1, 7, 65536, 1 << 30])
    torch.testing.assert_close(first_scores("minus_key_norm", k, positions), -k.norm(dim=-1).float())
    assert torch.equal(first_scores("position", k, positions), positions.float()[:, None].expand(5, 2))
    assert torch.equal(first_scores("zero", k, positions), torch.zeros(5, 2))
    hashed = first_scores("position_hash", k, positions)
    assert torch.equal(hashed, position_hash(positions, 2))
    assert bool(((hashed >= 0) & (hashed < 1)).all()) and hashed.unique().numel() == 10
    by_row = first_scores_by_row(torch.tensor([3, 2, 1, 0, 3]), k, positions)
    assert torch.equal(by_row[1], positions[1].float().expand(2)) and torch.equal(by_row[3], torch.zeros(2))
    with pytest.raises(ValueError, match="first score must be one of zero, minus_key_norm, position, position_hash"):
        first_scores("max", k, positions)


def test_store_rejects_bad_shapes():
    buf, scores = torch.zeros(8, 2, 16), torch.zeros(8, 2)
    slots, positions = torch.arange(3), torch.arange(3)
    with pytest.raises(ValueError, match="k and v"):
        write_entries(buf, buf.clone(), scores, slots, slots, torch.zeros(3, 2, 8), torch.zeros(3, 2, 8), positions)
    with pytest.raises(ValueError, match="positions and first_kinds"):
        write_entries(buf, buf.clone(), scores, slots, slots, torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), slots[:2])
    with pytest.raises(ValueError, match="slots"):
        write_entries(
            buf, buf.clone(), scores, slots, slots[:2], torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), positions
        )
