"""SparseState (the aux cache of the sparse layers) and the sparse layer forward, without SGLang."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kvsparse.config import SparsityConfig
from sglang_kvsparse.index_map import IndexMapError, SlotPoolExhausted
from sglang_kvsparse.sparse_attention import sparse_decode, sparse_extend
from sglang_kvsparse.sparse_state import SparseState

H_KV, G, D = 2, 3, 8


def make_state(
    num_layers=4, context=64, slots=256, page=1, max_requests=8, budget=None, window=2, evict_page=16,
    prefix_cache=False, pool_kernel=1,
):
    config = SparsityConfig(  # pool_kernel 1: no pooling, so no score ties
        full_layers=(0,), budget=budget or context, sink=1, window=window, pool_kernel=pool_kernel,
        evict_page=evict_page,
    )
    resolved = config.resolve(num_layers, context)
    return SparseState(
        resolved,
        slots_per_layer={layer: slots for layer in resolved.sparse_layers},
        max_requests=max_requests,
        num_kv_heads=H_KV,
        head_dim=D,
        dtype=torch.float32,
        dense_capacity=slots,
        page_size=page,
        prefix_cache=prefix_cache,
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


def test_refuses_jumps_and_exhaustion_without_partial_state():
    state = make_state(num_layers=4, context=64, budget=8, slots=16)
    grow(state, [1, 2], [4, 30])
    assert state.maps[0].length(2) == 8  # a prefill keeps min(length, budget)
    with pytest.raises(IndexMapError, match="one decode token"):
        grow(state, [1], [6])
    with pytest.raises(SlotPoolExhausted):
        grow(state, [1, 2, 3], [5, 31, 8])  # 1 + 1 + 8 slots, 4 free
    assert state.maps[0].length(1) == 4 and state.maps[0].length(2) == 8
    assert not state.maps[0].is_active(3) and state.maps[0].pool.available_slots() == 4


def test_decode_eviction_bounds_rows_and_keeps_protected_and_best_scored_entries():
    torch.manual_seed(2)
    budget, sink, window, evict_page = 8, 1, 2, 4
    state = make_state(budget=budget, window=window, evict_page=evict_page)
    index_map, buffers = state.maps[0], state.buffers[1]
    grow(state, [1, 2], [20, 3])
    for n in range(1, evict_page + 1):  # row 1 grows to budget + evict_page entries
        grow(state, [1, 2], [20 + n, 3 + n])
        state.plan_decode([1, 2])
    assert index_map.length(1) == budget + evict_page
    old = index_map.slots(1)
    buffers.k[old] = torch.randn(old.numel(), H_KV, D)
    buffers.v[old] = torch.randn(old.numel(), H_KV, D)
    buffers.scores[old] = torch.rand(old.numel(), H_KV)
    k_old, v_old, s_old = buffers.k[old].clone(), buffers.v[old].clone(), buffers.scores[old].clone()

    grow(state, [1, 2], [25, 8])
    assert index_map.length(1) == budget + 1 and index_map.length(2) == 8  # row 2 is below its budget
    plan = state.plan_decode([1, 2])
    group = state.group_plan(plan, 1)
    assert group.evict_slots.shape == (1, budget + evict_page)
    qd, kd, vd = torch.randn(2, H_KV * G, D), torch.randn(2, H_KV, D), torch.randn(2, H_KV, D)
    od = sparse_decode(qd, kd, vd, 0.3, plan, group, buffers)

    slots = index_map.slots(1)
    n_old = budget + evict_page
    for h in range(H_KV):
        rest = sorted(range(sink, n_old - window), key=lambda p: -float(s_old[p, h]))
        expected = sorted([*range(sink), *range(n_old - window, n_old), *rest[: budget - sink - window]])
        assert torch.equal(buffers.k[slots[:budget], h], k_old[expected, h]), h
        assert torch.equal(buffers.v[slots[:budget], h], v_old[expected, h])
        keys = torch.cat([k_old[expected, h], kd[0:1, h]])
        values = torch.cat([v_old[expected, h], vd[0:1, h]])
        heads = slice(h * G, (h + 1) * G)
        want = dense_attention(qd[0:1, heads], keys[:, None], values[:, None], 0.3, False)
        assert torch.allclose(od[0, heads].double(), want[0], atol=1e-5)
    assert torch.equal(buffers.k[slots[budget]], kd[0])
    assert state.stats()["evictions"] == 1
    with pytest.raises(IndexMapError, match="not in this decode batch"):
        for n in range(26, 26 + evict_page):
            grow(state, [1], [n])
        state.plan_decode([2])


def test_plan_extend_refuses_a_cached_prefix_without_a_store():
    state = make_state()
    grow(state, [1], [4])
    with pytest.raises(IndexMapError, match="prefix"):
        state.plan_extend([1], [2], [2])


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "decode", "free"]), st.integers(1, 7), st.integers(1, 12)), max_size=40))
def test_slot_conservation_under_random_lifecycles(ops):
    state = make_state(page=2, slots=64, budget=4, window=1, evict_page=2)
    index_map = state.maps[0]
    for op, row, length in ops:
        try:
            if op == "new" and not index_map.is_active(row):
                grow(state, [row], [length])
            elif op == "decode" and index_map.is_active(row):
                grow(state, [row], [state.logical[row] + 1])
                state.plan_decode([row])  # hands over the eviction alloc may have made
            elif op == "free":
                state.free(row)
        except IndexMapError:
            pass  # exhausted pool: the state must be unchanged, checked below
        held = sum(-(-index_map.length(r) // 2) * 2 for r in index_map.active_rows())
        assert index_map.pool.slots_in_use() == held
        assert all(index_map.length(r) <= index_map.max_entries for r in index_map.active_rows())
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
    od = sparse_decode(qd, kd, vd, 0.3, plan, group, state.buffers[2])
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


def test_stats_report_bytes_held_beside_dense_and_every_layer():
    state = make_state(num_layers=4, context=64, budget=8)
    grow(state, [1, 2], [30, 5])
    stats = state.stats()
    bpt = 2 * H_KV * D * 4
    slot_bytes = bpt + 4 * H_KV
    assert stats["requests_running"] == 2
    assert stats["kv_bytes_if_dense"] == (30 + 5) * 4 * bpt
    assert stats["kv_bytes_in_use"] == (30 + 5) * 1 * bpt + (8 + 5) * 3 * slot_bytes
    full, sparse = stats["layers"][0], stats["layers"][1]
    assert (full["kind"], full["slots_in_use"], full["slots_total"]) == ("full", 35, 256)
    assert (sparse["kind"], sparse["budget"], sparse["slots_in_use"], sparse["slots_total"]) == ("sparse", 8, 13, 256)


# -- prefix reuse through the prefix store -------------------------------------------------------


def prefill(state, rows, prefix_lens, extend_lens, prefix_ids, new_ids, q, k, v, layer=1):
    """Allocate and run one sparse layer's prefill (the backend's order: alloc, plan, forward)."""
    grow(state, rows, [p + e for p, e in zip(prefix_lens, extend_lens)])
    plan = state.plan_extend(rows, prefix_lens, extend_lens, prefix_ids, new_ids)
    return sparse_extend(q, k, v, 0.3, plan, state.group_plan(plan, layer), state.buffers[layer], state.policy)


def row_entries(state, row, layer=1):
    slots = state.maps[0].slots(row)
    buffers = state.buffers[layer]
    return buffers.k[slots], buffers.v[slots], buffers.scores[slots]


@pytest.mark.parametrize(("budget", "page"), [(8, 1), (64, 1), (8, 2)])
def test_a_prefix_hit_attends_scores_and_keeps_exactly_as_the_fresh_prefill(budget, page):
    """Two sequences (30 and 19 tokens) prefilled fresh, then again reusing cached prefixes of 16
    and 8 tokens: the new tokens' outputs match, and each row keeps the same K/V and scores."""
    torch.manual_seed(3)
    lengths, prefixes = [30, 19], [16, 8]
    seqs = [(torch.randn(n, H_KV * G, D), torch.randn(n, H_KV, D), torch.randn(n, H_KV, D)) for n in lengths]
    ids = [torch.arange(1, 31), torch.arange(31, 50)]  # SGLang's full-pool ids of the cached tokens
    # pool_kernel 3: pooling reads neighbours across the prefix boundary too.
    state = make_state(budget=budget, window=2, page=page, prefix_cache=True, pool_kernel=3)
    q, k, v = (torch.cat(parts) for parts in zip(*seqs))
    fresh = prefill(state, [1, 2], [0, 0], lengths, [torch.empty(0), torch.empty(0)], torch.cat(ids), q, k, v)
    kept = [row_entries(state, row) for row in (1, 2)]
    assert state.stats()["pools"][0]["prefix_cache_slots"] == sum(-(-n // page) * page for n in lengths)
    state.free(1)
    state.free(2)

    new_ids = torch.cat([torch.arange(100, 114), torch.arange(200, 211)])
    part = [slice(p, n) for p, n in zip(prefixes, lengths)]
    q2, k2, v2 = (torch.cat([t[sl] for t, sl in zip(ts, part)]) for ts in zip(*seqs))
    state.begin_round()
    state.pin_prefix(torch.cat([ids[0][:16], ids[1][:8]]))
    hit = prefill(state, [3, 4], prefixes, [14, 11], [ids[0][:16], ids[1][:8]], new_ids, q2, k2, v2)
    assert torch.allclose(hit[:14], fresh[16:30], atol=1e-5) and torch.allclose(hit[14:], fresh[30 + 8 :], atol=1e-5)
    for row, (k_kept, v_kept, s_kept) in zip((3, 4), kept):
        k_hit, v_hit, s_hit = row_entries(state, row)
        assert torch.equal(k_hit, k_kept) and torch.equal(v_hit, v_kept)
        assert torch.allclose(s_hit, s_kept, atol=1e-6)
    stats = state.stats()
    assert (stats["prefix_hits"], stats["prefix_tokens_reused"]) == (2, 24)
    # The new tokens are stored too, so a third request could reuse all of sequence 2.
    assert state.stores[0].valid_prefix_len(torch.cat([ids[1][:8], torch.arange(200, 211)])) == 19


def test_rows_reclaim_the_stores_pages_but_never_pinned_ones():
    state = make_state(slots=24, budget=8, prefix_cache=True)
    store, pool = state.stores[0], state.maps[0].pool
    q, k, v = torch.randn(12, H_KV * G, D), torch.randn(12, H_KV, D), torch.randn(12, H_KV, D)
    prefill(state, [1], [0], [12], [torch.empty(0)], torch.arange(1, 13), q, k, v)
    state.free(1)
    assert store.slots() == 12 and pool.available_slots() == 12
    assert state.available_pages(0) == 24  # admission counts the store's pages as free

    state.begin_round()
    state.pin_prefix(torch.arange(1, 7))  # a request reusing 6 tokens is admitted
    assert state.available_pages(0) == 18
    with pytest.raises(SlotPoolExhausted):
        grow(state, [2, 3, 4], [8, 8, 8])  # 24 slots needed, 18 free or evictable
    grow(state, [2, 3], [8, 8])  # the 12 free slots, and 4 evicted entries: the tail's
    assert store.slots() == 8 and pool.available_slots() == 0
    assert store.valid_prefix_len(torch.arange(1, 13)) == 8
    state.free(2)
    state.free(3)
    state.clear()  # SGLang's flush
    assert store.slots() == 0 and pool.available_slots() == 24


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["new", "decode", "free"]), st.integers(1, 7), st.integers(1, 12),
                          st.integers(0, 5)), max_size=40))
