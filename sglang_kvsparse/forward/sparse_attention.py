"""The attention of one sparse layer for one forward, over its own buffers (no SGLang imports).

The SGLang backend wrapper (`sglang_kvsparse.patches.attention`) calls these for sparse layers
and delegates full layers to the stock backend. Attention goes through the dispatchers of
`sglang_kvsparse.kernels`, so the same code runs the Triton kernels on CUDA and their torch
references on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse import kernels
from sglang_kvsparse.forward.guide import PrefillGuide
from sglang_kvsparse.forward.plans import ColumnPlan, ForwardPlan, MixedPlan, PolicyGroup
from sglang_kvsparse.kernels.common import FP8_DTYPES, Segments, quantize
from sglang_kvsparse.policies import PrefillScoringInputs, ScoringPolicy, StreamingLLMPolicy
from sglang_kvsparse.state.device_copy import upload
from sglang_kvsparse.state.layout import LayerPlace
from sglang_kvsparse.state.sparse_group import LaneBuffers


@dataclass(frozen=True)
class KVScales:
    """A layer's K and V scales in an FP8 KV cache (SGLang's `k_scale` / `v_scale`: a stored
    value times its scale is the real one; 1 without checkpoint scales)."""

    k: float = 1.0
    v: float = 1.0


UNIT_SCALES = KVScales()

#: How a sliding layer ranks its entries, whatever the server's or a request's policy: by
#: position, so that it keeps the sinks and the latest keys (its window among them) and its
#: attention, masked to the window, reads what the model's does.
SLIDING_POLICY = StreamingLLMPolicy()


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
    scales: KVScales = UNIT_SCALES,
    sliding_window: int = 0,
) -> torch.Tensor:
    """Prefill: attend over each request's whole sequence, then store what is kept.

    The keys are the batch's own `k`/`v` ([T, H_kv, D]), preceded per request by its cached
    prefix's entries from the prefix store when it has one (`sequence_kv`). When every row fits
    its budget all entries are stored with the score the policy gives a decoded key
    (`first_score`: zero for the attention-based ones); otherwise `policy` scores the keys (SnapKV:
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

    Into an FP8 lane the new tokens' K/V are quantized first (`scales`), and the attention, the
    scores and every copy read those quantized values, as a layer of SGLang's own FP8 pool reads
    back what it wrote.

    A sliding layer (`sliding_window` W > 0) attends, per query, over its last W keys, and keeps
    every request's entries by `SLIDING_POLICY` (no guide: `column.guided` is None there).
    """
    groups = layer_policies(plan, policy, sliding_window)
    if buffers.k.dtype in FP8_DTYPES:
        k, v = quantize(k, buffers.k.dtype, scales.k), quantize(v, buffers.v.dtype, scales.v)
    k_all, v_all = sequence_kv(k, v, plan, column, buffers)
    keys = plan.keys
    positions = torch.arange(k_all.shape[0], device=k.device, dtype=torch.int64)
    guiding = guide is not None and guide.guides(layer_id)
    guided = column.guided if guide is not None and column.compress else None
    # A layer scores for its own selection, or for the guide; a layer outside the guide needs
    # no scores of its own (nor the softmax statistics) when the guide chooses for every request.
    scoring = guiding or (column.compress and (guided is None or not bool(guided.all())))
    o, lse = kernels.extend_attention_with_stats(
        q,
        k_all,
        v_all,
        plan.qo_indptr,
        keys.indptr,
        positions,
        sm_scale,
        with_stats=scoring,
        k_scale=scales.k,
        v_scale=scales.v,
        window=sliding_window,
        max_q_len=plan.max_q_len,
    )
    if column.store_slots is not None and column.store_slots.numel():
        _write(buffers, column.store_slots, k[plan.store_positions], v[plan.store_positions])
    scores = None
    if scoring:
        inputs = PrefillScoringInputs(
            q,
            k_all,
            lse,
            plan.qo_indptr,
            keys,
            positions,
            sm_scale,
            plan.window,
            plan.sink,
            plan.sentences,
            scales.k,
        )
        for group in groups:
            mine = group.policy.score(inputs)  # of the whole batch: a batch mixes policies rarely
            scores = mine if scores is None else torch.where(group.mask[keys.ids][:, None], mine, scores)
    if guiding:
        guide.add(layer_id, scores)
    if not column.compress:
        _keep_all(k_all, v_all, keys, plan, column, buffers, groups, scales.k)
    elif guided is None or not bool(guided.any()):
        _keep(k_all, v_all, keys, scores, plan, column, buffers)
    else:
        own = ~guided
        if bool(own.any()):  # the requests that keep by this layer's own scores keep now
            _keep(k_all, v_all, keys, scores, plan, column, buffers, only=own)
        # The guided requests' new tokens wait in heap rows of their own (`ColumnPlan.work_slots`).
        _write(buffers, column.work_slots, k[plan.work_positions], v[plan.work_positions])

        def keep_by_guide(guide_scores: torch.Tensor) -> None:
            k_new, v_new = torch.zeros_like(k), torch.zeros_like(v)
            _set_rows(k_new, plan.work_positions, _rows(buffers.k, column.work_slots).to(k.dtype))
            _set_rows(v_new, plan.work_positions, _rows(buffers.v, column.work_slots).to(v.dtype))
            k_seq, v_seq = sequence_kv(k_new, v_new, plan, column, buffers)
            by = guide_scores[:, None].expand(-1, k.shape[1])
            _keep(k_seq, v_seq, keys, by, plan, column, buffers, only=guided)

        guide.defer(keep_by_guide)
    return o


def _keep_all(
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    keys: Segments,
    plan: ForwardPlan,
    column: ColumnPlan,
    buffers: LaneBuffers,
    groups: tuple[PolicyGroup, ...],
    k_scale: float,
) -> None:
    """Every request fits its budget: its entries are all stored, scored as decoded keys are
    (from the real keys: FP8 ones times `k_scale`), so that later evictions compare them in the
    policy's units."""
    in_sequence, requests = keys.positions, keys.ids
    if plan.kept_positions is not None:
        k_all, v_all = _rows(k_all, plan.kept_positions), _rows(v_all, plan.kept_positions)
        in_sequence, requests = in_sequence[plan.kept_positions], requests[plan.kept_positions]
    _write(buffers, column.new_slots, k_all, v_all)
    for group in groups:
        keys = slice(None) if group.mask is None else group.mask[requests]
        mine = _rows(k_all, keys)
        real = mine.to(torch.float32) * k_scale if mine.dtype in FP8_DTYPES else mine
        buffers.scores[column.new_score_slots[keys]] = kernels.first_scores(
            group.policy.first_score, real, in_sequence[keys]
        )


def _keep(
    k_all: torch.Tensor,
    v_all: torch.Tensor,
    keys: Segments,
    scores: torch.Tensor,
    plan: ForwardPlan,
    column: ColumnPlan,
    buffers: LaneBuffers,
    only: torch.Tensor | None = None,
) -> None:
    """Select sink + window + the best-scored rest up to each request's budget per KV head, and
    scatter the kept K/V and their scores into the requests' rows; with `only` (host [B]), into
    the rows of those requests alone, the others' left as they are."""
    kept, kept_lens = kernels.select_kept(
        scores, keys, column.budgets, plan.sink, plan.window, budget_on_device=column.device_budgets
    )
    if plan.keeps is not None:
        kept_lens = kept_lens * plan.keeps
    slots, score_slots = column.new_slots, column.new_score_slots
    if only is not None:  # their indices among the rows, which hold every keeping request's, request-major
        if column.kept is None:
            raise ValueError("a selection for some of a batch's requests needs the plan's host counts (`kept`)")
        firsts = torch.cumsum(column.kept, 0) - column.kept
        parts = [torch.arange(first, first + n) for first, n, mine in zip(firsts, column.kept, only.tolist()) if mine]
        chosen = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)
        chosen, mask = upload([chosen, only], slots.device)
        slots, score_slots = slots[chosen], score_slots[chosen]
        kept_lens = kept_lens * mask
    src = kept_sources(kept, kept_lens, keys.indptr, slots.shape[0])
    heads = torch.arange(k_all.shape[1], device=k_all.device)[None, :]
    dst = slots[:, None]
    _set_rows(buffers.k, (dst, heads), _rows(k_all, (src, heads)).to(buffers.k.dtype))
    _set_rows(buffers.v, (dst, heads), _rows(v_all, (src, heads)).to(buffers.v.dtype))
    buffers.scores[score_slots[:, None], heads] = scores[src, heads]


