"""Chunked prefill through the sparse layers, without SGLang: a prompt prefilled in chunks keeps,
scores and outputs exactly what the unchunked prompt does, its earlier chunks wait in the prefix
store (held, never reclaimed) and every row comes back."""

import pytest
import torch

from sglang_kvsparse.forward.guide import PrefillGuide
from sglang_kvsparse.forward.planning import plan_decode, plan_extend
from sglang_kvsparse.forward.plans import MixedPlan
from sglang_kvsparse.forward.sparse_attention import sparse_extend, sparse_mixed
from sglang_kvsparse.state.admission import prefill_charge, prefill_peak_rows, rows_to_hold, window_safe_cut
from sglang_kvsparse.state.requests import Phase

from .heap import H_KV, D, grow, make_state

G = 3  # query heads per KV head
LAYER = 1  # a sparse layer


def kept(state, req_idx):
    """(K, V, scores) of the request's entries in LAYER's column."""
    place = state.layout.layer_places[LAYER]
    group = state.groups[place.group]
    rows = group.table.entries(req_idx)[:, place.column]
    n = rows.numel()
    scores = group.score_slots(torch.full((n,), req_idx), torch.arange(n))[:, place.column]
    lane = state.lanes[place.lane]
    return lane.k[rows].clone(), lane.v[rows].clone(), lane.scores[scores].clone()


def forward(state, rows, prefix_lens, extend_lens, prefix_ids, new_ids, q, k, v):
    """SGLang's order for one prefill step: allocate, plan, run LAYER (with guide layers, every
    sparse layer on the same inputs and then the guide, as the backend does), finish the forward;
    LAYER's output."""
    grow(state, rows, [p + e for p, e in zip(prefix_lens, extend_lens)])
    plan = plan_extend(state, rows, prefix_lens, extend_lens, prefix_ids, new_ids)
    guide_layers = state.resolved.guide_layers
    guide = None
    if guide_layers and any(column.compress for group in plan.columns for column in group):
        guide = PrefillGuide(guide_layers)
    outputs = {}
    for layer in state.resolved.sparse_layers if guide_layers else (LAYER,):
        place = state.layout.layer_places[layer]
        lane = state.lanes[place.lane]
        outputs[layer] = sparse_extend(q, k, v, 0.3, plan, plan.column(place), lane, state.policy, layer, guide)
    if guide is not None:
        guide.finish()
    state.finish_forward()
    return outputs[LAYER]


def chunk_ends(length, chunk, window, page):
    """Where SGLang (with the project's cut) ends each chunk of a `length`-token prompt."""
    ends, start = [], 0
    while start < length:
        cut = window_safe_cut(min(chunk, length - start), length - start, window, page)
        assert cut > 0
        start += cut
        ends.append(start)
    return ends


def sequences(lengths, seed=5):
    torch.manual_seed(seed)
    return [(torch.randn(n, H_KV * G, D), torch.randn(n, H_KV, D), torch.randn(n, H_KV, D)) for n in lengths]


