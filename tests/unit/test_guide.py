"""Cross-layer selection (`guide_from`): every sparse layer keeps what the guide layers rank best.

Against a float64 computation by hand: the guide layers' window attention (SnapKV without
pooling), its largest over each layer's KV heads, averaged over the guide layers; every sparse
layer of every request in a ragged batch keeps the sink, the window and the best of the rest by
that guide, in every KV head, with the guide's scores stored; a request whose budget is at least
`guide_below` of its prompt, in the same batch, by each layer's own. Also the configuration's
checks and the guide's own refusals.
"""

from __future__ import annotations

import json

import pytest
import torch

from sglang_kvsparse.config import SparsityConfig, SparsityConfigError, parse_config
from sglang_kvsparse.config.request_sparsity import RequestSparsity
from sglang_kvsparse.forward.guide import PrefillGuide
from sglang_kvsparse.forward.planning import plan_extend
from sglang_kvsparse.forward.sparse_attention import sparse_extend
from sglang_kvsparse.state.admission import prefill_charge, prefill_peak_rows, rows_to_hold, waits_for_guide

from .heap import H_KV, D, grow, make_state

G = 2  # query heads per KV head
SCALE = 0.3
SINK, WINDOW, BUDGET = 1, 2, 9
LAYERS, FULL, GUIDE_FROM = 5, (0,), 0.5  # sparse layers 1..4; guide layers round(2.5) = 2.. -> 2, 3, 4
PROMPTS = (23, 17, 6)  # the last fits its budget


