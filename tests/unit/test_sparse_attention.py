"""`kept_sources` (where each kept entry of a prefill's selection comes from) against a loop over
the requests, on random ragged batches: the vectorised form reads no count back from the device."""

from __future__ import annotations

import pytest
import torch

from sglang_kvsparse.forward.sparse_attention import kept_sources


def loop_sources(kept: torch.Tensor, kept_lens: list[int], starts: list[int]) -> torch.Tensor:
    parts = [kept[b, :, :n].T + start for b, (n, start) in enumerate(zip(kept_lens, starts))]
    return torch.cat(parts) if parts else kept.new_empty(0, kept.shape[1])


@pytest.mark.parametrize("seed", range(6))
def test_kept_sources_match_a_loop_over_requests(seed):
    gen = torch.Generator().manual_seed(seed)
    batch, heads, width = int(torch.randint(1, 6, (1,), generator=gen)), 3, 9
    lengths = torch.randint(0, 30, (batch,), generator=gen)
    kept_lens = torch.minimum(lengths, torch.randint(0, width + 1, (batch,), generator=gen))
    kv_indptr = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    kept = torch.full((batch, heads, width), -1, dtype=torch.int64)
    for b in range(batch):
        for h in range(heads):
            n = int(kept_lens[b])
            kept[b, h, :n] = torch.randperm(int(lengths[b]), generator=gen)[:n].sort().values
    got = kept_sources(kept, kept_lens, kv_indptr, int(kept_lens.sum()))
    assert torch.equal(got, loop_sources(kept, kept_lens.tolist(), kv_indptr[:-1].tolist()))