@pytest.mark.parametrize("guide_from", [None, 0.5], ids=["own-scores", "guided"])
@pytest.mark.parametrize(
    ("chunk", "page", "budget", "window"), [(8, 1, 12, 2), (5, 1, 12, 4), (4, 2, 10, 3), (16, 2, 64, 2), (7, 1, 6, 2)]
)
def test_a_chunked_prompt_keeps_scores_and_outputs_what_the_unchunked_prompt_does(
    chunk, page, budget, window, guide_from
):
    """Two prompts (37 and 22 tokens) prefilled whole, then again with the first in chunks and the
    second beside its last chunk. pool_kernel 3 pools scores across the chunk boundaries. Guided,
    the last chunk's deferred selection reads the earlier chunks back from the store."""
    lengths = [37, 22]
    seqs = sequences(lengths)
    make = dict(
        budget=budget, window=window, page=page, prefix_cache=True, pool_kernel=3, rows=1024, guide_from=guide_from
    )
    whole_state, whole_heap = make_state(**make)
    whole_state.expect([1, 2], [n + 40 for n in lengths], lengths)
    ids = [whole_heap.sglang_alloc(-(-n // page) * page)[:n] for n in lengths]
    q, k, v = (torch.cat(parts) for parts in zip(*seqs))
    whole = forward(whole_state, [1, 2], [0, 0], lengths, [torch.empty(0)] * 2, torch.cat(ids), q, k, v)

    state, heap = make_state(**make)
    state.expect([1, 2], [n + 40 for n in lengths], lengths)
    assert state.requests.is_(Phase.ADMITTED, torch.tensor([1, 2])).all()
    (q1, k1, v1), (q2, k2, v2) = seqs
    ends = chunk_ends(lengths[0], chunk, window, page)
    assert len(ends) > 2 and lengths[0] - ends[-2] >= window
    held: list[torch.Tensor] = []  # SGLang's allocations (whole pages), freed at the end

    def alloc(n):
        held.append(heap.sglang_alloc(-(-n // page) * page))
        return held[-1][:n]

    prompt_ids = torch.empty(0, dtype=torch.int64)
    outputs, start = [], 0
    for end in ends[:-1]:
        chunk_ids = alloc(end - start)
        part = slice(start, end)
        outputs.append(
            forward(state, [1], [start], [end - start], [prompt_ids], chunk_ids, q1[part], k1[part], v1[part])
        )
        assert state.requests.phase[1] == Phase.CHUNKED and not state.groups[0].table.is_active(1)
        prompt_ids = torch.cat([prompt_ids, chunk_ids])
        assert state.heap.reclaimable_rows() == 0  # the chunks so far are held, not cache
        assert state.store.valid_prefix_len(prompt_ids) == end
        start = end
    last = slice(ends[-2], None)
    last_ids = alloc(lengths[0] - ends[-2])
    other_ids = alloc(lengths[1])
    out = forward(
        state,
        [1, 2],
        [ends[-2], 0],
        [lengths[0] - ends[-2], lengths[1]],
        [prompt_ids, torch.empty(0)],
        torch.cat([last_ids, other_ids]),
        torch.cat([q1[last], q2]),
        torch.cat([k1[last], k2]),
        torch.cat([v1[last], v2]),
    )
    outputs.append(out)
    assert state.requests.phase[1] == Phase.PREFILLING  # its last chunk allocated; DECODING from its first token
    assert torch.allclose(torch.cat(outputs), whole, atol=1e-5)
    for req_idx in (1, 2):
        for mine, theirs in zip(kept(state, req_idx), kept(whole_state, req_idx)):
            assert torch.allclose(mine, theirs, atol=1e-6)
    assert state.counters.chunks_stored == len(ends) - 1
    assert state.heap.reclaimable_rows() == state.store.rows()  # after the last chunk: plain cache entries
    for req_idx in (1, 2):
        state.free(req_idx)
    heap.sglang_free(torch.cat(held))
    assert state.store.rows() == 0 and heap.free_rows() == 1024
    assert not state.requests.phase.any() and not state.store.held_by  # every record FREE


def test_a_chunked_request_freed_midway_gives_its_held_blocks_back():
    state, heap = make_state(budget=8, window=2, prefix_cache=True, rows=256)
    state.expect([3], [60], [40])
    ((q, k, v),) = sequences([16])
    ids = heap.sglang_alloc(16)
    forward(state, [3], [0], [16], [torch.empty(0)], ids, q, k, v)
    assert state.store.rows() == 16 * 3 and state.heap.reclaimable_rows() == 0
    state.free(3)  # aborted (or retracted) between chunks
    assert state.heap.reclaimable_rows() == 16 * 3  # SGLang's tree may still hold the ids: a cache entry now
    heap.sglang_free(ids)
    assert state.store.rows() == 0 and heap.free_rows() == 256


def test_the_charge_of_a_chunk_is_its_store_rows_and_of_the_last_the_requests_entries():
    state, _ = make_state(budget=8, window=2, prefix_cache=True, page=2, rows=256)
    assert prefill_charge(state, 0, 16, 40, 60) == 16 * 3  # 3 sparse columns, whole blocks
    assert prefill_charge(state, 16, 21, 40, 60) == 6 * 3
    assert prefill_charge(state, 32, 40, 40, 60) == rows_to_hold(state, 60)
    # Queue admission's bound on a prompt: the earlier chunks sit in the store beside its rows.
    assert prefill_peak_rows(state, 40, None) == prefill_peak_rows(state, 40, 64) == state.layout.rows_held(40)
    assert prefill_peak_rows(state, 40, 16) == state.layout.rows_held(40) + 40 * 3


@pytest.mark.parametrize(
    ("chunk", "remaining", "window", "page", "cut"),
    [
        (512, 1000, 32, 1, 512),
        (512, 520, 32, 1, 488),
        (512, 520, 32, 64, 448),
        (512, 512, 32, 1, 512),
        (8, 30, 32, 1, 0),
    ],
)
def test_the_cut_leaves_the_last_chunk_the_whole_window(chunk, remaining, window, page, cut):
    assert window_safe_cut(chunk, remaining, window, page) == cut


def test_a_mixed_step_prefills_and_decodes_as_the_two_steps_apart():
    """SGLang's mixed chunk: a prefill with running rows' decode tokens appended gives the same
    outputs and kept entries as the prefill and the decode step run one after the other."""
    results = []
    for mixed in (False, True):
        state, heap = make_state(budget=6, window=2, evict_page=2, prefix_cache=True, rows=512)
        state.expect([1, 2], [40, 40], [10, 9])
        seqs = sequences([10, 9, 1, 1], seed=11)
        ids = heap.sglang_alloc(19)
        forward(state, [1], [0], [10], [torch.empty(0)], ids[:10], *seqs[0])
        place = state.layout.layer_places[LAYER]
        lane = state.lanes[place.lane]
        grow(state, [2], [9])
        prefill = plan_extend(state, [2], [0], [9], [torch.empty(0)], ids[10:])
        grow(state, [1], [11])
        decode = plan_decode(state, [1])
        (q2, k2, v2), (qd, kd, vd) = seqs[1], seqs[2]
        if mixed:
            plan = MixedPlan(prefill, decode, 9)
            positions = torch.cat([torch.arange(9), torch.tensor([10])])
            out = sparse_mixed(
                torch.cat([q2, qd]),
                torch.cat([k2, kd]),
                torch.cat([v2, vd]),
                0.3,
                plan,
                place,
                lane,
                state.policy,
                positions,
            )
        else:
            from sglang_kvsparse.forward.sparse_attention import sparse_decode

            o1 = sparse_extend(q2, k2, v2, 0.3, prefill, prefill.column(place), lane, state.policy)
            o2 = sparse_decode(
                qd.view(1, -1, D), kd, vd, 0.3, decode, decode.column(place), lane, state.policy, torch.tensor([10])
            )
            out = torch.cat([o1, o2.view(1, *o1.shape[1:])])
        state.finish_forward()
        results.append((out, kept(state, 1), kept(state, 2)))
    (out_a, *kept_a), (out_b, *kept_b) = results
    assert torch.allclose(out_a, out_b, atol=1e-6)
    for a, b in zip(kept_a, kept_b):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_a_conversations_next_turn_finds_the_answer_under_the_trees_ids():
    """Turn 2 recomputed turn 1's answer under new ids; the tree holds the answer under its
    decode-time ids (no entries) and, inserting turn 2, frees the new ids while it walks: the
    entries move to the tree's ids before the frees reach the store."""
    state, heap = make_state(budget=64, window=2, prefix_cache=True, rows=512)
    state.expect([1], [40], [12])
    prompt_ids, answer_ids = heap.sglang_alloc(12), heap.sglang_alloc(6)  # turn 1's prompt, its decoded answer
    forward(state, [1], [0], [12], [torch.empty(0)], prompt_ids, *sequences([12])[0])
    state.free(1)
    state.expect([2], [40], [20])
    new_ids = heap.sglang_alloc(8)  # turn 2: the answer again and a 2-token message
    forward(state, [2], [12], [8], [prompt_ids], new_ids, *sequences([8])[0])
    state.free(2)
    assert state.store.valid_prefix_len(torch.cat([prompt_ids, answer_ids])) == 12
    with state.released.adopting():  # SGLang's insert of turn 2: the answer's new ids are duplicates
        heap.sglang_free(new_ids[:6])
        state.released.adopt(new_ids[:6], answer_ids)
    assert state.store.valid_prefix_len(torch.cat([prompt_ids, answer_ids, new_ids[6:]])) == 20
    assert state.counters.store_entries_adopted == 6


def test_a_chunk_stays_stored_when_the_same_steps_other_prompts_want_store_rows():
    """A full heap: the best-effort store rows of the other prompt in the batch must not reclaim
    the chunk's blocks, which are its request's only copy until its last chunk."""
    state, heap = make_state(budget=8, window=2, prefix_cache=True, rows=56)  # 3 sparse columns
    state.expect([1, 2], [40, 10], [20, 6])
    ids = heap.sglang_alloc(14)
    (q1, k1, v1), (q2, k2, v2) = sequences([8, 6])
    # Request 1: the first 8 tokens of a 20-token prompt (24 store rows); request 2: a whole 6-token
    # prompt (18 entry rows), whose 18 best-effort store rows do not fit.
    forward(
        state,
        [1, 2],
        [0, 0],
        [8, 6],
        [torch.empty(0)] * 2,
        ids,
        *(torch.cat(t) for t in ((q1, q2), (k1, k2), (v1, v2))),
    )
    assert heap.free_rows() == 0
    assert state.store.valid_prefix_len(ids[:8]) == 8 and state.store.valid_prefix_len(ids[8:]) == 0
