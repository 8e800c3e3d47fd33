"""Sliding layers (the model's sliding-window layers, kept in the heap's columns): their layout,
and their attention equal to the model's windowed attention over the whole sequence, through
prefills longer than the window, decode steps, evictions, graph replays and requests with their
own budget and policy; the heap whole after."""

from __future__ import annotations

import pytest
import torch

from sglang_kvsparse.config import SparsityConfig, SparsityConfigError
from sglang_kvsparse.config.request_sparsity import RequestSparsity
from sglang_kvsparse.forward.eviction import evict_planned
from sglang_kvsparse.forward.planning import plan_decode, plan_extend
from sglang_kvsparse.forward.sparse_attention import sparse_extend
from sglang_kvsparse.forward.sparse_forward import SparseForward
from sglang_kvsparse.policies import H2OPolicy, TOVAPolicy
from sglang_kvsparse.state.layout import HeapLayout, capacity_ratio

from .heap import GROUP, H_KV, SM_SCALE, D, ReplayStep, eager_decode, grow, make_state

WINDOW, SINK = 8, 2
#: Layers 0 and 3 slide, layer 1 is full, layer 2 sparse (budget 12).
LAYERS = dict(num_layers=4, full_layers=(1,), sliding_layers=(0, 3), sliding_window=WINDOW, sink=SINK)


def windowed(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, position: int) -> torch.Tensor:
    """The model's attention of one query at `position` ([H_q, D]) over the keys of positions
    position - WINDOW + 1 .. position (float64)."""
    lo = max(position - WINDOW + 1, 0)
    k = keys[lo : position + 1].double().repeat_interleave(GROUP, dim=1)  # [n, H_q, D]
    v = values[lo : position + 1].double().repeat_interleave(GROUP, dim=1)
    probs = torch.softmax(torch.einsum("hd,nhd->hn", q.double(), k) * SM_SCALE, dim=-1)
    return torch.einsum("hn,nhd->hd", probs, v).float()


def test_gemma3_layout_keeps_the_window_in_its_sliding_layers():
    """Gemma 3 270M's layout with its global layers full: three lanes, its fifteen sliding
    layers in five columns of window + sink entries, and the capacity at equal bytes that gives."""
    config = SparsityConfig(full_layers=(5, 11, 17), sink=4)
    sliding = tuple(layer for layer in range(18) if layer not in (5, 11, 17))
    resolved = config.resolve(18, 32768, sliding, 512)
    layout = HeapLayout.from_resolved(resolved, scores_per_row=128)
    assert layout.lanes == 3 and layout.full_layers == (5, 11, 17)
    assert [(g.budget, len(g.columns), g.sliding_window) for g in layout.groups] == [(516, 5, 512)]
    assert layout.guided_columns == 0 and layout.guide_rows(1000) == 0
    # A 16k request: 16k ids (the full layers' rows) + 5 columns x (532 entries + 5 score rows),
    # against stock's 18 layers x 16k over three lanes.
    assert layout.rows_held(16000) == 16000 + 5 * (532 + 5)
    assert capacity_ratio(layout, 16000) == pytest.approx(18 * 16000 / 3 / (16000 + 5 * 537))


def test_a_request_budget_or_policy_never_reaches_a_sliding_layer():
    state, _ = make_state(**LAYERS, context=256, budget=12, window=2, evict_page=4, max_request_budget=64)
    sliding = next(g for g in state.groups if g.spec.sliding_window)
    sparse = next(g for g in state.groups if not g.spec.sliding_window)
    state.expect([1], [100], settings=[RequestSparsity(budget=40, policy=TOVAPolicy())])
    index = torch.tensor([1])
    assert state.budgets(sliding, index).tolist() == [WINDOW + SINK]
    assert state.max_entries(sliding, index).tolist() == [WINDOW + SINK + 4]
    assert state.budgets(sparse, index).tolist() == [40]


