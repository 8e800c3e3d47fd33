"""Triton extend attention with statistics against its torch reference (interpreter on the CPU).

Relative error bounds (normwise, max|a - e| / max|e|), per input dtype:
  output: fp32 1e-5, fp16 5e-3 (probabilities are rounded to fp16 before P@V), bf16 2e-2
  LSE:    1e-5 for all (logits are fp32 dot products of the same inputs in both)
Outputs are NaN-poisoned first, so any element the kernel fails to write fails the bound.
"""

import dataclasses

import pytest
import torch

from sglang_kvsparse.kernels import ExtendConfig, extend_attention_with_stats
from sglang_kvsparse.kernels.testing import make_ragged_batch, rel_error

OUT_REL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
LSE_REL = 1e-5
# Full prefills (q_len == kv_len) and cached prefixes (q_len < kv_len); none a block multiple.
Q_LENS = [37, 150, 5, 83]
KV_LENS = [37, 290, 133, 83]


def run_both(batch, config=None, with_stats=True, window=0):
    results = []
    for backend in ("triton", "torch"):
        out = torch.full_like(batch.q, float("nan"))
        lse_out = torch.full(batch.q.shape[:2], float("nan"), device=batch.q.device)
        results.append(
            extend_attention_with_stats(
                batch.q,
                batch.k_buf,
                batch.v_buf,
                batch.qo_indptr,
                batch.kv_indptr,
                batch.kv_indices,
                batch.sm_scale,
                with_stats=with_stats,
                out=out,
                lse_out=lse_out,
                config=config,
                backend=backend,
                window=window,
            )
        )
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_extend_matches_reference(group, head_dim, dtype, device):
    batch = make_ragged_batch(Q_LENS, KV_LENS, 2, group, head_dim, dtype, device, seed=group * head_dim)
    (o, lse), (o_ref, lse_ref) = run_both(batch)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert rel_error(o, o_ref) <= OUT_REL[dtype]
    assert rel_error(lse, lse_ref) <= LSE_REL


@pytest.mark.parametrize("block_rows, block_n", [(16, 16), (64, 32)])
def test_extend_small_tiles(block_rows, block_n, device):
    """Many query and key blocks: exercises the unmasked and causal phases and the row packing."""
    batch = make_ragged_batch(Q_LENS, KV_LENS, 1, 3, 64, torch.float16, device, seed=7)
    batch = dataclasses.replace(batch, kv_indices=batch.kv_indices.int())  # int32 indices work too
    (o, lse), (o_ref, lse_ref) = run_both(batch, ExtendConfig(block_rows=block_rows, block_n=block_n))
    assert rel_error(o, o_ref) <= OUT_REL[torch.float16]
    assert rel_error(lse, lse_ref) <= LSE_REL


def test_extend_bf16(device):
    batch = make_ragged_batch(Q_LENS, KV_LENS, 2, 4, 64, torch.bfloat16, device, seed=3)
    (o, lse), (o_ref, lse_ref) = run_both(batch)
    assert rel_error(o, o_ref) <= OUT_REL[torch.bfloat16]
    assert rel_error(lse, lse_ref) <= LSE_REL


def test_extend_without_stats(device):
    batch = make_ragged_batch(Q_LENS, KV_LENS, 2, 3, 64, torch.float32, device, seed=5)
    (o, lse), (o_ref, _) = run_both(batch, with_stats=False)
    assert lse is None
    assert rel_error(o, o_ref) <= OUT_REL[torch.float32]


def test_extend_auto_backend_uses_reference_on_cpu():
    """The dispatcher picks the reference for CPU tensors: identical results, no interpreter run."""
    batch = make_ragged_batch([3], [9], 1, 1, 16)
    args = (batch.q, batch.k_buf, batch.v_buf, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.sm_scale)
    o_auto, lse_auto = extend_attention_with_stats(*args)
    o_ref, lse_ref = extend_attention_with_stats(*args, backend="torch")
    assert torch.equal(o_auto, o_ref) and torch.equal(lse_auto, lse_ref)


#: Every window at small tiles and at large ones, but a window longer than every row at small
#: tiles (the interpreter's slowest case, plain causal attention as at large tiles) only in the
#: extended tier.
SLIDING_CASES = [
    *((window, 16, 16) for window in (1, 7, 40)),
    pytest.param(512, 16, 16, marks=pytest.mark.extended),
    *((window, 128, 64) for window in (1, 7, 40, 512)),
]


@pytest.mark.parametrize("window, block_rows, block_n", SLIDING_CASES)
def test_extend_sliding_window_matches_reference(window, block_rows, block_n, device):
    """Each query attends to its last `window` keys only: windows shorter than a key block, than a
    query block and longer than every row, over full prefills and cached prefixes."""
    batch = make_ragged_batch(Q_LENS, KV_LENS, 2, 4, 64, torch.float32, device, seed=window)
    config = ExtendConfig(block_rows=block_rows, block_n=block_n)
    (o, lse), (o_ref, lse_ref) = run_both(batch, config, window=window)
    assert rel_error(o, o_ref) <= OUT_REL[torch.float32] and rel_error(lse, lse_ref) <= LSE_REL
    if window >= max(KV_LENS):  # a window longer than every row is plain causal attention
        (o_causal, _), _ = run_both(batch, config)
        assert rel_error(o, o_causal) <= OUT_REL[torch.float32]


def test_a_negative_window_is_refused():
    batch = make_ragged_batch([3], [3], 1, 1, 16)
    with pytest.raises(ValueError, match="window must be 0"):
        run_both(batch, window=-1)
