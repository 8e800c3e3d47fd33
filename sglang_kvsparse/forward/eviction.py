"""A decode step's evictions, in every sparse layer at once, before any layer of the step runs
(no SGLang imports).

Each layer's eviction reads only its own lane's old entries and the scores earlier steps
accumulated, so doing them all first is what doing each one at its layer would be; and the step's
only variable-shaped work stays out of a captured decode graph. Evictions move entries as they
are stored (FP8 bytes included): no scale is involved.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_kvsparse import kernels
from sglang_kvsparse.forward.planning import plan_decode
from sglang_kvsparse.forward.plans import Eviction, ForwardPlan
from sglang_kvsparse.forward.sparse_attention import SLIDING_POLICY
from sglang_kvsparse.policies import ScoringPolicy
from sglang_kvsparse.state.layout import GroupSpec, HeapLayout
from sglang_kvsparse.state.sparse_group import LaneBuffers
from sglang_kvsparse.state.sparse_state import SparseState


def prepare_decode(state: SparseState, req_indices: Sequence[int], device: torch.device | str) -> ForwardPlan:
    """A decode step's plan (`planning.plan_decode`, from the host tables), its evictions already
    run in every sparse layer: what the backend does once per step, before the layers."""
    plan = plan_decode(state, req_indices, device)
    evict_planned(plan, state.layout, state.lanes, state.policy)
    return plan


def evict_planned(plan: ForwardPlan, layout: HeapLayout, lanes: Sequence[LaneBuffers], policy: ScoringPolicy) -> None:
    """Run a decode plan's evictions in every sparse layer, before any layer of the step runs:
    each layer's eviction reads only its own lane's old entries and the scores earlier steps
    accumulated, so doing them all first is what doing each one at its layer would be. Each
    `Eviction` covers every layer of its group at once (`evict_group`), so a step issues a few
    launches per (group, budget, policy) among its evicting requests, whatever the numbers of
    layers and requests; and the step's only variable-shaped work stays out of a captured
    decode graph. A sliding group ranks by `SLIDING_POLICY`."""
    for eviction in plan.evictions:
        spec = layout.groups[eviction.group]
        ranking = SLIDING_POLICY if spec.sliding_window else eviction.policy or policy
        evict_group(lanes, spec, eviction, plan.sink, plan.window, ranking)


def evict_group(
    lanes: Sequence[LaneBuffers], spec: GroupSpec, eviction: Eviction, sink: int, window: int, policy: ScoringPolicy
) -> None:
    """Keep, per request, layer and KV head, the first `sink`, the last `window` and the
    best-ranked rest of its old entries (`eviction.slots` [columns, N, n_old], position order;
    their scores at `eviction.score_slots`, ranked by the policy's `eviction_scores`), up to the
    budget, moved in position order into its first `budget` entries (K, V and stored scores, in
    place). The old scores of every layer of the group are gathered and ranked together; then
    each lane selects and moves its layers' entries in one launch (`kernels.evict_rows`)."""
    _, rows, n_old = eviction.slots.shape
    on_lane = [(lane, spec.columns_on_lane(lane)) for lane in range(len(lanes))]
    on_lane = [(lane, count) for lane, count in on_lane if count]
    gathered = [lanes[lane].scores[eviction.score_slots[:count]] for lane, count in on_lane]  # [count, N, n_old, H]
    scores = torch.cat(gathered) if len(gathered) > 1 else gathered[0]
    layers, heads = scores.shape[0], scores.shape[-1]
    ranked = policy.eviction_scores(scores.view(layers * rows, n_old, heads))
    first = 0
    for lane, count in on_lane:
        buffers = lanes[lane]
        mine = ranked[first * rows : (first + count) * rows]
        first += count
        slots, score_slots = eviction.slots[:count], eviction.score_slots[:count]
        kernels.evict_rows(
            buffers.k, buffers.v, buffers.scores, mine, slots, score_slots, eviction.budget, sink, window
        )