def window_mass(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """float64 attention of the last WINDOW queries, summed over them and each KV head's query
    heads: [L, H_kv] for one request's q [L, H_q, D] and keys [L, H_kv, D]."""
    n = keys.shape[0]
    logits = torch.einsum("thd,lhd->htl", q[-WINDOW:].double(), keys.double().repeat_interleave(G, dim=1)) * SCALE
    future = torch.arange(n)[None, :] > (n - WINDOW + torch.arange(WINDOW))[:, None]
    probs = logits.masked_fill(future, float("-inf")).softmax(-1)
    return probs.unflatten(0, (H_KV, G)).sum((1, 2)).T


def held(state, layer: int, row: int, keys: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    """Per KV head, the positions request `row` holds in the layer (found by their keys among
    `keys` [L, H, D]), and their stored scores [n, H]."""
    place = state.layout.layer_places[layer]
    group, lane = state.groups[place.group], state.lanes[place.lane]
    n = group.table.count(row)
    stored = lane.k[group.table.entries(row)[:n, place.column]]
    positions = [[int((keys[:, h] == stored[e, h]).all(-1).nonzero().item()) for e in range(n)] for h in range(H_KV)]
    score_slots = group.score_slots(torch.full((n,), row), torch.arange(n))[:, place.column]
    return positions, lane.scores[score_slots].double()


def guided_forward(budgets: list[int], guide_below: float | None):
    """PROMPTS prefilled together under a guide (server budget BUDGET; request i asks for
    `budgets[i]`), every sparse layer's inputs random; returns the state, rows and inputs."""
    state, _ = make_state(
        num_layers=LAYERS,
        full_layers=FULL,
        budget=BUDGET,
        window=WINDOW,
        context=64,
        guide_from=GUIDE_FROM,
        guide_below=guide_below,
        max_request_budget=max(budgets),
        rows=512,
    )
    assert state.resolved.guide_layers == (2, 3, 4)
    rows = [1, 2, 3]
    settings = [RequestSparsity(budget=budget) for budget in budgets]
    state.expect(rows, [length + 20 for length in PROMPTS], list(PROMPTS), settings)  # scores in their own rows
    grow(state, rows, list(PROMPTS))
    free = state.heap.free_rows()
    plan = plan_extend(state, rows, [0] * len(rows), list(PROMPTS))
    gen = torch.Generator().manual_seed(0)
    total = sum(PROMPTS)
    inputs = {
        layer: (
            torch.randn(total, H_KV * G, D, generator=gen),
            torch.randn(total, H_KV, D, generator=gen),
            torch.randn(total, H_KV, D, generator=gen),
        )
        for layer in state.resolved.sparse_layers
    }
    guided = [
        length > budget and (budget < guide_below * length if guide_below else True)
        for budget, length in zip(budgets, PROMPTS)
    ]
    assert plan.column(state.layout.layer_places[1]).guided.tolist() == guided
    # Their new tokens wait in heap rows of their own for the forward, one per sparse column.
    waiting = sum(length for length, mine in zip(PROMPTS, guided) if mine)
    assert state.heap.free_rows() == free - waiting * state.layout.num_columns
    assert state.counters.guide_rows_peak == waiting * state.layout.num_columns
    guide = PrefillGuide(state.resolved.guide_layers)
    for layer, (q, k, v) in inputs.items():
        place = state.layout.layer_places[layer]
        sparse_extend(q, k, v, SCALE, plan, plan.column(place), state.lanes[place.lane], state.policy, layer, guide)
    guide.finish()
    state.finish_forward()
    assert state.heap.free_rows() == free  # given back once the forward was issued
    return state, rows, inputs


@pytest.mark.parametrize(
    "budgets, guide_below, by_guide",
    [
        ((BUDGET, BUDGET, BUDGET), None, (True, True, True)),  # no `guide_below`: the guide keeps for all
        ((BUDGET, BUDGET + 3, BUDGET), 0.6, (True, False, True)),  # 9 < 0.6 x 23, not 12 < 0.6 x 17
        ((BUDGET, BUDGET, BUDGET), 0.45, (True, False, True)),  # one budget: 9 < 0.45 x 23, not < 0.45 x 17
        ((BUDGET, BUDGET, BUDGET), 0.3, (False, False, False)),  # each layer its own
    ],
)
def test_each_sparse_layer_keeps_by_the_guide_below_guide_below_and_by_its_own_from_it(budgets, guide_below, by_guide):
    """A guided request: every sparse layer keeps the best by the guide (the guide layers'
    window mass, its largest over their KV heads, averaged over them) in every KV head, with the
    guide's scores stored; a request whose budget is at least `guide_below` of its prompt: each
    layer and KV head keeps the best by its own window mass, as without a guide."""
    state, rows, inputs = guided_forward(list(budgets), guide_below)
    start = 0
    for row, length, budget, guided in zip(rows, PROMPTS, budgets, by_guide):
        span = slice(start, start + length)
        start += length
        masses = {layer: window_mass(q[span], k[span]) for layer, (q, k, _) in inputs.items()}
        guide = torch.stack([masses[layer].amax(1) for layer in state.resolved.guide_layers]).mean(0)
        for layer in state.resolved.sparse_layers:
            keys = inputs[layer][1][span]
            positions, stored = held(state, layer, row, keys)
            for h in range(H_KV):
                if length <= budget:  # fits: every key, none chosen
                    assert positions[h] == list(range(length))
                    continue
                want = guide if guided else masses[layer][:, h]
                assert positions[h] == sorted(positions[h])
                protected = {*range(SINK), *range(length - WINDOW, length)}
                assert len(positions[h]) == budget and protected <= set(positions[h])
                chosen = [p for p in positions[h] if p not in protected]
                dropped = [p for p in range(length) if p not in positions[h]]
                assert float(want[chosen].min()) >= float(want[dropped].max()) - 1e-9, (layer, h, chosen, dropped)
                torch.testing.assert_close(stored[:, h], want[positions[h]], atol=1e-5, rtol=1e-5)


def test_without_a_guide_each_layer_keeps_its_own_best_so_the_layers_differ():
    """The control: the same inputs without `guide_from` keep different sets per layer (else the
    test above could pass without a guide)."""
    state, _ = make_state(num_layers=LAYERS, full_layers=FULL, budget=BUDGET, window=WINDOW, context=64)
    length = PROMPTS[0]
    state.expect([1], [length])
    grow(state, [1], [length])
    plan = plan_extend(state, [1], [0], [length])
    gen = torch.Generator().manual_seed(0)
    kept = []
    for layer in state.resolved.sparse_layers:
        q = torch.randn(length, H_KV * G, D, generator=gen)
        k, v = torch.randn(length, H_KV, D, generator=gen), torch.randn(length, H_KV, D, generator=gen)
        place = state.layout.layer_places[layer]
        sparse_extend(q, k, v, SCALE, plan, plan.column(place), state.lanes[place.lane], state.policy, layer)
        kept.append(held(state, layer, 1, k)[0])
    state.finish_forward()
    assert len({str(k) for k in kept}) > 1


def test_the_guide_refuses_a_layer_it_does_not_have_and_finishing_without_all_of_them():
    guide = PrefillGuide((2, 3))
    with pytest.raises(ValueError, match="layer 1"):
        guide.add(1, torch.zeros(4, H_KV))
    guide.add(2, torch.zeros(4, H_KV))
    with pytest.raises(ValueError, match="layer 2"):
        guide.add(2, torch.zeros(4, H_KV))
    ran = []
    guide.defer(ran.append)
    with pytest.raises(RuntimeError, match=r"missing layers \[3\]"):
        guide.finish()
    guide.add(3, torch.ones(4, H_KV))
    guide.finish()
    torch.testing.assert_close(ran[0], torch.full((4,), 0.5))


def test_guide_from_resolves_to_the_sparse_layers_from_that_depth():
    resolved = SparsityConfig(full_layers=(0, 1), budget=64, guide_from=1 / 3).resolve(30, 4096)
    assert resolved.guide_layers == tuple(range(10, 30))
    assert SparsityConfig(full_layers=(0, 1), budget=64).resolve(30, 4096).guide_layers == ()
    config = parse_config('{"guide_from": 0.5}')
    assert config.guide_from == 0.5 and config.to_dict()["guide_from"] == 0.5
    assert "guided from 0.5" in config.describe()


@pytest.mark.parametrize("value", [1.0, -0.1, True, "half"])
def test_a_bad_guide_from_is_refused_naming_the_field(value):
    with pytest.raises(SparsityConfigError, match="guide_from"):
        SparsityConfig(guide_from=value)


def test_a_guide_with_no_sparse_layer_at_its_depth_is_refused():
    config = SparsityConfig(full_layers=(8, 9), budget=64, guide_from=0.8)
    with pytest.raises(SparsityConfigError, match="guide_from: 0.8 of 10 layers starts at layer 8"):
        config.resolve(10, 4096)


def test_guide_below_round_trips():
    config = parse_config('{"guide_from": 0.5, "guide_below": 0.15}')
    assert config.guide_below == 0.15 and config.to_dict()["guide_below"] == 0.15
    assert "guided from 0.5 of the depth while the budget is below 0.15 of the prompt" in config.describe()
    assert parse_config(json.dumps(config.to_dict())) == config


@pytest.mark.parametrize("value", [0, -0.5, 1.5, 512, True, "0.15"])
def test_a_bad_guide_below_is_refused_naming_the_field(value):
    with pytest.raises(SparsityConfigError, match="guide_below"):
        SparsityConfig(guide_from=0.5, guide_below=value)


def test_admission_charges_the_rows_a_guided_prefill_waits_in():
    """A request kept by the guide is charged, with its entries, one row per sparse column for
    each token of its last forward (they wait there until the guide has chosen); one kept by
    each layer's own scores, or a chunk before the last, is charged as without a guide."""
    state, _ = make_state(
        num_layers=LAYERS,
        full_layers=FULL,
        budget=BUDGET,
        window=WINDOW,
        guide_from=GUIDE_FROM,
        guide_below=0.45,
        prefix_cache=True,
    )
    columns = state.layout.num_columns
    guided = [waits_for_guide(state.resolved, state.layout, length) for length in (23, 17, 6)]
    assert guided == [True, False, False]
    assert prefill_charge(state, 0, 23, 23, 40) == rows_to_hold(state, 40) + 23 * columns
    assert prefill_charge(state, 0, 17, 17, 40) == rows_to_hold(state, 40)
    assert not waits_for_guide(state.resolved, state.layout, 23, budget=12)  # a request's own budget: 12 >= 0.45 x 23
    assert prefill_charge(state, 0, 23, 23, 40, budget=12) == rows_to_hold(state, 40, 12)
    # Chunks of 8: the earlier chunks go to the prefix store; the last forward's 7 tokens wait.
    assert prefill_charge(state, 0, 8, 23, 40) == 8 * state.store.rows_per_block
    assert prefill_charge(state, 16, 23, 23, 40) == rows_to_hold(state, 40) + 7 * columns
    # Earlier chunks in the store and the last chunk's waiting tokens: a row per column and token.
    assert prefill_peak_rows(state, 23, 8) == state.layout.rows_held(23) + 23 * state.store.rows_per_block
    assert prefill_peak_rows(state, 23, None) == state.layout.rows_held(23) + 23 * columns