def layer_policies(plan: ForwardPlan, policy: ScoringPolicy, sliding_window: int = 0) -> tuple[PolicyGroup, ...]:
    """The policies of a layer's prefill with their requests: in a sliding layer
    `SLIDING_POLICY` for every request; else the plan's, or without any of a request's own the
    server's `policy` for every request (`members` and `mask` None)."""
    if sliding_window:
        return (PolicyGroup(SLIDING_POLICY, None, None),)
    return plan.policy_groups or (PolicyGroup(policy, None, None),)


def sequence_kv(
    k: torch.Tensor, v: torch.Tensor, plan: ForwardPlan, column: ColumnPlan, buffers: LaneBuffers
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's keys and values in sequence order (cached prefix, then its new tokens),
    request-major, as `plan.keys` bounds them. Without prefixes that is the batch's own `k`/`v`."""
    if plan.prefix_positions is None:
        return k, v
    total = plan.prefix_positions.numel() + k.shape[0]
    k_all = k.new_empty((total, *k.shape[1:]))
    v_all = v.new_empty((total, *v.shape[1:]))
    _set_rows(k_all, plan.new_positions, k)
    _set_rows(v_all, plan.new_positions, v)
    _set_rows(k_all, plan.prefix_positions, _rows(buffers.k, column.prefix_slots).to(k.dtype))
    _set_rows(v_all, plan.prefix_positions, _rows(buffers.v, column.prefix_slots).to(v.dtype))
    return k_all, v_all


def kept_sources(kept: torch.Tensor, kept_lens: torch.Tensor, kv_indptr: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of each kept entry, [total, H_kv], request-major; `total` = sum(kept_lens),
    known on the host (the rows the plan gave the kept entries), so nothing is read back.

    `kept` [B, H_kv, n] holds positions within each request (padded with -1 past kept_lens[b]);
    entry j of request b, head h, comes from key kv_indptr[b] + kept[b, h, j].
    """
    kept_indptr = torch.zeros(kept_lens.numel() + 1, dtype=torch.int64, device=kept.device)
    kept_indptr[1:] = torch.cumsum(kept_lens, 0)
    entries = Segments(kept_indptr, total, kept.shape[2])
    return kept[entries.ids, :, entries.positions] + kv_indptr.to(torch.int64)[entries.ids, None]


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
    scales: KVScales = UNIT_SCALES,
    sliding_window: int = 0,
) -> torch.Tensor:
    """One decode step: store the new token, attend over the kept slots (`evict_planned` has
    run this step's evictions). Into an FP8 lane the new K/V are quantized by `scales`, which
    the attention applies when it reads.

    `q` is [B, H_q, D], `k`/`v` [B, H_kv, D], `positions` [B] the new tokens' positions in their
    sequences. The new key's K/V and first score (the policy's `first_score`) are stored in one
    launch (`write_entries`), and the kernel updates every kept key's score with its attention as
    the policy says (`score_update`: H2O-style accumulation by default), which the next eviction
    reads. Both rules are `policy`'s for every row, or each row's own where the plan has
    `row_kinds` (some request decodes otherwise than the server's policy, or a captured step):
    still one launch each. Every shape here is fixed by the plan (no value is read back), so the
    step queues its work without waiting on the device and can be captured in a CUDA graph. A
    sliding layer (`sliding_window` W > 0) attends over each row's last W entries, its keys
    scored by `SLIDING_POLICY`.
    """
    rows = None if sliding_window else plan.row_kinds
    rule = SLIDING_POLICY if sliding_window else policy
    kernels.write_entries(
        buffers.k,
        buffers.v,
        buffers.scores,
        column.new_slots,
        column.new_score_slots,
        k,
        v,
        positions,
        first_score=rule.first_score,
        first_kinds=None if rows is None else rows[:, 1],
        k_scale=scales.k,
        v_scale=scales.v,
    )
    return kernels.decode_attention_with_scores(
        q,
        buffers.k,
        buffers.v,
        column.kv_lens,
        column.kv_indices,
        buffers.scores,
        sm_scale,
        score_indices=column.score_indices,
        score_update=rule.score_update,
        row_updates=None if rows is None else rows[:, 0],
        k_scale=scales.k,
        v_scale=scales.v,
        window=sliding_window,
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
    scales: KVScales = UNIT_SCALES,
    sliding_window: int = 0,
) -> torch.Tensor:
    """A mixed forward: `sparse_extend` for the prefill's tokens, then `sparse_decode` for the
    decoding rows' (one each); [T, H_q, D] in the batch's order, as `positions` [T]."""
    n = plan.extend_tokens
    prefill, decode = plan.extend, plan.decode
    column = prefill.column(place)
    o_extend = sparse_extend(
        q[:n], k[:n], v[:n], sm_scale, prefill, column, buffers, policy, layer_id, guide, scales, sliding_window
    )
    o_decode = sparse_decode(
        q[n:],
        k[n:],
        v[n:],
        sm_scale,
        decode,
        decode.column(place),
        buffers,
        policy,
        positions[n:],
        scales,
        sliding_window,
    )
    return torch.cat([o_extend, o_decode.view(-1, *o_extend.shape[1:])])


def _write(buffers: LaneBuffers, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """K/V of new entries (their scores are the caller's: they live in slots of their own); into
    an FP8 lane `k`/`v` come quantized (`sparse_extend`)."""
    _set_rows(buffers.k, slots, k.to(buffers.k.dtype))
    _set_rows(buffers.v, slots, v.to(buffers.v.dtype))


def _rows(buffer: torch.Tensor, index: torch.Tensor | tuple[torch.Tensor, ...]) -> torch.Tensor:
    """`buffer[index]`; FP8 through its bytes (not every CUDA indexing kernel takes FP8)."""
    if buffer.dtype in FP8_DTYPES:
        return buffer.view(torch.uint8)[index].view(buffer.dtype)
    return buffer[index]


def _set_rows(buffer: torch.Tensor, index: torch.Tensor | tuple[torch.Tensor, ...], values: torch.Tensor) -> None:
    """`buffer[index] = values` (in `buffer`'s dtype); FP8 through its bytes, as `_rows`."""
    if buffer.dtype in FP8_DTYPES:
        buffer.view(torch.uint8)[index] = values.view(torch.uint8)
    else:
        buffer[index] = values
