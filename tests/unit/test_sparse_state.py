"""SparseState (the aux cache of the sparse layers) and the sparse layer forward, without SGLang."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kvsparse.config import SparsityConfig
from sglang_kvsparse.index_map import IndexMapError
from sglang_kvsparse.sparse_attention import sparse_decode, sparse_extend
from sglang_kvsparse.sparse_state import SparseState

H_KV, G, D = 2, 3, 8


def make_state(num_layers=4, context=64, slots=256, page=1, max_requests=8, budget=None, window=2):
    config = SparsityConfig(full_layers=(0,), budget=budget or context, sink=1, window=window, pool_kernel=1)  # no pooling: no score ties
    resolved = config.resolve(num_layers, context)
    return SparseState(
        resolved,
        slots_per_layer=slots,
        max_requests=max_requests,
        num_kv_heads=H_KV,
        head_dim=D,
        dtype=torch.float32,
        dense_capacity=slots,
        page_size=page,
    )


def grow(state: SparseState, rows, lengths) -> None:
    state.alloc_to_lengths(req_pool_indices_cpu=torch.tensor(rows), target_seq_lens_cpu=torch.tensor(lengths))


def test_groups_share_one_map_and_layers_have_own_buffers():
    state = make_state()
    assert state.is_sparse(1) and not state.is_sparse(0)
    assert len(state.maps) == 1 and set(state.group_of) == {1, 2, 3}
    assert state.buffers[1].k.data_ptr() != state.buffers[2].k.data_ptr()
    assert state.buffers[1].k.shape == (257, H_KV, D) and state.buffers[1].scores.dtype == torch.float32


def test_prefill_then_decode_then_free_returns_every_slot():
    state = make_state(page=4)
    grow(state, [1, 2], [5, 3])
    assert state.maps[0].length(1) == 5 and state.maps[0].length(2) == 3
    grow(state, [1, 2], [6, 4])
    assert state.stats()["requests_running"] == 2
    state.free(1)
    state.free(2)
    state.free(3)  # never allocated: a no-op, as SGLang frees rows whose aux alloc never ran
    pool = state.stats()["pools"][0]
    assert pool["free_slots"] == pool["initial_free_slots"] == 256


def test_refuses_jumps_and_full_rows_without_partial_state():
    state = make_state(num_layers=4, context=64, budget=8)  # max_entries = budget + evict_page 16
    grow(state, [1, 2], [4, 30])
    assert state.maps[0].length(2) == 8  # a prefill keeps min(length, budget)
    with pytest.raises(IndexMapError, match="one decode token"):
        grow(state, [1], [6])
    for n in range(31, 31 + 16):
        grow(state, [2], [n])
    with pytest.raises(IndexMapError, match="decode eviction"):
        grow(state, [1, 2], [5, 47])
    assert state.maps[0].length(1) == 4 and state.maps[0].length(2) == 24


def test_plan_extend_refuses_a_cached_prefix():
    state = make_state()
    grow(state, [1], [4])
    with pytest.raises(IndexMapError, match="prefix"):
        state.plan_extend([1], [2], [2])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "decode", "free"]), st.integers(1, 7), st.integers(1, 12)), max_size=40))
def test_slot_conservation_under_random_lifecycles(ops):
    state = make_state(page=2, slots=64)
    index_map = state.maps[0]
    for op, row, length in ops:
        try:
            if op == "new" and not index_map.is_active(row):
                grow(state, [row], [length])
            elif op == "decode" and index_map.is_active(row):
                grow(state, [row], [index_map.length(row) + 1])
            elif op == "free":
                state.free(row)
        except IndexMapError:
            pass  # exhausted pool: the state must be unchanged, checked below
        held = sum(-(-index_map.length(r) // 2) * 2 for r in index_map.active_rows())
        assert index_map.pool.slots_in_use() == held
    state.clear()
    assert index_map.pool.available_slots() == 64


def dense_attention(q, k, v, scale, causal):
    """float64 softmax attention of one request: q [T, Hq, D], k/v [L, Hkv, D]."""
    k = k.double().repeat_interleave(G, dim=1)
    v = v.double().repeat_interleave(G, dim=1)
    logits = torch.einsum("thd,lhd->htl", q.double(), k) * scale
    if causal:
        t, n = q.shape[0], k.shape[0]
        mask = torch.arange(n)[None, :] > (n - t + torch.arange(t))[:, None]
        logits = logits.masked_fill(mask, float("-inf"))
    return torch.einsum("htl,lhd->thd", logits.softmax(-1), v)


def test_sparse_forward_matches_dense_attention_and_stores_kv():
    torch.manual_seed(0)
    state = make_state()
    lengths = [5, 3]
    grow(state, [1, 2], lengths)
    plan = state.plan_extend([1, 2], [0, 0], lengths)
    group = state.group_plan(plan, 2)
    total = sum(lengths)
    q, k, v = torch.randn(total, H_KV * G, D), torch.randn(total, H_KV, D), torch.randn(total, H_KV, D)
    o = sparse_extend(q, k, v, 0.3, plan, group, state.buffers[2], state.policy)
    assert torch.allclose(o[:5].double(), dense_attention(q[:5], k[:5], v[:5], 0.3, True), atol=1e-5)
    assert torch.allclose(o[5:].double(), dense_attention(q[5:], k[5:], v[5:], 0.3, True), atol=1e-5)
    assert torch.equal(state.buffers[2].k[state.maps[0].slots(2)], k[5:])

    grow(state, [1, 2], [6, 4])
    plan = state.plan_decode([1, 2])
    group = state.group_plan(plan, 2)
    qd, kd, vd = torch.randn(2, H_KV * G, D), torch.randn(2, H_KV, D), torch.randn(2, H_KV, D)
    od = sparse_decode(qd, kd, vd, 0.3, group, state.buffers[2])
    keys = torch.cat([k[5:], kd[1:]])
    values = torch.cat([v[5:], vd[1:]])
    assert torch.allclose(od[1:].double(), dense_attention(qd[1:], keys, values, 0.3, False), atol=1e-5)
    scores = state.buffers[2].scores[state.maps[0].slots(2)]
    assert torch.allclose(scores.sum(), torch.tensor(float(H_KV * G)), atol=1e-4)  # each head's mass is 1


def test_prefill_compression_keeps_protected_and_best_scored_keys_per_head():
    torch.manual_seed(1)
    budget, sink, window = 8, 1, 2
    state = make_state(budget=budget, window=window)
    lengths = [5, 20]  # the first fits its budget, the second is compressed to 8
    grow(state, [1, 2], lengths)
    plan = state.plan_extend([1, 2], [0, 0], lengths)
    group = state.group_plan(plan, 1)
    assert group.compress and group.budget == budget
    total = sum(lengths)
    q, k, v = torch.randn(total, H_KV * G, D), torch.randn(total, H_KV, D), torch.randn(total, H_KV, D)
    o = sparse_extend(q, k, v, 0.3, plan, group, state.buffers[1], state.policy)
    # Compression never changes the prefill's own output.
    assert torch.allclose(o[5:].double(), dense_attention(q[5:], k[5:], v[5:], 0.3, True), atol=1e-5)

    from sglang_kvsparse.policies import PrefillScoringInputs

    _, lse = __import__("sglang_kvsparse.kernels", fromlist=["x"]).extend_attention_with_stats(
        q, k, v, plan.qo_indptr, plan.qo_indptr, torch.arange(total), 0.3
    )
    scores = state.policy.score(
        PrefillScoringInputs(q, k, lse, plan.qo_indptr, plan.qo_indptr, torch.arange(total), 0.3, window)
    )
    buffers = state.buffers[1]
    assert torch.equal(buffers.k[state.maps[0].slots(1)], k[:5])  # short row: everything, in order
    slots = state.maps[0].slots(2)
    for h in range(H_KV):
        rest = sorted(range(sink, 20 - window), key=lambda p: -float(scores[5 + p, h]))
        expected = sorted([*range(sink), *range(20 - window, 20), *rest[: budget - sink - window]])
        assert torch.equal(buffers.k[slots, h], k[[5 + p for p in expected], h]), h
        assert torch.equal(buffers.v[slots, h], v[[5 + p for p in expected], h])
        assert torch.equal(buffers.scores[slots, h], scores[[5 + p for p in expected], h])
