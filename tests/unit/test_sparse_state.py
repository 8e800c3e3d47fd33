"""SparseState (the aux cache of the sparse layers) on a heap, and the sparse layer forward,
without SGLang."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_kvsparse import kernels
from sglang_kvsparse.config.request_sparsity import SERVER_SETTING, RequestSparsity
from sglang_kvsparse.forward.eviction import evict_planned
from sglang_kvsparse.forward.planning import plan_decode, plan_extend
from sglang_kvsparse.forward.sparse_attention import KVScales, sparse_decode, sparse_extend
from sglang_kvsparse.kernels.common import quantize
from sglang_kvsparse.policies import PrefillScoringInputs
from sglang_kvsparse.server.stats import collect, table_warning
from sglang_kvsparse.state.entry_table import HeapError, HeapExhausted
from sglang_kvsparse.state.requests import Phase

from .heap import H_KV, D, assert_device_tables_mirror_the_host, grow, make_state

G = 3  # query heads per KV head


def lane_of(state, layer):
    place = state.layout.layer_places[layer]
    return state.lanes[place.lane], place


def entries(state, req_idx, layer):
    """The request's heap rows in `layer`'s column."""
    place = state.layout.layer_places[layer]
    return state.groups[place.group].table.entries(req_idx)[:, place.column]


def score_slots(state, req_idx, layer, n):
    """The score slots of the request's first n entries in `layer`'s column."""
    place = state.layout.layer_places[layer]
    group = state.groups[place.group]
    return group.score_slots(torch.full((n,), req_idx), torch.arange(n))[:, place.column]


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


def test_columns_share_rows_and_layers_in_a_column_have_their_own_lanes():
    state, _ = make_state(num_layers=6, full_layers=(0, 1))
    assert state.layout.lanes == 2 and len(state.groups) == 1 and state.groups[0].columns == 2
    a, slot_a = lane_of(state, 2)
    b, slot_b = lane_of(state, 3)
    assert slot_a.column == slot_b.column and a.k.data_ptr() != b.k.data_ptr()
    assert a.k.shape == (257, H_KV, D) and a.scores.dtype == torch.float32


def test_prefill_then_decode_then_free_returns_every_row():
    state, heap = make_state(page=4)
    grow(state, [1, 2], [5, 3])
    assert state.groups[0].table.count(1) == 5 and heap.free_rows() == 256 - 3 * (8 + 4)
    grow(state, [1, 2], [6, 4])
    assert state.requests_running() == 2
    state.free(1)
    state.free(2)
    state.free(3)  # never allocated: a no-op, as SGLang frees rows whose aux alloc never ran
    assert heap.free_rows() == 256


def test_refuses_jumps_and_exhaustion_without_partial_state():
    state, heap = make_state(num_layers=4, context=64, budget=8, rows=64)  # max_entries 24
    state.expect([1, 2], [6, 31])  # request 2 will evict: 3 score rows per column (8 entries a row)
    grow(state, [1, 2], [4, 30])
    assert state.groups[0].table.count(2) == 8  # a prefill keeps min(length, budget)
    assert heap.free_rows() == 64 - (4 + 8) * 3 - 3 * 3
    with pytest.raises(HeapError, match="one decode token"):
        grow(state, [1], [6])
    state.expect([3], [8])  # SGLang gives request 3 its index, then fails to allocate its tokens
    with pytest.raises(HeapExhausted):
        grow(state, [1, 2, 3], [5, 31, 8])  # (1 + 1 + 8) entries + 3 score rows x 3 columns, 19 free
    assert state.groups[0].table.count(1) == 4 and state.groups[0].table.count(2) == 8
    assert not state.groups[0].table.is_active(3) and heap.free_rows() == 19
    assert state.requests.phase[[1, 2, 3]].tolist() == [Phase.PREFILLING, Phase.PREFILLING, Phase.ADMITTED]


def test_a_step_evicts_every_layer_on_every_lane_as_each_layer_alone_would():
    """Two lanes (layers 0 and 1 full), five sparse layers in three columns (the last on lane 0
    only), requests at two budgets evicting in the same step: one `Eviction` per budget covers
    every layer, and each layer, request and KV head keeps its sink, its window and its
    best-scored rest (of equal scores the earlier), moved with their scores into its first rows."""
    torch.manual_seed(3)
    window, evict_page = 2, 4
    state, _ = make_state(
        num_layers=7,
        full_layers=(0, 1),
        budget=8,
        window=window,
        evict_page=evict_page,
        rows=1024,
        max_request_budget=12,
    )
    assert [len(column.layers) for column in state.groups[0].spec.columns] == [2, 2, 1]
    rows, budgets = [1, 2, 3], {1: 8, 2: 8, 3: 12}
    state.expect(rows, [60] * 3, None, [SERVER_SETTING, SERVER_SETTING, RequestSparsity(budget=12)])
    lengths = [20, 20, 20]
    grow(state, rows, lengths)
    for _ in range(evict_page):  # every request grows to its budget + evict_page
        lengths = [n + 1 for n in lengths]
        grow(state, rows, lengths)
        assert not plan_decode(state, rows).evictions
        state.finish_forward()
    before = {}
    for layer in state.layout.layer_places:
        lane, _ = lane_of(state, layer)
        for req_idx in rows:
            old = entries(state, req_idx, layer)
            slots = score_slots(state, req_idx, layer, old.numel())
            lane.k[old] = torch.randn(old.numel(), H_KV, D)
            lane.v[old] = torch.randn(old.numel(), H_KV, D)
            lane.scores[slots] = torch.randint(0, 4, (old.numel(), H_KV)).float()  # many ties
            before[layer, req_idx] = (old, lane.k[old].clone(), lane.v[old].clone(), lane.scores[slots].clone())
    grow(state, rows, [n + 1 for n in lengths])
    plan = plan_decode(state, rows)
    assert sorted((e.budget, tuple(e.slots.shape)) for e in plan.evictions) == [(8, (3, 2, 12)), (12, (3, 1, 16))]
    evict_planned(plan, state.layout, state.lanes, state.policy)
    sink = state.config.sink
    for (layer, req_idx), (old, k_old, v_old, s_old) in before.items():
        lane, _ = lane_of(state, layer)
        budget, n_old = budgets[req_idx], old.numel()
        kept = entries(state, req_idx, layer)[:budget]
        assert torch.equal(kept, old[:budget])  # the request's first rows, in place
        for h in range(H_KV):
            rest = sorted(range(sink, n_old - window), key=lambda p: (-float(s_old[p, h]), p))
            expected = sorted([*range(sink), *range(n_old - window, n_old), *rest[: budget - sink - window]])
            assert torch.equal(lane.k[kept, h], k_old[expected, h]), (layer, req_idx, h)
            assert torch.equal(lane.v[kept, h], v_old[expected, h]), (layer, req_idx, h)
            assert torch.equal(lane.scores[score_slots(state, req_idx, layer, budget), h], s_old[expected, h])
    state.finish_forward()


def test_decode_eviction_bounds_rows_and_keeps_protected_and_best_scored_entries():
    torch.manual_seed(2)
    budget, sink, window, evict_page = 8, 1, 2, 4
    state, heap = make_state(budget=budget, window=window, evict_page=evict_page)
    table = state.groups[0].table
    lane, place = lane_of(state, 1)
    grow(state, [1, 2], [20, 3])
    for n in range(1, evict_page + 1):  # request 1 grows to budget + evict_page entries
        grow(state, [1, 2], [20 + n, 3 + n])
        plan_decode(state, [1, 2])
        state.finish_forward()
    assert table.count(1) == budget + evict_page
    old = entries(state, 1, 1)
    old_scores = score_slots(state, 1, 1, old.numel())
    assert bool((old_scores >= (256 + 1) * 0).all()) and old_scores.unique().numel() == old.numel()
    lane.k[old] = torch.randn(old.numel(), H_KV, D)
    lane.v[old] = torch.randn(old.numel(), H_KV, D)
    lane.scores[old_scores] = torch.rand(old.numel(), H_KV)
    k_old, v_old, s_old = lane.k[old].clone(), lane.v[old].clone(), lane.scores[old_scores].clone()

    free_before = heap.free_rows()
    grow(state, [1, 2], [25, 8])
    assert table.count(1) == budget + 1 and table.count(2) == 8  # request 2 is below its budget
    # The evicted pages stay out of the heap until the forward that reads them was issued.
    assert heap.free_rows() == free_before - 2 * 3 and state.heap.deferred_rows() == evict_page * 3
    plan = plan_decode(state, [1, 2])
    column = plan.column(place)
    (eviction,) = plan.evictions
    assert eviction.budget == budget and eviction.slots.shape == (3, 1, budget + evict_page)
    qd, kd, vd = torch.randn(2, H_KV * G, D), torch.randn(2, H_KV, D), torch.randn(2, H_KV, D)
    evict_planned(plan, state.layout, state.lanes, state.policy)
    od = sparse_decode(qd, kd, vd, 0.3, plan, column, lane, state.policy, torch.tensor([24, 7]))
    state.finish_forward()
    assert heap.free_rows() == free_before - 2 * 3 + evict_page * 3

    rows = entries(state, 1, 1)
    n_old = budget + evict_page
    for h in range(H_KV):
        rest = sorted(range(sink, n_old - window), key=lambda p: -float(s_old[p, h]))
        expected = sorted([*range(sink), *range(n_old - window, n_old), *rest[: budget - sink - window]])
        assert torch.equal(lane.k[rows[:budget], h], k_old[expected, h]), h
        assert torch.equal(lane.v[rows[:budget], h], v_old[expected, h])
        keys = torch.cat([k_old[expected, h], kd[0:1, h]])
        values = torch.cat([v_old[expected, h], vd[0:1, h]])
        heads = slice(h * G, (h + 1) * G)
        want = dense_attention(qd[0:1, heads], keys[:, None], values[:, None], 0.3, False)
        assert torch.allclose(od[0, heads].double(), want[0], atol=1e-5)
    assert torch.equal(lane.k[rows[budget]], kd[0])
    assert state.counters.evictions == 1
    with pytest.raises(HeapError, match="not in this decode batch"):
        for n in range(26, 26 + evict_page):
            grow(state, [1], [n])
        plan_decode(state, [2])


def test_plan_extend_refuses_a_cached_prefix_without_a_store():
    state, _ = make_state()
    grow(state, [1], [4])
    with pytest.raises(HeapError, match="prefix"):
        plan_extend(state, [1], [2], [2])


def test_sparse_forward_matches_dense_attention_and_stores_kv():
    torch.manual_seed(0)
    state, _ = make_state(budget=32)  # the rows may outgrow it (final lengths unknown): they keep scores
    lengths = [5, 3]
    grow(state, [1, 2], lengths)
    plan = plan_extend(state, [1, 2], [0, 0], lengths)
    lane, place = lane_of(state, 2)
    total = sum(lengths)
    q, k, v = torch.randn(total, H_KV * G, D), torch.randn(total, H_KV, D), torch.randn(total, H_KV, D)
    o = sparse_extend(q, k, v, 0.3, plan, plan.column(place), lane, state.policy)
    assert torch.allclose(o[:5].double(), dense_attention(q[:5], k[:5], v[:5], 0.3, True), atol=1e-5)
    assert torch.allclose(o[5:].double(), dense_attention(q[5:], k[5:], v[5:], 0.3, True), atol=1e-5)
    assert torch.equal(lane.k[entries(state, 2, 2)], k[5:])

    grow(state, [1, 2], [6, 4])
    plan = plan_decode(state, [1, 2])
    qd, kd, vd = torch.randn(2, H_KV * G, D), torch.randn(2, H_KV, D), torch.randn(2, H_KV, D)
    od = sparse_decode(qd, kd, vd, 0.3, plan, plan.column(place), lane, state.policy, torch.tensor([5, 3]))
    keys = torch.cat([k[5:], kd[1:]])
    values = torch.cat([v[5:], vd[1:]])
    assert torch.allclose(od[1:].double(), dense_attention(qd[1:], keys, values, 0.3, False), atol=1e-5)
    scores = lane.scores[score_slots(state, 2, 2, 4)]
    assert torch.allclose(scores.sum(), torch.tensor(float(H_KV * G)), atol=1e-4)  # each head's mass is 1


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("scales", [KVScales(), KVScales(0.05, 3.0)])
def test_fp8_lanes_attend_over_what_they_store(fmt, scales):
    """FP8 lanes: the new tokens' K/V are quantized once (divided by the layer's scales), stored
    as such, and every attention reads those values back times the scales, as a layer of an FP8
    pool reads back what it wrote."""
    torch.manual_seed(2)
    state, _ = make_state(budget=32, dtype=fmt, head_dim=16)
    lengths = [5, 3]
    grow(state, [1, 2], lengths)
    plan = plan_extend(state, [1, 2], [0, 0], lengths)
    lane, place = lane_of(state, 2)
    total = sum(lengths)
    q, k, v = torch.randn(total, H_KV * G, 16), torch.randn(total, H_KV, 16), torch.randn(total, H_KV, 16)
    o = sparse_extend(q, k, v, 0.3, plan, plan.column(place), lane, state.policy, scales=scales)
    kq, vq = quantize(k, fmt, scales.k), quantize(v, fmt, scales.v)
    real_k, real_v = kq.float() * scales.k, vq.float() * scales.v
    assert torch.allclose(o[:5].double(), dense_attention(q[:5], real_k[:5], real_v[:5], 0.3, True), atol=1e-5)
    assert torch.equal(lane.k[entries(state, 2, 2)].view(torch.uint8), kq[5:].view(torch.uint8))

    grow(state, [1, 2], [6, 4])
    plan = plan_decode(state, [1, 2])
    qd, kd, vd = torch.randn(2, H_KV * G, 16), torch.randn(2, H_KV, 16), torch.randn(2, H_KV, 16)
    od = sparse_decode(
        qd, kd, vd, 0.3, plan, plan.column(place), lane, state.policy, torch.tensor([5, 3]), scales=scales
    )
    keys = torch.cat([real_k[5:], quantize(kd[1:], fmt, scales.k).float() * scales.k])
    values = torch.cat([real_v[5:], quantize(vd[1:], fmt, scales.v).float() * scales.v])
    assert torch.allclose(od[1:].double(), dense_attention(qd[1:], keys, values, 0.3, False), atol=1e-5)


def test_prefill_compression_keeps_protected_and_best_scored_keys_per_head():
    torch.manual_seed(1)
    budget, sink, window = 8, 1, 2
    state, _ = make_state(budget=budget, window=window)
    lengths = [5, 20]  # the first fits its budget, the second is compressed to 8
    grow(state, [1, 2], lengths)
    plan = plan_extend(state, [1, 2], [0, 0], lengths)
    lane, place = lane_of(state, 1)
    column = plan.column(place)
    assert column.compress and column.budgets.tolist() == [budget, budget]
    total = sum(lengths)
    q, k, v = torch.randn(total, H_KV * G, D), torch.randn(total, H_KV, D), torch.randn(total, H_KV, D)
    o = sparse_extend(q, k, v, 0.3, plan, column, lane, state.policy)
    # Compression never changes the prefill's own output.
    assert torch.allclose(o[5:].double(), dense_attention(q[5:], k[5:], v[5:], 0.3, True), atol=1e-5)

    _, lse = kernels.extend_attention_with_stats(q, k, v, plan.qo_indptr, plan.qo_indptr, torch.arange(total), 0.3)
    scores = state.policy.score(
        PrefillScoringInputs(q, k, lse, plan.qo_indptr, plan.keys, torch.arange(total), 0.3, window, sink)
    )
    assert torch.equal(lane.k[entries(state, 1, 1)], k[:5])  # short request: everything, in order
    rows, kept_scores = entries(state, 2, 1), score_slots(state, 2, 1, budget)
    for h in range(H_KV):
        rest = sorted(range(sink, 20 - window), key=lambda p: -float(scores[5 + p, h]))
        expected = sorted([*range(sink), *range(20 - window, 20), *rest[: budget - sink - window]])
        assert torch.equal(lane.k[rows, h], k[[5 + p for p in expected], h]), h
        assert torch.equal(lane.v[rows, h], v[[5 + p for p in expected], h])
        assert torch.equal(lane.scores[kept_scores, h], scores[[5 + p for p in expected], h])


def test_stats_report_rows_by_owner_and_bytes_beside_dense():
    state, heap = make_state(num_layers=4, context=64, budget=8)
    ids = heap.sglang_alloc(35)  # SGLang's ids of the two requests' tokens
    state.expect([1, 2], [40, 5])  # the first will evict (max_entries 24): 3 score rows per column
    grow(state, [1, 2], [30, 5])
    stats = collect(state, heap.free_rows())
    bpt = 2 * H_KV * D * 4
    assert stats.requests_running == 2
    assert stats.kv_bytes_if_dense == (30 + 5) * 4 * bpt
    assert stats.kv_bytes_in_use == (35 + (8 + 5) * 3 + 3 * 3) * bpt  # one lane per row
    heap_stats = stats.heap
    assert (heap_stats.full_running, heap_stats.full_cached, heap_stats.sparse) == (35, 0, 48)
    assert heap_stats.free + 35 + 48 == heap_stats.rows_total == 256 and heap_stats.groups[0].score_rows == 9
    full, sparse = stats.layers[0], stats.layers[1]
    assert (full.kind, full.slots_in_use, full.slots_total) == ("full", 35, 256)
    assert (sparse.kind, sparse.budget, sparse.slots_in_use, sparse.slots_total) == ("sparse", 8, 13, 256)
    assert stats.to_dict()["heap"]["groups"][0]["columns"] == 3
    heap.sglang_free(ids)


# -- memory pressure: free rows, then the prefix store, then SGLang's radix tree ----------------


def prefill(state, rows, prefix_lens, extend_lens, prefix_ids, new_ids, q, k, v, layer=1):
    """Allocate and run one sparse layer's prefill (the backend's order: alloc, plan, forward)."""
    grow(state, rows, [p + e for p, e in zip(prefix_lens, extend_lens)])
    plan = plan_extend(state, rows, prefix_lens, extend_lens, prefix_ids, new_ids)
    lane, place = lane_of(state, layer)
    out = sparse_extend(q, k, v, 0.3, plan, plan.column(place), lane, state.policy)
    return out


def test_rows_come_from_free_rows_then_the_store_then_the_tree_never_from_pinned_blocks():
    state, heap = make_state(rows=96, budget=8, prefix_cache=True)  # 3 columns: 3 rows per token
    state.expect(list(range(8)), [24] * 8)  # no request outgrows max_entries: no score rows
    ids = heap.sglang_alloc(12)
    q, k, v = torch.randn(12, H_KV * G, D), torch.randn(12, H_KV, D), torch.randn(12, H_KV, D)
    prefill(state, [1], [0], [12], [torch.empty(0)], ids, q, k, v)
    state.finish_forward()
    state.free(1)
    heap.cached.append(ids[6:])  # the tree caches the prompt; its first 6 tokens are locked by a match
    assert state.store.rows() == 36 and heap.free_rows() == 96 - 12 - 36
    assert state.heap.reclaimable_rows() == 36  # admission counts the store's rows as free

    state.pin_prefix(ids[:6])  # the request that matched them is admitted: its prefill reads them
    assert state.heap.reclaimable_rows() == 18
    grow(state, [2, 3], [8, 8])  # 48 rows: the 48 free ones
    assert state.store.rows() == 36 and heap.cached
    grow(state, [4], [6])  # 18 more: the store's unpinned tail goes first
    assert state.store.valid_prefix_len(ids) == 6 and heap.cached
    grow(state, [5], [2])  # 6 more: the tree gives its unlocked ids back
    assert not heap.cached and state.store.valid_prefix_len(ids) == 6
    with pytest.raises(HeapExhausted):
        grow(state, [6], [1])  # nothing left but the pinned blocks
    assert state.store.valid_prefix_len(ids) == 6 and not state.groups[0].table.is_active(6)
    state.finish_forward()
    for req_idx in (2, 3, 4, 5):
        state.free(req_idx)
    state.clear()  # SGLang's flush
    heap.sglang_free(ids[:6])
    assert state.store.rows() == 0 and heap.free_rows() == 96


@pytest.mark.parametrize(
    ("budget", "page", "dtype"),
    [(8, 1, torch.float32), (64, 1, torch.float32), (8, 2, torch.float32), (8, 1, torch.float8_e4m3fn)],
)
def test_a_prefix_hit_attends_scores_and_keeps_exactly_as_the_fresh_prefill(budget, page, dtype):
    """Two sequences (30 and 19 tokens) prefilled fresh, then again reusing cached prefixes of 16
    and 8 tokens: the new tokens' outputs match, and each request keeps the same K/V and scores.
    In FP8 lanes the prefix is read back as stored, as the fresh prefill read its quantized K/V."""
    torch.manual_seed(3)
    lengths, prefixes = [30, 19], [16, 8]
    seqs = [(torch.randn(n, H_KV * G, D), torch.randn(n, H_KV, D), torch.randn(n, H_KV, D)) for n in lengths]
    # pool_kernel 3: pooling reads neighbours across the prefix boundary too.
    state, heap = make_state(
        budget=budget, window=2, page=page, prefix_cache=True, pool_kernel=3, rows=512, dtype=dtype
    )
    ids = [heap.sglang_alloc(-(-n // page) * page)[:n] for n in lengths]  # SGLang's ids of the tokens
    q, k, v = (torch.cat(parts) for parts in zip(*seqs))
    fresh = prefill(state, [1, 2], [0, 0], lengths, [torch.empty(0), torch.empty(0)], torch.cat(ids), q, k, v)
    state.finish_forward()
    lane = lane_of(state, 1)[0]

    def kept_by(req_idx: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The K/V and scores the request keeps in layer 1."""
        rows = entries(state, req_idx, 1)
        return lane.k[rows], lane.v[rows], lane.scores[score_slots(state, req_idx, 1, rows.numel())]

    kept = [kept_by(req_idx) for req_idx in (1, 2)]
    assert state.store.rows() == sum(-(-n // page) * page for n in lengths) * 3
    state.free(1)
    state.free(2)

    new_ids = torch.cat([heap.sglang_alloc(16)[:14], heap.sglang_alloc(12)[:11]])
    part = [slice(p, n) for p, n in zip(prefixes, lengths)]
    q2, k2, v2 = (torch.cat([t[sl] for t, sl in zip(ts, part)]) for ts in zip(*seqs))
    state.pin_prefix(torch.cat([ids[0][:16], ids[1][:8]]))
    hit = prefill(state, [3, 4], prefixes, [14, 11], [ids[0][:16], ids[1][:8]], new_ids, q2, k2, v2)
    assert torch.allclose(hit[:14], fresh[16:30], atol=1e-5) and torch.allclose(hit[14:], fresh[30 + 8 :], atol=1e-5)
    for req_idx, n, (k_kept, v_kept, s_kept) in zip((3, 4), lengths, kept):
        k_hit, v_hit, s_hit = kept_by(req_idx)
        assert torch.equal(k_hit.view(torch.uint8), k_kept.view(torch.uint8))
        assert torch.equal(v_hit.view(torch.uint8), v_kept.view(torch.uint8))
        assert torch.allclose(s_hit, s_kept, atol=1e-6)
        assert bool(s_kept.any()) == (n > budget)  # selected by score; kept whole, a decoded key's zero
    assert (state.counters.prefix_hits, state.counters.prefix_tokens_reused) == (2, 24)
    # The new tokens are stored too, so a third request could reuse all of sequence 2.
    assert state.store.valid_prefix_len(torch.cat([ids[1][:8], new_ids[14:]])) == 19


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["new", "decode", "free", "flush_tree"]),
            st.integers(1, 7),
            st.integers(1, 12),
            st.integers(0, 5),
        ),
        max_size=40,
    )
)
def test_rows_are_conserved_across_every_owner_under_random_lifecycles(ops):
    """Random prefills (some reusing an earlier prompt's cached prefix), decodes with evictions,
    finishes (the tree keeps the ids) and tree evictions: every heap row is always free or held by
    exactly one owner (SGLang's ids, a group's entries, the store, an eviction in flight), and
    every reused prefix is found in the store."""
    page = 2
    state, heap = make_state(page=page, rows=240, budget=4, window=1, evict_page=2, prefix_cache=True)
    table = state.groups[0].table
    held: dict[int, list[torch.Tensor]] = {}  # request index -> SGLang ids it holds
    prompts: list[torch.Tensor] = []
    for op, req_idx, length, pick in ops:
        if op == "new" and not table.is_active(req_idx):
            prefix = prompts[pick % len(prompts)] if prompts else torch.empty(0, dtype=torch.int64)
            reuse = state.reusable_prefix_len(prefix[: length - 1], length)
            prefix = prefix[:reuse]
            state.pin_prefix(prefix)
            need = -(-(length - reuse) // page) * page
            state.heap.reclaim(need)
            if heap.free_rows() < need:
                heap.evict_cache(need)
                state.heap.reclaim(need)
            if heap.free_rows() < need or state.store.valid_prefix_len(prefix) < reuse:
                state.unpin_prefix(prefix)
                continue  # admission would have refused it
            pages = heap.sglang_alloc(need)  # SGLang's ids for the new tokens, whole pages
            new = pages[: length - reuse]
            try:
                grow(state, [req_idx], [length])
            except HeapExhausted:
                heap.sglang_free(pages)
                state.unpin_prefix(prefix)
                continue
            plan = plan_extend(state, [req_idx], [reuse], [length - reuse], [prefix], new)
            assert plan.columns[0][0].prefix_slots.numel() == reuse
            state.finish_forward()
            held[req_idx] = [pages]
            prompts.append(torch.cat([prefix, new]))
        elif op == "decode" and table.is_active(req_idx):
            state.heap.reclaim(page * 4)
            if heap.free_rows() < page * 4:
                continue  # SGLang would retract instead
            ids = heap.sglang_alloc(page)
            try:
                grow(state, [req_idx], [int(state.requests.length[req_idx]) + 1])
            except HeapExhausted:
                heap.sglang_free(ids)
                continue
            plan_decode(state, [req_idx])
            state.finish_forward()
            held[req_idx].append(ids)
        elif op == "free" and req_idx in held:
            state.free(req_idx)
            heap.cached.extend(held.pop(req_idx))  # the tree caches the finished request's ids
        elif op == "flush_tree":
            heap.evict_cache(heap.rows)
            prompts = [p for p in prompts if state.store.valid_prefix_len(p) == p.numel()]
        sglang_rows = sum(t.numel() for ts in held.values() for t in ts) + sum(t.numel() for t in heap.cached)
        owners = sglang_rows + state.groups[0].rows_held() + state.store.rows() + state.heap.deferred_rows()
        assert owners + heap.free_rows() == heap.rows
        assert_device_tables_mirror_the_host(state)
        store = state.store  # its cached count of reclaimable blocks is a fresh count
        fresh = (store.last_use >= 0) & (store.pins == 0) & (store.holds == 0)
        assert store.reclaimable_rows() == int(fresh.sum()) * store.rows_per_block
    state.clear()
    for ts in held.values():
        heap.cached.extend(ts)
    heap.evict_cache(heap.rows)
    assert heap.free_rows() == heap.rows


def test_entry_tables_large_beside_the_heap_draw_a_warning_naming_what_sizes_them():
    """The tables grow with request slots x the widest budget a request may ask for: 64 slots of
    5,136 entries beside a 2,048-row heap warn; 8 slots of the default width do not."""
    small, _ = make_state(rows=2048, max_requests=8, context=8192, budget=64)
    assert table_warning(small) is None
    large, _ = make_state(rows=2048, max_requests=64, context=8192, budget=64, max_request_budget=5120)
    warning = table_warning(large)
    assert warning is not None and "64 request slots (--max-running-requests) x 5136 entries" in warning
