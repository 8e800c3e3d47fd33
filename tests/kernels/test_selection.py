"""Score pooling, forward spreading and kept-set selection against naive per-request loops."""

import pytest
import torch

from sglang_kvsparse.kernels import peaks, pool_scores, select_kept, select_rows, spread_scores
from sglang_kvsparse.kernels.common import Segments
from sglang_kvsparse.kernels.testing import indptr_from_lens

LENS = [1, 7, 30, 4, 19]


def naive_pool(scores, lens, kernel_size, kind):
    out, start, r = [], 0, kernel_size // 2
    for n in lens:
        seg = scores[start : start + n]
        for i in range(n):
            win = seg[max(0, i - r) : i + r + 1]
            out.append(win.max(0).values if kind == "max" else win.mean(0))
        start += n
    return torch.stack(out)


def naive_select(scores, lens, budget, sink, window):
    rows, start = [], 0
    for n in lens:
        seg = scores[start : start + n]
        per_head = []
        for h in range(scores.shape[1]):
            if n <= budget:
                per_head.append(list(range(n)))
                continue
            protected = set(range(min(sink, n))) | set(range(n - window, n))
            rest = sorted(set(range(n)) - protected, key=lambda i: -seg[i, h].item())
            per_head.append(sorted(protected | set(rest[: budget - len(protected)])))
        rows.append(per_head)
        start += n
    return rows


@pytest.mark.parametrize("kind", ["max", "avg"])
@pytest.mark.parametrize("kernel_size", [1, 3, 7, 15, 61])
def test_pool_matches_naive(kernel_size, kind):
    """Max pooling (doubling look-back and look-ahead maxima) is the naive sliding max exactly,
    from no pooling to windows wider than every request."""
    scores = torch.rand(sum(LENS), 2, generator=torch.Generator().manual_seed(kernel_size))
    pooled = pool_scores(scores, Segments.of(indptr_from_lens(LENS, "cpu")), kernel_size, kind)
    expected = naive_pool(scores, LENS, kernel_size, kind)
    if kind == "max":
        assert torch.equal(pooled, expected)
    else:
        assert torch.allclose(pooled, expected, rtol=1e-6)


def test_max_pool_wider_than_the_whole_batch():
    """Steps of the running max longer than the batch itself (a 9-key batch, radius 30)."""
    lens = [2, 7]
    scores = torch.rand(sum(lens), 3, generator=torch.Generator().manual_seed(5))
    pooled = pool_scores(scores, Segments.of(indptr_from_lens(lens, "cpu")), 61, "max")
    assert torch.equal(pooled, naive_pool(scores, lens, 61, "max"))


def test_pool_does_not_bleed_across_requests():
    scores = torch.zeros(sum(LENS), 1)
    scores[7] = 100.0  # last key of request 1
    pooled = pool_scores(scores, Segments.of(indptr_from_lens(LENS, "cpu")), 5, "max")
    assert pooled[8:10].abs().sum() == 0  # first keys of request 2 stay 0
    assert pooled[5:8].min() == 100.0


@pytest.mark.parametrize("kernel_size, kind", [(4, "max"), (0, "avg"), (3, "sum")])
def test_pool_rejects_bad_arguments(kernel_size, kind):
    with pytest.raises(ValueError):
        pool_scores(torch.zeros(5, 1), Segments.of(indptr_from_lens([5], "cpu")), kernel_size, kind)


@pytest.mark.parametrize("follow", [0, 1, 2, 5, 16, 40])
def test_spread_matches_naive_and_stays_in_its_request(follow):
    """Each key gets the max of itself and the `follow` keys before it in its own request."""
    scores = torch.rand(sum(LENS), 3, generator=torch.Generator().manual_seed(follow))
    spread = spread_scores(scores, Segments.of(indptr_from_lens(LENS, "cpu")), follow)
    expected, start = [], 0
    for n in LENS:
        seg = scores[start : start + n]
        expected += [seg[max(0, i - follow) : i + 1].max(0).values for i in range(n)]
        start += n
    assert torch.equal(spread, torch.stack(expected))
    with pytest.raises(ValueError, match="follow must be >= 0"):
        spread_scores(scores, Segments.of(indptr_from_lens(LENS, "cpu")), -1)


