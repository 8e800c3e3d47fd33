"""The sparse layers' side of SGLang's attention backend, without SGLang: one forward's plan,
built once per step from the host tables, and its sparse layers run on it.

SGLang's backend hooks (`patches/attention.py`) only translate: they read the forward's plain
values off SGLang's `ForwardBatch` (request indices, lengths, ids) and call these methods in the
order SGLang calls the hooks. Everything they decide is here: which requests of a mixed batch
(SGLang's mixed chunk: prefills, then running requests' decode tokens) are decoding, whether a
prefill waits for the cross-layer guide, what the sentence marks record and count, and, for a
captured decode graph, the fixed buffers its replays are planned into (`DecodeBuffers`): nothing
variable runs inside the graph (the plan from the host tables, the evictions, the release of the
rows they read all run before or after it).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from sglang_kvsparse.forward.decode_graph import DecodeBuffers
from sglang_kvsparse.forward.eviction import prepare_decode
from sglang_kvsparse.forward.guide import PrefillGuide
from sglang_kvsparse.forward.planning import plan_extend
from sglang_kvsparse.forward.plans import ForwardPlan, MixedPlan
from sglang_kvsparse.forward.sparse_attention import UNIT_SCALES, KVScales, sparse_decode, sparse_extend, sparse_mixed
from sglang_kvsparse.policies.sentences import sentence_numbers
from sglang_kvsparse.state.requests import Phase
from sglang_kvsparse.state.sparse_state import SparseState


class SparseForward:
    """One forward at a time: `begin_decode` / `begin_extend` (or, for a captured decode graph,
    `begin_capture` / `begin_replay`), then every sparse layer's `extend` or `decode`."""

    def __init__(self, state: SparseState) -> None:
        self.state = state
        self.device = state.lanes[0].k.device
        self.plan: ForwardPlan | MixedPlan | None = None
        self._guide: PrefillGuide | None = None
        self._last_sparse_layer = max(state.layout.layer_places, default=-1)
        #: A captured decode graph's fixed buffers (`init_graph`).
        self.graph: DecodeBuffers | None = None

    # -- planning, once per forward -------------------------------------------------------
    def idle(self) -> None:
        """A forward with no request (SGLang's idle batch)."""
        self.plan, self._guide = None, None

    def begin_decode(self, req_indices: list[int], new_slots: torch.Tensor, input_ids: torch.Tensor) -> None:
        """A decode step of these requests, writing `input_ids` at `new_slots`: planned, its
        evictions run in every sparse layer."""
        self._guide = None
        self._mark(new_slots, input_ids)
        self.plan = prepare_decode(self.state, req_indices, self.device)

    def begin_extend(
        self,
        req_indices: list[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        prefix_ids: Sequence[torch.Tensor],
        new_slots: torch.Tensor,
        input_ids: torch.Tensor,
    ) -> None:
        """A prefill of these requests (their cached prefixes' full-pool ids `prefix_ids`, their
        new tokens at `new_slots`), possibly followed by running requests' decode tokens (a mixed
        batch: one token each, after every prefill's, with no prefix)."""
        self._mark(new_slots, input_ids)
        decoding = self.state.requests.is_(Phase.DECODING, torch.tensor(req_indices, dtype=torch.int64))
        prefilling = int((~decoding).sum())
        if bool(decoding[:prefilling].any()):
            raise NotImplementedError("kvsparse: a mixed batch whose decoding requests do not follow its prefills")
        tokens = sum(int(n) for n in extend_lens[:prefilling])
        extend = self._plan_extend(
            req_indices[:prefilling], prefix_lens[:prefilling], extend_lens[:prefilling], prefix_ids, new_slots[:tokens]
        )
        if prefilling == len(req_indices):
            self.plan = extend
        else:
            self.plan = MixedPlan(extend, prepare_decode(self.state, req_indices[prefilling:], self.device), tokens)
        self._guide = self._prefill_guide(extend)

    # -- a captured decode graph --------------------------------------------------------------
    def init_graph(self, max_bs: int) -> None:
        """Fixed buffers for decode graphs of up to `max_bs` requests."""
        self.graph = DecodeBuffers(self.state, max_bs, self.device)

    def begin_capture(self, batch_size: int) -> None:
        """Capturing a decode step of `batch_size` requests: its plan reads the fixed buffers."""
        self._guide = None
        self.plan = self.graph.plan(batch_size)

    def begin_replay(
        self, req_indices: list[int], batch_size: int, new_slots: torch.Tensor, input_ids: torch.Tensor
    ) -> None:
        """Before replaying a graph of `batch_size` requests for these (the first ones; the rest
        padding): their plan from the host tables, their evictions run, the buffers filled."""
        self._guide = None
        self._mark(new_slots, input_ids, len(req_indices))
        self.graph.fill(prepare_decode(self.state, req_indices, self.device))
        self.plan = self.graph.plan(batch_size)

    # -- the layers ---------------------------------------------------------------------------
    def extend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        sm_scale: float,
        positions: torch.Tensor,
        scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        """One sparse or sliding layer of a prefill (or mixed) forward: q [T, H_q, D] ->
        [T, H_q, D]; `scales`: the layer's, for an FP8 KV cache."""
        place = self.state.layout.layer_places[layer_id]
        lane, policy, guide = self.state.lanes[place.lane], self.state.policy, self._guide
        window = self.state.layout.groups[place.group].sliding_window
        if isinstance(self.plan, MixedPlan):
            plan = self.plan
            o = sparse_mixed(q, k, v, sm_scale, plan, place, lane, policy, positions, layer_id, guide, scales, window)
        else:
            column = self.plan.column(place)
            o = sparse_extend(q, k, v, sm_scale, self.plan, column, lane, policy, layer_id, guide, scales, window)
        self._after_layer(layer_id)
        return o

    def decode(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        sm_scale: float,
        positions: torch.Tensor,
        scales: KVScales = UNIT_SCALES,
    ) -> torch.Tensor:
        """One sparse layer of a decode step: q [B, H_q, D] -> [B, H_q, D]."""
        place = self.state.layout.layer_places[layer_id]
        lane, policy = self.state.lanes[place.lane], self.state.policy
        window = self.state.layout.groups[place.group].sliding_window
        column = self.plan.column(place)
        o = sparse_decode(q, k, v, sm_scale, self.plan, column, lane, policy, positions, scales, window)
        self._after_layer(layer_id)
        return o

    # -- internals ----------------------------------------------------------------------------
    def _plan_extend(
        self,
        req_indices: list[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        prefix_ids: Sequence[torch.Tensor],
        new_slots: torch.Tensor,
    ) -> ForwardPlan:
        """The prefill's plan, with its keys' sentences numbered once for every layer where the
        server marks sentence ends (counted for the requests that keep entries: a chunk before its
        prompt's last only stores them; the last one reads the whole prompt)."""
        prefix_ids = list(prefix_ids[: len(req_indices)])
        plan = plan_extend(self.state, req_indices, prefix_lens, extend_lens, prefix_ids, new_slots, self.device)
        marks = self.state.sentence_marks
        if marks is None:
            return plan
        ends = marks.ends_at(prefix_ids, new_slots, list(extend_lens))
        marks.count(ends if plan.kept_positions is None else ends[plan.kept_positions])
        return replace(plan, sentences=sentence_numbers(ends, plan.keys))

    def _prefill_guide(self, plan: ForwardPlan) -> PrefillGuide | None:
        """A guide for this prefill when the configuration names guide layers and some sparse
        layer selects for a request the guide chooses for (`ColumnPlan.guided`; None in a sliding
        column)."""
        guide_layers = self.state.resolved.guide_layers
        guided = [column.guided for group in plan.columns for column in group if column.compress]
        if guide_layers and any(g is not None and bool(g.any()) for g in guided):
            return PrefillGuide(guide_layers)
        return None

    def _mark(self, new_slots: torch.Tensor, input_ids: torch.Tensor, tokens: int | None = None) -> None:
        """Record which of the forward's slots hold a sentence-ending token (the first `tokens`
        of the input ids: a replay's padding writes none)."""
        marks = self.state.sentence_marks
        if marks is not None:
            marks.record(new_slots, input_ids if tokens is None else input_ids[:tokens])

    def _after_layer(self, layer_id: int) -> None:
        if layer_id == self._last_sparse_layer and self._guide is not None:
            self._guide.finish()
            self._guide = None