@pytest.mark.parametrize("replay", [False, True], ids=["eager", "replayed"])
def test_sliding_layers_attend_as_the_model_does_through_prefill_decode_and_eviction(replay):
    state, heap = make_state(**LAYERS, context=256, rows=512, budget=12, window=2, evict_page=4)
    free_before = heap.free_rows()
    places = {layer: state.layout.layer_places[layer] for layer in (0, 3)}
    gen = torch.Generator().manual_seed(3)

    def randn(n: int, heads: int) -> torch.Tensor:
        return torch.randn(n, heads, D, generator=gen)

    # Request 1 (server's setting), prompt far past the window; request 2 with its own budget and
    # policy, prompt inside it; request 3 exactly window + sink.
    prompts = {1: 21, 2: 5, 3: WINDOW + SINK}
    settings = {1: RequestSparsity(), 2: RequestSparsity(budget=10, policy=H2OPolicy()), 3: RequestSparsity()}
    keys = {r: randn(n, H_KV) for r, n in prompts.items()}
    values = {r: randn(n, H_KV) for r, n in prompts.items()}
    for req_idx, prompt in prompts.items():
        state.expect([req_idx], [prompt + 40], settings=[settings[req_idx]])
        grow(state, [req_idx], [prompt])
        plan = plan_extend(state, [req_idx], [0], [prompt])
        q = randn(prompt, H_KV * GROUP)
        for place in places.values():
            lane = state.lanes[place.lane]
            out = sparse_extend(
                q,
                keys[req_idx],
                values[req_idx],
                SM_SCALE,
                plan,
                plan.column(place),
                lane,
                state.policy,
                sliding_window=WINDOW,
            )
            expected = torch.stack([windowed(q[i], keys[req_idx], values[req_idx], i) for i in range(prompt)])
            torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
        state.finish_forward()
    step = ReplayStep(state, 4) if replay else None
    requests = sorted(prompts)
    for _ in range(30):
        lengths = {r: keys[r].shape[0] for r in requests}
        grow(state, requests, [lengths[r] + 1 for r in requests])
        q, k, v = randn(len(requests), H_KV * GROUP), randn(len(requests), H_KV), randn(len(requests), H_KV)
        positions = torch.tensor([lengths[r] for r in requests])
        if replay:
            outs = step(state, requests, q, k, v, positions)
        else:
            plan = plan_decode(state, requests)
            evict_planned(plan, state.layout, state.lanes, state.policy)
            outs = eager_decode(state, plan, q, k, v, positions)
        state.finish_forward()
        for b, r in enumerate(requests):
            keys[r], values[r] = torch.cat([keys[r], k[b : b + 1]]), torch.cat([values[r], v[b : b + 1]])
        order = step.layers if replay else list(state.layout.layer_places)
        for layer in places:
            got = outs[order.index(layer)]
            expected = torch.stack([windowed(q[b], keys[r], values[r], lengths[r]) for b, r in enumerate(requests)])
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert state.counters.evictions > 0
    sliding = next(g for g in state.groups if g.spec.sliding_window)
    assert all(sliding.table.count(r) <= WINDOW + SINK + 4 for r in requests)
    for r in requests:
        state.free(r)
    state.clear()
    assert heap.free_rows() == free_before


@pytest.mark.parametrize("guide_below", [None, 0.25], ids=["guided", "own scores"])
def test_a_guided_prefill_waits_in_rows_of_the_sparse_columns_only(guide_below):
    """With guide layers, a guided request's new tokens wait in rows of each sparse column until
    the guide has chosen; sliding columns keep by recency at once and take none. A request whose
    budget is a large enough share of its prompt keeps by each layer's own scores: no rows wait."""
    state, heap = make_state(
        **LAYERS, context=256, rows=512, budget=12, window=2, guide_from=0.5, guide_below=guide_below
    )
    assert state.resolved.guide_layers == (2,) and state.layout.guided_columns == 1
    free_before = heap.free_rows()
    forward = SparseForward(state)
    prompt = 40 if guide_below is None else 30  # 12 is above a quarter of 30
    q, k, v = torch.randn(prompt, H_KV * GROUP, D), torch.randn(prompt, H_KV, D), torch.randn(prompt, H_KV, D)
    state.expect([1], [prompt + 4])
    grow(state, [1], [prompt])
    taken = heap.free_rows()
    no_ids = torch.zeros(prompt, dtype=torch.int64)
    forward.begin_extend([1], [0], [prompt], [], no_ids, no_ids)
    waiting = prompt if guide_below is None else 0
    assert taken - heap.free_rows() == waiting  # one sparse column's rows, none for the sliding ones
    outputs = {layer: forward.extend(q, k, v, layer, SM_SCALE, torch.arange(prompt)) for layer in (0, 2, 3)}
    state.finish_forward()
    assert heap.free_rows() == taken
    expected = torch.stack([windowed(q[i], k, v, i) for i in range(prompt)])
    torch.testing.assert_close(outputs[3], expected, atol=1e-5, rtol=1e-5)
    state.free(1)
    assert heap.free_rows() == free_before


def test_resolve_takes_the_models_sliding_layers():
    config = SparsityConfig(full_layers=(2,), budget=64, sink=4, guide_from=0.0, max_request_budget=128)
    resolved = config.resolve(4, 1000, sliding_layers=(0, 1), sliding_window=100)
    assert resolved.kinds == ("sliding", "sliding", "full", "sparse")
    assert resolved.budgets == (104, 104, None, 64)
    assert resolved.guide_layers == (3,) and resolved.request_cap == 128  # sliding layers neither guide nor cap
    assert resolved.heap_layers == (0, 1, 3) and resolved.sliding_window == 100
    assert config.resolve(4, 50, (0,), 100).budgets[0] == 50  # within the context
    with pytest.raises(SparsityConfigError, match="sliding_window must be a positive integer"):
        config.resolve(4, 1000, sliding_layers=(1,), sliding_window=0)
    with pytest.raises(SparsityConfigError, match="outside its 4 layers"):
        config.resolve(4, 1000, sliding_layers=(4,), sliding_window=100)
    assert SparsityConfig(enabled=False).resolve(4, 1000, (0,), 100).kinds == ("full",) * 4


