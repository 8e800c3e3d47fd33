"""The torch references against straightforward dense softmax attention in float64.

The dense versions materialise the whole [queries x all keys of the batch] score matrix with a mask
for "same request and causally visible", a different formulation from the references' per-request
loops, so a shared bug is unlikely. Bound: normwise relative error <= 1e-10 (float64 throughout).
"""

import pytest
import torch

from sglang_kvsparse.kernels import (
    decode_attention_with_scores_torch,
    extend_attention_with_stats_torch,
    window_scores_torch,
)
from sglang_kvsparse.kernels.common import Segments
from sglang_kvsparse.kernels.testing import as_table, decode_queries, kv_lens_of, make_ragged_batch, rel_error

REL = 1e-10
Q_LENS = [37, 150, 5, 1]
KV_LENS = [37, 290, 133, 20]


def dense_probs(batch, group, sliding: int = 0):
    """[T_q, H_q, T_kv] float64 probabilities and [T_q, H_q] LSE over the whole batch's keys (with
    `sliding` > 0, each query's last `sliding` keys only)."""
    q = batch.q.double()
    k = batch.k_buf.double()[batch.kv_indices]  # [T_kv, H_kv, D]
    k = k.repeat_interleave(group, dim=1)  # [T_kv, H_q, D]
    logits = torch.einsum("ihd,thd->iht", q, k) * batch.sm_scale
    q_req = Segments.of(batch.qo_indptr).ids
    kv_req = Segments.of(batch.kv_indptr).ids
    q_pos = torch.arange(q.shape[0]) - batch.qo_indptr.long()[q_req]
    q_pos = q_pos + (batch.kv_indptr.diff() - batch.qo_indptr.diff()).long()[q_req]
    kv_pos = torch.arange(k.shape[0]) - batch.kv_indptr.long()[kv_req]
    mask = (q_req[:, None] == kv_req[None, :]) & (kv_pos[None, :] <= q_pos[:, None])
    if sliding:
        mask &= q_pos[:, None] - kv_pos[None, :] < sliding
    logits = logits.masked_fill(~mask[:, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse[..., None]), lse


@pytest.mark.parametrize("sliding", [0, 1, 16, 100])
@pytest.mark.parametrize("group", [1, 3])
def test_extend_reference_matches_dense(group, sliding):
    """Causal attention, and with a sliding window (each query's last `sliding` keys, its own
    among them: 1 is itself alone)."""
    batch = make_ragged_batch(Q_LENS, KV_LENS, 2, group, 16, torch.float64)
    probs, lse = dense_probs(batch, group, sliding)
    v = batch.v_buf[batch.kv_indices].repeat_interleave(group, dim=1)
    o_dense = torch.einsum("iht,thd->ihd", probs, v)
    o, lse_ref = extend_attention_with_stats_torch(
        batch.q,
        batch.k_buf,
        batch.v_buf,
        batch.qo_indptr,
        batch.kv_indptr,
        batch.kv_indices,
        batch.sm_scale,
        lse_out=torch.empty_like(lse),  # float64 instead of the default float32
        window=sliding,
    )
    assert rel_error(o, o_dense) <= REL
    assert rel_error(lse_ref, lse) <= REL


@pytest.mark.parametrize("window", [4, 20, 64, 500])
def test_window_reference_matches_dense(window):
    """The last `window` queries' probabilities of each request, from the dense softmax in float64."""
    group, heads = 3, 2
    batch = make_ragged_batch(Q_LENS, KV_LENS, heads, group, 16, torch.float64)
    probs, lse = dense_probs(batch, group)
    q_req = Segments.of(batch.qo_indptr).ids
    from_end = batch.qo_indptr.long()[1:][q_req] - torch.arange(batch.q.shape[0])  # 1 = last query
    weight = (from_end <= window).double()  # [T_q]
    dense = (probs * weight[:, None, None]).sum(0)  # [H_q, T_kv]
    dense = dense.unflatten(0, (heads, group)).sum(1).T  # [T_kv, H_kv]
    scores = window_scores_torch(
        batch.q,
        batch.k_buf,
        lse,
        batch.qo_indptr,
        batch.kv_indptr,
        batch.kv_indices,
        window,
        batch.sm_scale,
        out=torch.empty_like(dense),  # float64 instead of the default float32
    )
    assert rel_error(scores, dense) <= REL


@pytest.mark.parametrize("sliding", [0, 1, 50])
@pytest.mark.parametrize("kv_lens", [[1, 290, 77], [0, *range(180, 204)]], ids=["few-keys", "many-keys"])
def test_decode_reference_matches_dense(kv_lens, sliding):
    """Both of the reference's matmul paths (all KV heads at once for few keys, per head for many),
    an empty request among them; with a sliding window, each row's last `sliding` keys only (the
    others neither attended nor scored)."""
    group, heads = 4, 2
    batch = make_ragged_batch([0] * len(kv_lens), kv_lens, heads, group, 16, torch.float64)
    q = decode_queries(batch)
    k = batch.k_buf[batch.kv_indices].repeat_interleave(group, dim=1)  # [T_kv, H_q, D]
    v = batch.v_buf[batch.kv_indices].repeat_interleave(group, dim=1)
    logits = torch.einsum("bhd,thd->bht", q, k) * batch.sm_scale
    kv_req = Segments.of(batch.kv_indptr).ids
    same = torch.arange(q.shape[0])[:, None] == kv_req[None, :]
    if sliding:
        from_end = batch.kv_indptr.long()[1:][kv_req] - torch.arange(k.shape[0])  # 1 = a row's last key
        same &= from_end[None, :] <= sliding
    probs = torch.softmax(logits.masked_fill(~same[:, None, :], float("-inf")), dim=-1)
    probs = torch.nan_to_num(probs)  # a request with no keys: zero output, nothing scored
    o_dense = torch.einsum("bht,thd->bhd", probs, v)
    init = torch.rand(batch.k_buf.shape[:2], dtype=torch.float64)
    expected_scores = init.clone()
    expected_scores[batch.kv_indices] += probs.sum(0).unflatten(0, (heads, group)).sum(1).T
    score_buf = init.clone()
    o = decode_attention_with_scores_torch(
        q, batch.k_buf, batch.v_buf, kv_lens_of(batch), as_table(batch), score_buf, batch.sm_scale, window=sliding
    )
    assert rel_error(o, o_dense) <= REL
    assert rel_error(score_buf, expected_scores) <= REL
