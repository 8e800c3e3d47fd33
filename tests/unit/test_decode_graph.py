"""The graph-replay decode path (fixed-shape buffers updated in place) against the eager one.

A captured decode graph reads the same tensors at every replay: through `SparseForward`, as
SGLang's graph runner drives the backend, the buffers and their plan are made once
(`init_graph`, `begin_capture`) and every step only plans its requests into them
(`begin_replay`). Over hundreds of steps in which
requests join, evict and finish, its outputs and the lanes' K/V and scores must be the eager
path's, whether the requests score by the server's policy or some by their own. The captured
batch is wider than the running one, so padded rows are exercised too.
(`bench/gpu_check.py` replays the same step from a real CUDA graph.)
"""

import pytest
import torch

from sglang_kvsparse.forward.decode_graph import DecodeBuffers
from sglang_kvsparse.forward.planning import plan_decode, plan_extend

from .heap import (
    OWN_POLICY_SETTINGS,
    ReplayStep,
    assert_device_tables_mirror_the_host,
    decode_lifecycle,
    grow,
    make_state,
)

GRAPH_BS = 6


def lifecycle_state():
    return make_state(num_layers=4, full_layers=(0,), budget=8, evict_page=4, rows=4096, max_requests=8, context=4096)


def replay_checked(state) -> ReplayStep:
    """The replayed step, checking after each that the device tables mirror the host's."""

    class Checked(ReplayStep):
        def __call__(self, state, req_indices, q, k, v, positions):
            outputs = super().__call__(state, req_indices, q, k, v, positions)
            assert_device_tables_mirror_the_host(state)
            return outputs

    return Checked(state, GRAPH_BS)


#: Requests of the server's policy only, or some of their own (`OWN_POLICY_SETTINGS`).
SETTINGS = {"server": (), "own policies": OWN_POLICY_SETTINGS}


@pytest.mark.parametrize("requests", SETTINGS)
def test_graph_replay_matches_eager_over_hundreds_of_steps_with_evictions(requests):
    settings = SETTINGS[requests]
    eager_state, _ = lifecycle_state()
    eager, evicting = decode_lifecycle(eager_state, 400, settings=settings)
    replay_state, _ = lifecycle_state()
    replay, _ = decode_lifecycle(replay_state, 400, replay_checked(replay_state), settings=settings)
    assert len(eager) > 300 and evicting > 30
    for step, (a, b) in enumerate(zip(eager, replay)):
        assert torch.allclose(a, b, atol=1e-6), step
    for lane_a, lane_b in zip(eager_state.lanes, replay_state.lanes):
        live = slice(1, None)  # row 0 is the padding row: padded graph rows write there
        assert torch.allclose(lane_a.k[live], lane_b.k[live]) and torch.allclose(lane_a.v[live], lane_b.v[live])
    group = eager_state.groups[0]
    for req_idx in group.table.active_requests().tolist():
        n = group.table.count(req_idx)
        slots = group.score_slots(torch.full((n,), req_idx), torch.arange(n)).reshape(-1)
        for lane_a, lane_b in zip(eager_state.lanes, replay_state.lanes):
            assert torch.allclose(lane_a.scores[slots], lane_b.scores[slots], atol=1e-6)


def test_buffers_refuse_a_batch_they_cannot_hold():
    state, _ = make_state(num_layers=4, full_layers=(0,), budget=8, evict_page=4)
    buffers = DecodeBuffers(state, 2, "cpu")
    with pytest.raises(ValueError, match="1..2"):
        buffers.plan(3)
    req_indices = [1, 2, 3]
    grow(state, req_indices, [3, 4, 5])
    plan_extend(state, req_indices, [0, 0, 0], [3, 4, 5])
    grow(state, req_indices, [4, 5, 6])
    with pytest.raises(ValueError, match="exceeds the buffers"):
        buffers.fill(plan_decode(state, req_indices))