def prefill(state, req_indices, prefix_lens, extend_lens, prefix_ids, new_ids, q, k, v) -> dict[int, torch.Tensor]:
    """SGLang's order for one prefill step (allocate, plan, every sparse layer, finish the
    forward); each sparse layer's output."""
    grow(state, req_indices, [p + e for p, e in zip(prefix_lens, extend_lens)])
    plan = plan_extend(state, req_indices, prefix_lens, extend_lens, prefix_ids, new_ids)
    outputs = {}
    for layer, place in state.layout.layer_places.items():
        window = state.layout.groups[place.group].sliding_window
        column, lane = plan.column(place), state.lanes[place.lane]
        outputs[layer] = sparse_extend(q, k, v, SM_SCALE, plan, column, lane, state.policy, sliding_window=window)
    state.finish_forward()
    return outputs


def test_a_chunked_prompt_under_pressure_holds_what_its_sliding_layers_read_and_stays_exact():
    """A prompt prefilled in chunks while the heap wants every row it can get: the heap takes
    back its earlier chunks' sliding pages except the sinks and the last window (the store then
    holds the sparse layer's column for every token and, within `chunked_rows`, what the
    sliding columns read); every chunk's sliding layers still equal the model's windowed
    attention and its sparse layer the unchunked prompt's; a later prompt reuses the whole
    prompt, or of a cut inside the narrowed part only the sinks; every row comes back."""
    make = dict(**LAYERS, context=256, rows=1024, budget=12, window=2, prefix_cache=True)
    prompt, chunk = 40, 8
    gen = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(prompt, heads, D, generator=gen) for heads in (H_KV * GROUP, H_KV, H_KV))
    whole_state, whole_heap = make_state(**make)
    whole_state.expect([1], [prompt + 8], [prompt])
    whole = prefill(whole_state, [1], [0], [prompt], [torch.empty(0)], whole_heap.sglang_alloc(prompt), q, k, v)

    state, heap = make_state(**make)
    state.expect([1], [prompt + 8], [prompt])
    ids, start = torch.empty(0, dtype=torch.int64), 0
    for end in range(chunk, prompt + 1, chunk):
        new_ids = heap.sglang_alloc(end - start)
        part = slice(start, end)
        out = prefill(state, [1], [start], [end - start], [ids], new_ids, q[part], k[part], v[part])
        for layer in (0, 3):
            expected = torch.stack([windowed(q[i], k, v, i) for i in range(start, end)])
            torch.testing.assert_close(out[layer], expected, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[2], whole[2][part], atol=1e-5, rtol=1e-5)
        ids, start = torch.cat([ids, new_ids]), end
        if end < prompt:
            state.heap.reclaim(heap.free_rows() + 10**6)  # pressure: everything that can go
            wide = min(end, SINK + WINDOW)  # one sparse column, two sliding ones (one lane)
            assert state.store.rows() == end + 2 * wide <= state.store.chunked_rows(prompt, chunk)
    g = next(i for i, group in enumerate(state.groups) if group.spec.sliding_window)
    kept, kept_whole = state.groups[g].table.entries(1), whole_state.groups[g].table.entries(1)
    assert kept.shape == (SINK + WINDOW, 2)  # the sinks, the last window: as the unchunked prompt
    assert torch.equal(state.lanes[0].k[kept], whole_state.lanes[0].k[kept_whole])
    assert state.reusable_prefix_len(ids, prompt + 5) == prompt  # the last window is wide
    assert state.reusable_prefix_len(ids[:20], 30) == SINK  # 12..20 gave their sliding pages back
    state.free(1)
    heap.sglang_free(ids)
    assert state.store.rows() == 0 and heap.free_rows() == 1024


@pytest.mark.parametrize(
    ("listed", "full"),
    [((0,), (2,)), ((0, 1), (2, 5)), ((0, 2), (2, 5)), ((4, 5), (5,)), ((2,), (2,)), ((), ())],
)
def test_a_listed_full_layer_that_slides_stands_for_the_next_global_layer(listed, full):
    """Six layers of which 2 and 5 read the whole context (Gemma 3's pattern): a listed sliding
    layer stays sliding and the next global layer not full yet is full instead, if there is one."""
    resolved = SparsityConfig(full_layers=listed, budget=64).resolve(6, 1000, (0, 1, 3, 4), 100)
    assert tuple(i for i, kind in enumerate(resolved.kinds) if kind == "full") == full
    assert all(resolved.kinds[layer] == "sliding" for layer in (0, 1, 3, 4))
