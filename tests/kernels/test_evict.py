"""The eviction kernel against its torch reference and against an explicit loop: the kept entries
of every row and KV head, moved in place into the row's first `budget` entries, bit-exact."""

import pytest
import torch

from sglang_kvsparse.kernels import evict_rows, evict_rows_torch


def _rows(columns: int, requests: int, n: int, pool: int, gen: torch.Generator, device: str) -> torch.Tensor:
    """[columns, requests, n] distinct slots: a random permutation of a larger pool."""
    return torch.randperm(pool, generator=gen)[: columns * requests * n].view(columns, requests, n).to(device)


def _case(columns, requests, n, heads, head_dim, dtype, ties, seed, device):
    gen = torch.Generator().manual_seed(seed)
    pool = columns * requests * n + 17
    k = torch.randn(pool, heads, head_dim, generator=gen).to(dtype).to(device)
    v = torch.randn(pool, heads, head_dim, generator=gen).to(dtype).to(device)
    scores = torch.rand(pool + 5, heads, generator=gen).to(device)
    slots = _rows(columns, requests, n, pool, gen, device)
    score_slots = _rows(columns, requests, n, pool + 5, gen, device)
    shape = (columns * requests, n, heads)
    ranked = torch.randint(0, 3, shape, generator=gen).float() if ties else torch.randn(shape, generator=gen)
    return k, v, scores, ranked.to(device), slots, score_slots


@pytest.mark.parametrize(
    "columns, requests, n, budget, sink, window",
    [(3, 4, 50, 34, 4, 8), (2, 1, 40, 24, 0, 0), (1, 3, 70, 38, 4, 16), (2, 2, 9, 9, 2, 3), (4, 2, 33, 1, 0, 1)],
)
@pytest.mark.parametrize("ties", [False, True])
def test_evict_rows_matches_reference(columns, requests, n, budget, sink, window, ties, device):
    """Rows not a power of two long, more drops than a chunk of the dropped list, tied ranks,
    chunks of moves that overlap their own sources; every buffer equal to the reference's."""
    heads, head_dim = 3, 80
    k, v, scores, ranked, slots, score_slots = _case(
        columns, requests, n, heads, head_dim, torch.float16, ties, n, device
    )
    got = {}
    for backend in ("triton", "torch"):
        bufs = (k.clone(), v.clone(), scores.clone())
        evict_rows(*bufs, ranked, slots, score_slots, budget, sink, window, backend=backend)
        got[backend] = bufs
    for a, b in zip(got["triton"], got["torch"]):
        assert torch.equal(a, b)
    if budget < n:
        assert not torch.equal(got["torch"][0], k)


def test_evict_rows_takes_strided_views(device):
    """The server passes the first columns of a group's tables and a transposed ranking."""
    k, v, scores, ranked, slots, score_slots = _case(3, 2, 24, 2, 16, torch.float32, False, 5, device)
    ranked = ranked.transpose(1, 2).contiguous().transpose(1, 2)  # [R, n, H] with H-major strides
    got = {}
    for backend in ("triton", "torch"):
        bufs = (k.clone(), v.clone(), scores.clone())
        evict_rows(*bufs, ranked[:4], slots[:2], score_slots[:2], 16, 2, 4, backend=backend)
        got[backend] = bufs
    for a, b in zip(got["triton"], got["torch"]):
        assert torch.equal(a, b)


def test_evict_rows_reference_is_the_explicit_loop():
    """Per row and head: keep sink, window and the best-ranked rest (earlier first among equal
    ranks), in position order, into the row's first `budget` entries; K, V and scores alike."""
    columns, requests, n, heads, budget, sink, window = 2, 2, 12, 3, 7, 1, 2
    k, v, scores, ranked, slots, score_slots = _case(columns, requests, n, heads, 4, torch.float32, True, 9, "cpu")
    want = [t.clone() for t in (k, v, scores)]
    for c in range(columns):
        for r in range(requests):
            for h in range(heads):
                rank = ranked[c * requests + r, :, h].tolist()
                protected = set(range(sink)) | set(range(n - window, n))
                rest = sorted(set(range(n)) - protected, key=lambda i: (-rank[i], i))
                kept = sorted(protected | set(rest[: budget - len(protected)]))
                for j, p in enumerate(kept):
                    want[0][slots[c, r, j], h] = k[slots[c, r, p], h]
                    want[1][slots[c, r, j], h] = v[slots[c, r, p], h]
                    want[2][score_slots[c, r, j], h] = scores[score_slots[c, r, p], h]
    evict_rows_torch(k, v, scores, ranked, slots, score_slots, budget, sink, window)
    for got, expected in zip((k, v, scores), want):
        assert torch.equal(got, expected)


def test_evict_rows_rejects_bad_shapes():
    k, v, scores, ranked, slots, score_slots = _case(1, 2, 10, 2, 4, torch.float32, False, 1, "cpu")
    with pytest.raises(ValueError, match="ranked"):
        evict_rows(k, v, scores, ranked[:1], slots, score_slots, 6, 1, 1)
    with pytest.raises(ValueError, match="score_slots"):
        evict_rows(k, v, scores, ranked, slots, score_slots[:, :1], 6, 1, 1)
    with pytest.raises(ValueError, match="budget"):
        evict_rows(k, v, scores, ranked, slots, score_slots, 11, 1, 1)
    with pytest.raises(ValueError, match="sink"):
        evict_rows(k, v, scores, ranked, slots, score_slots, 4, 3, 2)
