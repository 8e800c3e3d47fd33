"""The attention of one sparse layer for one forward, over its own buffers (no SGLang imports).

The SGLang backend wrapper (`sglang_kvsparse.patches.attention`) calls these for sparse layers
and delegates full layers to the stock backend. Attention goes through the dispatchers of
`sglang_kvsparse.kernels`, so the same code runs the Triton kernels on CUDA and their torch
references on the CPU.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from sglang_kvsparse import kernels
from sglang_kvsparse.forward.guide import PrefillGuide
from sglang_kvsparse.forward.planning import plan_decode
from sglang_kvsparse.forward.plans import ColumnPlan, Eviction, ForwardPlan, MixedPlan, PolicyGroup
from sglang_kvsparse.kernels.common import positions_in_segment, segment_ids
from sglang_kvsparse.policies import PrefillScoringInputs, ScoringPolicy
from sglang_kvsparse.state.layout import GroupSpec, HeapLayout, LayerPlace
from sglang_kvsparse.state.sparse_group import LaneBuffers
from sglang_kvsparse.state.sparse_state import SparseState


def sparse_extend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    plan: ForwardPlan,
    column: ColumnPlan,
    buffers: LaneBuffers,
    policy: ScoringPolicy,
    layer_id: int = -1,
    guide: PrefillGuide | None = None,
) -> torch.Tensor:
    """Prefill: attend over each request's whole sequence, then store what is kept.

    The keys are the batch's own `k`/`v` ([T, H_kv, D]), preceded per request by its cached
    prefix's entries from the prefix store when it has one (`sequence_kv`). When every row fits
    its budget all entries are stored with the score the policy gives a decoded key
    (`new_key_scores`: zero for the attention-based ones); otherwise `policy` scores the keys (SnapKV:
    the observation window's attention, pooled), `select_kept` keeps sink + window + the best up to
    each request's budget per KV head, and the kept K/V and scores are scattered into its rows.
    `policy` is the server's; a request with its own is scored by it (`plan.policy_groups`).
    With a `guide` (`sglang_kvsparse/forward/guide.py`), a guide layer adds its scores to it, and the
    selection of the requests it guides (`column.guided`: budgets below `guide_below` of their
    prompt) waits for the guide and keeps by its scores, their new tokens' K/V waiting in heap
    rows of their own (`column.work_slots`, charged at admission, back after the forward); the
    others keep at once by the layer's own.
    Either way the prefix was read, not written: the row gets copies. The new tokens' K/V also go
    to their store slots, for later requests that share this prompt; a chunk before its
    prompt's last is only stored (`plan.keeps`). Returns [T, H_q, D].
    """
    k_all, v_all, kv_indptr = sequence_kv(k, v, plan, column, buffers)
    positions = torch.arange(k_all.shape[0], device=k.device, dtype=torch.int64)
    guiding = guide is not None and guide.guides(layer_id)
    guided = column.guided if guide is not None and column.compress else None
    # A layer scores for its own selection, or for the guide; a layer outside the guide needs
    # no scores of its own (nor the softmax statistics) when the guide chooses for every request.
    scoring = guiding or (column.compress and (guided is None or not bool(guided.all())))
    o, lse = kernels.extend_attention_with_stats(
        q, k_all, v_all, plan.qo_indptr, kv_indptr, positions, sm_scale, with_stats=scoring
    )
    if column.store_slots is not None and column.store_slots.numel():
        _write(buffers, column.store_slots, k[plan.store_positions], v[plan.store_positions])
    requests = segment_ids(kv_indptr, k_all.shape[0])  # each key's request in the batch
    scores = None
    if scoring:
        inputs = PrefillScoringInputs(
            q,
            k_all,
            lse,
            plan.qo_indptr,
            kv_indptr,
            positions,
            sm_scale,
            plan.window,
            plan.sink,
            plan.sentence_ends,
        )
        for group in policy_groups(plan, policy):
            mine = group.policy.score(inputs)  # of the whole batch: a batch mixes policies rarely
            scores = mine if scores is None else torch.where(group.mask[requests][:, None], mine, scores)
    if guiding:
        guide.add(layer_id, scores)
    if not column.compress:
        _keep_all(k_all, v_all, kv_indptr, requests, plan, column, buffers, policy)
    elif guided is None or not bool(guided.any()):
        _keep(k_all, v_all, kv_indptr, scores, plan, column, buffers)
    else:
        own = ~guided
        if bool(own.any()):  # the requests that keep by this layer's own scores keep now
            _keep(k_all, v_all, kv_indptr, scores, plan, column, buffers, only=own)
        # The guided requests' new tokens wait in heap rows of their own (`ColumnPlan.work_slots`).
        _write(buffers, column.work_slots, k[plan.work_positions], v[plan.work_positions])

        def keep_by_guide(guide_scores: torch.Tensor) -> None:
            k_new, v_new = torch.zeros_like(k), torch.zeros_like(v)
            k_new[plan.work_positions] = buffers.k[column.work_slots].to(k.dtype)
            v_new[plan.work_positions] = buffers.v[column.work_slots].to(v.dtype)
            k_seq, v_seq, indptr = sequence_kv(k_new, v_new, plan, column, buffers)
            by = guide_scores[:, None].expand(-1, k.shape[1])
            _keep(k_seq, v_seq, indptr, by, plan, column, buffers, only=guided)

        guide.defer(keep_by_guide)
    return o


def _keep_all(
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    kv_indptr: torch.Tensor,
    requests: torch.Tensor,
    plan: ForwardPlan,
    column: ColumnPlan,
    buffers: LaneBuffers,
    policy: ScoringPolicy,
) -> None:
    """Every request fits its budget: its entries are all stored, scored as decoded keys are,
    so that later evictions compare them in the policy's units."""
    in_sequence = positions_in_segment(kv_indptr, k_all.shape[0])
    if plan.kept_positions is not None:
        k_all, v_all = k_all[plan.kept_positions], v_all[plan.kept_positions]
        in_sequence, requests = in_sequence[plan.kept_positions], requests[plan.kept_positions]
    _write(buffers, column.new_slots, k_all, v_all)
    for group in policy_groups(plan, policy):
        keys = slice(None) if group.mask is None else group.mask[requests]
        first = group.policy.new_key_scores(k_all[keys], in_sequence[keys])
        buffers.scores[column.new_score_slots[keys]] = 0.0 if first is None else first


def _keep(
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    kv_indptr: torch.Tensor,
    scores: torch.Tensor,
    plan: ForwardPlan,
    column: ColumnPlan,
    buffers: LaneBuffers,
    only: torch.Tensor | None = None,
) -> None:
    """Select sink + window + the best-scored rest up to each request's budget per KV head, and
    scatter the kept K/V and their scores into the requests' rows; with `only` (host [B]), into
    the rows of those requests alone, the others' left as they are."""
    kept, kept_lens = kernels.select_kept(scores, kv_indptr, column.budgets, plan.sink, plan.window)
    if plan.keeps is not None:
        kept_lens = kept_lens * plan.keeps
    slots, score_slots = column.new_slots, column.new_score_slots
    if only is not None:  # their indices among the rows, which hold every keeping request's, request-major
        lens = kept_lens.cpu()
        spans = torch.arange(int(lens.sum())).split(lens.tolist())
        chosen = torch.cat([part for part, mine in zip(spans, only.tolist()) if mine]).to(slots.device)
        slots, score_slots = slots[chosen], score_slots[chosen]
        kept_lens = kept_lens * only.to(kept_lens.device)
    src = kept_sources(kept, kept_lens, kv_indptr)
    heads = torch.arange(k_all.shape[1], device=k_all.device)[None, :]
    dst = slots[:, None]
    buffers.k[dst, heads] = k_all[src, heads].to(buffers.k.dtype)
    buffers.v[dst, heads] = v_all[src, heads].to(buffers.v.dtype)
    buffers.scores[score_slots[:, None], heads] = scores[src, heads]


def policy_groups(plan: ForwardPlan, policy: ScoringPolicy) -> tuple[PolicyGroup, ...]:
    """The plan's policies with their requests; without any of a request's own, the server's
    `policy` for every request (`members` and `mask` None)."""
    return plan.policy_groups or (PolicyGroup(policy, None, None),)


def sequence_kv(
    k: torch.Tensor, v: torch.Tensor, plan: ForwardPlan, column: ColumnPlan, buffers: LaneBuffers
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each request's keys and values in sequence order (cached prefix, then its new tokens),
    request-major, and their boundaries. Without prefixes that is the batch's own `k`/`v`."""
    if plan.prefix_positions is None:
        return k, v, plan.qo_indptr
    total = plan.prefix_positions.numel() + k.shape[0]
    k_all = k.new_empty((total, *k.shape[1:]))
    v_all = v.new_empty((total, *v.shape[1:]))
    k_all[plan.new_positions] = k
    v_all[plan.new_positions] = v
    k_all[plan.prefix_positions] = buffers.k[column.prefix_slots].to(k.dtype)
    v_all[plan.prefix_positions] = buffers.v[column.prefix_slots].to(v.dtype)
    return k_all, v_all, plan.kv_indptr


def kept_sources(kept: torch.Tensor, kept_lens: torch.Tensor, kv_indptr: torch.Tensor) -> torch.Tensor:
    """Sequence index of each kept entry, [sum(kept_lens), H_kv], request-major.

    `kept` [B, H_kv, n] holds positions within each request (padded with -1 past kept_lens[b]);
    entry j of request b, head h, comes from key kv_indptr[b] + kept[b, h, j].
    """
    parts = [
        kept[b, :, : int(n)].T + int(start)
        for b, (n, start) in enumerate(zip(kept_lens.tolist(), kv_indptr[:-1].tolist()))
    ]
    return torch.cat(parts) if parts else kept.new_empty(0, kept.shape[1])


def sparse_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    plan: ForwardPlan,
    column: ColumnPlan,
    buffers: LaneBuffers,
    policy: ScoringPolicy,
    positions: torch.Tensor,
) -> torch.Tensor:
    """One decode step: store the new token, attend over the kept slots (`evict_planned` has
    run this step's evictions).

    `q` is [B, H_q, D], `k`/`v` [B, H_kv, D], `positions` [B] the new tokens' positions in their
    sequences. The new key's K/V and first score (the policy's `new_key_scores`) are stored in
    one launch (`write_entries`), and the kernel updates every kept key's score with its
    attention as the policy says (`score_update`: H2O-style accumulation by default), which the
    next eviction reads. Every shape here is fixed by the plan (no value is read back), so the
    step queues its work without waiting on the device and can be captured in a CUDA graph. A
    batch whose requests' own policies update scores in different ways runs the kernel once per
    policy, on its requests.
    """
    groups = policy_groups(plan, policy)
    kernels.write_entries(
        buffers.k,
        buffers.v,
        buffers.scores,
        column.new_slots,
        column.new_score_slots,
        k,
        v,
        _first_scores(groups, k, positions),
    )
    if len({group.policy.score_update for group in groups}) == 1:
        return _decode(q, column, buffers, sm_scale, groups[0].policy, slice(None))
    out = torch.empty_like(q)
    for group in groups:
        out[group.members] = _decode(q, column, buffers, sm_scale, group.policy, group.members)
    return out


def _first_scores(groups: tuple[PolicyGroup, ...], k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor | None:
    """The new keys' first scores [B, H_kv] by each request's policy (None: all zero)."""
    if len(groups) == 1:
        return groups[0].policy.new_key_scores(k, positions)
    scores = torch.zeros(k.shape[:2], dtype=torch.float32, device=k.device)
    for group in groups:
        first = group.policy.new_key_scores(k[group.members], positions[group.members])
        if first is not None:
            scores[group.members] = first
    return scores


def _decode(
    q: torch.Tensor,
    column: ColumnPlan,
    buffers: LaneBuffers,
    sm_scale: float,
    policy: ScoringPolicy,
    members: slice | torch.Tensor,
) -> torch.Tensor:
    """The decode kernel over the batch's `members` (positions in the batch), updating scores as
    `policy` says."""
    return kernels.decode_attention_with_scores(
        q[members],
        buffers.k,
        buffers.v,
        column.kv_lens[members],
        column.kv_indices[members],
        buffers.scores,
        sm_scale,
        score_indices=column.score_indices[members],
        score_update=policy.score_update,
    )


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
    decode graph."""
    for eviction in plan.evictions:
        spec = layout.groups[eviction.group]
        evict_group(lanes, spec, eviction, plan.sink, plan.window, eviction.policy or policy)


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


def sparse_mixed(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sm_scale: float,
    plan: MixedPlan,
    place: LayerPlace,
    buffers: LaneBuffers,
    policy: ScoringPolicy,
    positions: torch.Tensor,
    layer_id: int = -1,
    guide: PrefillGuide | None = None,
) -> torch.Tensor:
    """A mixed forward: `sparse_extend` for the prefill's tokens, then `sparse_decode` for the
    decoding rows' (one each); [T, H_q, D] in the batch's order, as `positions` [T]."""
    n = plan.extend_tokens
    prefill, decode = plan.extend, plan.decode
    column = prefill.column(place)
    o_extend = sparse_extend(q[:n], k[:n], v[:n], sm_scale, prefill, column, buffers, policy, layer_id, guide)
    o_decode = sparse_decode(
        q[n:], k[n:], v[n:], sm_scale, decode, decode.column(place), buffers, policy, positions[n:]
    )
    return torch.cat([o_extend, o_decode.view(-1, *o_extend.shape[1:])])


def _write(buffers: LaneBuffers, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """K/V of new entries (their scores are the caller's: they live in slots of their own)."""
    buffers.k[slots] = k.to(buffers.k.dtype)
    buffers.v[slots] = v.to(buffers.v.dtype)