def test_slot_conservation_with_the_prefix_store(ops):
    """Random prefills (some reusing an earlier sequence's cached prefix), decodes and frees: the
    pool's used slots are always the rows' pages plus the store's, and every reused prefix is
    found in the store."""
    state = make_state(page=2, slots=48, budget=4, window=1, evict_page=2, prefix_cache=True)
    index_map, store = state.maps[0], state.stores[0]
    sequences: list[torch.Tensor] = []  # full-pool ids of earlier prompts
    next_id = 1
    for op, row, length, pick in ops:
        if op == "new" and not index_map.is_active(row):
            prefix = sequences[pick % len(sequences)] if sequences else torch.empty(0, dtype=torch.int64)
            reuse = state.reusable_prefix_len(prefix[: length - 1], length)
            prefix = prefix[:reuse]
            state.begin_round()
            state.pin_prefix(prefix)
            try:
                grow(state, [row], [length])
            except SlotPoolExhausted:
                continue  # admission would have refused it; nothing changed (checked below)
            new = torch.arange(next_id, next_id + length - reuse)
            next_id += length - reuse
            plan = state.plan_extend([row], [reuse], [length - reuse], [prefix], new)
            assert state.group_plan(plan, 1).prefix_slots.numel() == reuse
            sequences.append(torch.cat([prefix, new]))
        elif op == "decode" and index_map.is_active(row):
            try:
                grow(state, [row], [state.logical[row] + 1])
            except SlotPoolExhausted:
                continue
            state.plan_decode([row], torch.tensor([next_id]))
            next_id += 1
        elif op == "free":
            state.free(row)
        held = sum(-(-index_map.length(r) // 2) * 2 for r in index_map.active_rows())
        assert index_map.pool.slots_in_use() == held + store.slots()
    state.clear()
    assert index_map.pool.available_slots() == 48