def naive_peaks(scores, lens, count, radius, skip_first, skip_last):
    """Per request and head: the keys that are the max of their +-radius neighbourhood, inside
    the skipped edges, scoring at least the count-th best of them."""
    out, start = [], 0
    for n in lens:
        seg = scores[start : start + n]
        mask = torch.zeros(n, scores.shape[1], dtype=torch.bool)
        for h in range(scores.shape[1]):
            peaks = [
                i
                for i in range(skip_first, n - skip_last)
                if seg[i, h] == seg[max(0, i - radius) : i + radius + 1, h].max()
            ]
            values = sorted((float(seg[i, h]) for i in peaks), reverse=True)
            for i in peaks:
                mask[i, h] = float(seg[i, h]) >= values[min(count, len(values)) - 1]
        out.append(mask)
        start += n
    return torch.cat(out)


@pytest.mark.parametrize(
    "count, radius, skip_first, skip_last", [(1, 3, 1, 4), (1, 0, 0, 0), (2, 0, 0, 0), (3, 5, 2, 2), (0, 2, 0, 0)]
)
@pytest.mark.parametrize("ties", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("lens", [LENS, [0, 1, 7, 0, 30, 4, 19, 0]], ids=["lens", "empty-requests"])
def test_peaks_match_naive(count, radius, skip_first, skip_last, ties, lens):
    """The count best local maxima per request and head, ties included, inside the skipped edges
    (count 1 takes its own path: a per-request max, no sort)."""
    scores = torch.rand(sum(lens), 3, generator=torch.Generator().manual_seed(radius))
    if ties:  # plateaus, as max pooling makes them
        scores = (scores * 4).round() / 4
    best = peaks(scores, Segments.of(indptr_from_lens(lens, "cpu")), count, radius, skip_first, skip_last)
    if count == 0:
        assert not best.any()
    assert torch.equal(best, naive_peaks(scores, lens, max(count, 1), radius, skip_first, skip_last) & (count > 0))
    with pytest.raises(ValueError, match="need count, radius"):
        peaks(scores, Segments.of(indptr_from_lens(lens, "cpu")), -1, radius, skip_first, skip_last)


@pytest.mark.parametrize("budget, sink, window", [(10, 2, 3), (5, 0, 0), (6, 6, 0), (30, 1, 1)])
def test_select_matches_naive(budget, sink, window):
    scores = torch.rand(sum(LENS), 3, generator=torch.Generator().manual_seed(budget))
    kept, kept_lens = select_kept(scores, Segments.of(indptr_from_lens(LENS, "cpu")), budget, sink, window)
    expected = naive_select(scores, LENS, budget, sink, window)
    assert kept.dtype == torch.int64 and kept.shape == (len(LENS), 3, min(budget, max(LENS)))
    assert kept_lens.tolist() == [min(n, budget) for n in LENS]
    for b, per_head in enumerate(expected):
        for h, positions in enumerate(per_head):
            n = len(positions)
            assert kept[b, h, :n].tolist() == positions
            assert (kept[b, h, n:] == -1).all()


def test_select_with_each_requests_own_budget_matches_naive_per_request():
    """A [B] budget keeps, for each request, what a call with its budget alone keeps."""
    budgets = [3, 7, 12, 4, 25]
    scores = torch.rand(sum(LENS), 3, generator=torch.Generator().manual_seed(7))
    kept, kept_lens = select_kept(scores, Segments.of(indptr_from_lens(LENS, "cpu")), torch.tensor(budgets), 1, 2)
    assert kept.shape == (len(LENS), 3, min(max(budgets), max(LENS)))
    assert kept_lens.tolist() == [min(n, b) for n, b in zip(LENS, budgets)]
    start = 0
    for b, (n, budget) in enumerate(zip(LENS, budgets)):
        (per_head,) = naive_select(scores[start : start + n], [n], budget, 1, 2)
        start += n
        for h, positions in enumerate(per_head):
            assert kept[b, h, : len(positions)].tolist() == positions
            assert (kept[b, h, len(positions) :] == -1).all()
    with pytest.raises(ValueError, match="2 budgets for 5 requests"):
        select_kept(scores, Segments.of(indptr_from_lens(LENS, "cpu")), torch.tensor([4, 4]), 1, 2)
    with pytest.raises(ValueError, match="exceeds the budget \\(2\\)"):
        select_kept(scores, Segments.of(indptr_from_lens(LENS, "cpu")), torch.tensor([4, 4, 2, 4, 4]), 1, 2)


def test_a_request_keeps_the_same_alone_or_in_any_batch_even_with_tied_scores():
    """Pooled and spread scores tie often; which tied keys survive must not depend on the other
    requests of the batch (a prefix hit, or a request beside others, keeps what it keeps alone)."""
    generator = torch.Generator().manual_seed(11)
    alone = torch.randint(0, 4, (22, 2), generator=generator).float()  # many ties
    others = torch.randn(26 + 9, 2, generator=generator)
    kept_alone, _ = select_kept(alone, Segments.of(indptr_from_lens([22], "cpu")), 8, 1, 2)
    batch = torch.cat([others[:26], alone, others[26:]])
    kept_batch, _ = select_kept(batch, Segments.of(indptr_from_lens([26, 22, 9], "cpu")), 8, 1, 2)
    assert torch.equal(kept_batch[1], kept_alone[0])
    (expected,) = naive_select(alone, [22], 8, 1, 2)  # sorted() is stable: earliest of equal scores
    assert kept_alone[0].tolist() == expected


def test_select_rejects_protected_over_budget():
    with pytest.raises(ValueError):
        select_kept(torch.zeros(10, 1), Segments.of(indptr_from_lens([10], "cpu")), budget=4, sink=2, window=3)


@pytest.mark.parametrize("budget, sink, window", [(8, 1, 2), (5, 0, 0), (12, 4, 8), (20, 2, 3)])
@pytest.mark.parametrize("ties", [False, True])
def test_select_rows_matches_naive_and_select_kept(budget, sink, window, ties):
    """A decode eviction's rows (all of one length), many at once: what each keeps alone."""
    torch.manual_seed(budget + ties)
    rows, n, heads = 9, 20, 3
    scores = torch.randint(0, 3, (rows, n, heads)).float() if ties else torch.randn(rows, n, heads)
    kept = select_rows(scores, budget, sink, window)
    assert kept.shape == (rows, budget, heads) and kept.dtype == torch.int64
    flat, lens = scores.reshape(-1, heads), [n] * rows
    want = naive_select(flat, lens, budget, sink, window)
    for r in range(rows):
        for h in range(heads):
            got = kept[r, :, h].tolist()
            if not ties:
                assert got == want[r][h], (r, h)
            # Of equal scores the earlier positions: exactly `select_kept`'s choice.
            protected = set(range(sink)) | set(range(n - window, n))
            rest = sorted(set(range(n)) - protected, key=lambda i: (-float(scores[r, i, h]), i))
            assert got == sorted(protected | set(rest[: budget - len(protected)])), (r, h)
    reference, _ = select_kept(flat, Segments.of(indptr_from_lens(lens, "cpu")), budget, sink, window)
    assert torch.equal(kept.transpose(1, 2), reference)


def test_select_rows_rejects_a_budget_it_cannot_keep():
    with pytest.raises(ValueError, match="budget"):
        select_rows(torch.zeros(2, 10, 1), 3, 2, 2)
    with pytest.raises(ValueError, match="row length"):
        select_rows(torch.zeros(2, 10, 1), 11, 0, 0)
