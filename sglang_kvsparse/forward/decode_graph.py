"""Fixed-shape decode inputs, for a decode step captured once and replayed (CUDA graphs).

A captured graph replays the same kernels on the same tensors, so everything a sparse layer reads
must live in buffers allocated before capture and be updated in place before each replay. Per
group of sparse columns, `DecodeBuffers` holds the decode tables (`plans.DecodeTables`) of up
to `max_bs` requests at the group's widest row (at the largest budget a request may ask for).
Before a replay, the step's plan is built as for an eager step (`planning.plan_decode`), its
evictions run (`eviction.evict_planned`: their shapes vary, so they stay outside the
graph), and `fill` copies its tables into the buffers; rows of the captured batch past the real
ones get no keys (a zero output) and store their token in the padding row. A captured step
reads each row's decode rule (`ForwardPlan.row_kinds`) from a buffer too, so requests with
policies of their own replay in the same graph (their evictions, ranked by their own policies,
run before it). No SGLang imports.
"""

from __future__ import annotations

import torch

from sglang_kvsparse.forward.plans import DecodeTables, ForwardPlan
from sglang_kvsparse.state.sparse_state import SparseState


class DecodeBuffers:
    """Preallocated decode tables of every sparse group, and the plans that read them."""

    def __init__(self, state: SparseState, max_bs: int, device: torch.device | str) -> None:
        if max_bs < 1:
            raise ValueError(f"max_bs must be positive, got {max_bs}")
        self.max_bs = max_bs
        self.sink, self.window = state.config.sink, state.config.window
        self.tables = tuple(self._empty(group.table.max_entries, group.columns, device) for group in state.groups)
        #: Each row's decode rule (`ScoringPolicy.decode_rule`), and the server policy's for every row.
        self.server_kinds = torch.empty((max_bs, 2), dtype=torch.int32, device=device)
        for column, kind in enumerate(state.policy.decode_rule()):
            self.server_kinds[:, column].fill_(kind)
        self.row_kinds = self.server_kinds.clone()
        #: The plan of each batch size asked for: views of the buffers, made once.
        self._plans: dict[int, ForwardPlan] = {}

    def _empty(self, width: int, columns: int, device: torch.device | str) -> DecodeTables:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(shape, dtype=torch.int32, device=device)

        return DecodeTables(
            zeros(self.max_bs),
            zeros(self.max_bs, width, columns),
            zeros(self.max_bs, width, columns),
            zeros(columns, self.max_bs),
            zeros(columns, self.max_bs),
        )

    def plan(self, bs: int) -> ForwardPlan:
        """The plan a graph of batch size `bs` is captured and replayed with: views of the
        buffers, so a replay reads whatever `fill` wrote last; made once per batch size."""
        if not 0 < bs <= self.max_bs:
            raise ValueError(f"a captured batch of {bs} requests: must be in 1..{self.max_bs}")
        if bs not in self._plans:
            qo_indptr = torch.arange(bs + 1, dtype=torch.int32, device=self.tables[0].lengths.device)
            rows = tuple(_rows(tables, bs) for tables in self.tables)
            self._plans[bs] = ForwardPlan(
                qo_indptr, (), self.sink, self.window, decode_tables=rows, row_kinds=self.row_kinds[:bs]
            )
        return self._plans[bs]

    def fill(self, plan: ForwardPlan) -> None:
        """Copy an eager decode plan's tables and decode rules in place (its evictions must
        already have run); rows past its batch get no keys and store into the padding row (slot
        0), by the server's rule."""
        if len(plan.decode_tables) != len(self.tables):
            raise ValueError("fill takes a decode plan of the same state")
        for step, buffers in zip(plan.decode_tables, self.tables):
            bs, width = step.entries.shape[:2]
            if bs > self.max_bs or width > buffers.entries.shape[1]:
                raise ValueError(f"a step of {bs} requests x {width} entries exceeds the buffers")
            buffers.lengths[:bs].copy_(step.lengths)
            buffers.lengths[bs:].zero_()
            buffers.entries[:bs, :width].copy_(step.entries)
            buffers.score_slots[:bs, :width].copy_(step.score_slots)
            buffers.newest[:, :bs].copy_(step.newest)
            buffers.newest[:, bs:].zero_()
            buffers.newest_scores[:, :bs].copy_(step.newest_scores)
            buffers.newest_scores[:, bs:].zero_()
        self.row_kinds.copy_(self.server_kinds)
        if plan.row_kinds is not None:
            self.row_kinds[: plan.row_kinds.shape[0]].copy_(plan.row_kinds)


def _rows(tables: DecodeTables, bs: int) -> DecodeTables:
    """The first `bs` requests' views of the tables."""
    return DecodeTables(
        tables.lengths[:bs],
        tables.entries[:bs],
        tables.score_slots[:bs],
        tables.newest[:, :bs],
        tables.newest_scores[:, :bs],
    )
