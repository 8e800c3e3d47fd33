"""Triton window scoring against its torch reference (interpreter on the CPU).

Relative error bound (normwise): 1e-5 in fp32, 1e-4 in fp16 (both sides form fp32 logits from
the same fp16 inputs; only summation order differs). Scores are NaN-poisoned first; queries and LSE
rows outside each request's window are NaN too, which proves that only window rows are read.
"""

import dataclasses
import importlib

import pytest
import torch

from sglang_kvsparse.kernels import (
    WindowScoreConfig,
    extend_attention_with_stats_torch,
    pool_scores,
    select_kept,
    window_scores,
)
from sglang_kvsparse.kernels.common import Segments
from sglang_kvsparse.kernels.testing import make_ragged_batch, rel_error

REL = {torch.float32: 1e-5, torch.float16: 1e-4}
Q_LENS = [37, 150, 5, 83]
KV_LENS = [37, 290, 133, 83]


def window_inputs(batch, window):
    """The batch's LSE, and q / LSE with every row outside the observation windows set to NaN."""
    _, lse = extend_attention_with_stats_torch(
        batch.q, batch.k_buf, batch.v_buf, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.sm_scale
    )
    rows = torch.arange(batch.q.shape[0], device=batch.q.device)
    req = Segments.of(batch.qo_indptr).ids
    outside = batch.qo_indptr.long()[1:][req] - rows > window
    q = batch.q.masked_fill(outside[:, None, None], float("nan"))
    return q, lse.masked_fill(outside[:, None], float("nan"))


def run_both(batch, window, config=None):
    q, lse = window_inputs(batch, window)
    results = []
    for backend in ("triton", "torch"):
        out = torch.full((batch.kv_indices.numel(), batch.k_buf.shape[1]), float("nan"), device=q.device)
        results.append(
            window_scores(
                q,
                batch.k_buf,
                lse,
                batch.qo_indptr,
                batch.kv_indptr,
                batch.kv_indices,
                window,
                batch.sm_scale,
                out=out,
                config=config,
                backend=backend,
            )
        )
    return results


@pytest.mark.parametrize("window", [5, 200])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_window_scores_match_reference(group, head_dim, dtype, window, device):
    batch = make_ragged_batch(Q_LENS, KV_LENS, 2, group, head_dim, dtype, device, seed=group + head_dim)
    scores, ref = run_both(batch, window)
    assert scores.dtype == torch.float32
    assert rel_error(scores, ref) <= REL[dtype]


@pytest.mark.parametrize("window", [20, 100])
def test_window_scores_small_tiles(window, device):
    """Windows spanning several query blocks, and key blocks before the window (causal skip)."""
    batch = make_ragged_batch(Q_LENS, KV_LENS, 2, 3, 64, torch.float32, device, seed=11)
    batch = dataclasses.replace(batch, kv_indices=batch.kv_indices.int())  # int32 indices work too
    scores, ref = run_both(batch, window, WindowScoreConfig(block_n=32, block_rows=16))
    assert rel_error(scores, ref) <= REL[torch.float32]


def test_the_reference_in_blocks_of_queries_matches_the_kernel(monkeypatch, device):
    """The torch reference takes observed queries a block at a time (H2O observes them all):
    blocks of 7 rows match the Triton kernel."""
    monkeypatch.setattr(importlib.import_module("sglang_kvsparse.kernels.window_scores"), "REFERENCE_ROWS", 7)
    batch = make_ragged_batch(Q_LENS, KV_LENS, 2, 3, 64, torch.float32, device, seed=5)
    scores, ref = run_both(batch, 100, WindowScoreConfig(block_n=32, block_rows=16))
    assert rel_error(scores, ref) <= REL[torch.float32]


def test_scores_sum_to_window_mass(device):
    """Each window query row's probabilities sum to 1, so a request's scores sum to window * H_q."""
    batch = make_ragged_batch(Q_LENS, KV_LENS, 2, 4, 64, torch.float32, device, seed=2)
    scores, _ = run_both(batch, 16)
    per_request = torch.zeros(len(Q_LENS), dtype=torch.float64)
    per_request.index_add_(0, Segments.of(batch.kv_indptr).ids.cpu(), scores.sum(1).double().cpu())
    expected = torch.tensor([min(16, n) * 8 for n in Q_LENS], dtype=torch.float64)
    assert torch.allclose(per_request, expected, rtol=1e-5)


def test_window_then_pool_then_select(device):
    """The prefill pipeline end to end: kept sets are valid positions and include protected ones."""
    batch = make_ragged_batch(Q_LENS, KV_LENS, 2, 3, 64, torch.float32, device, seed=4)
    scores, _ = run_both(batch, 8)
    keys = Segments.of(batch.kv_indptr)
    pooled = pool_scores(scores, keys, 5, "max")
    kept, kept_lens = select_kept(pooled, keys, budget=64, sink=4, window=8)
    assert kept.shape == (4, 2, 64)
    assert kept_lens.tolist() == [37, 64, 64, 64]
    for b, length in enumerate(KV_LENS):
        for h in range(2):
            row = kept[b, h, : kept_lens[b]].tolist()
            assert row == sorted(set(row)) and 0 <= row[0] and row[-1] < length
            if length > 64:
                assert set(range(4)) | set(range(length - 8, length)) <= set(row)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_bad_window_is_refused(backend):
    batch = make_ragged_batch([3], [5], 1, 1, 16)
    with pytest.raises(ValueError, match="^window must"):
        window_scores(
            batch.q,
            batch.k_buf,
            torch.zeros(3, 1),
            batch.qo_indptr,
            batch.kv_indptr,
            batch.kv_indices,
            0,
            batch.sm_scale,
            backend=backend,
        )
