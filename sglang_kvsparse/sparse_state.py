"""Per-request state of the sparse layers inside one scheduler process (no SGLang imports).

`SparseState` is what the SGLang patches attach to the request-to-token pool as its "aux cache":
SGLang calls `alloc_to_lengths` when rows grow (prefill, then one token per decode step) and
`free` on every release path (finish, abort, retraction), so the sparse layers' slots follow the
request lifecycle without any hook of our own. It owns

  * one `LayerIndexMap` (and its `SlotPool`) per *group* of sparse layers with equal
    `max_entries`: sparse layers advance in lockstep, so a row has the same slots in every layer
    of a group and one table serves them all;
  * each sparse layer's own K/V buffers `[buffer_slots, H_kv, D]` and scores `[buffer_slots, H_kv]`
    (fp32), indexed by the group's slots (layouts of docs/kernels.md).

A prefill keeps min(length, budget) entries per row (steps 1-2 of docs/sparse-backend-plan.md:
`sparse_attention.sparse_extend` fills them, compressing when the prompt is longer than the
budget). Decode eviction (step 3) is not built: a row that reaches `max_entries` during decode
raises, which is why the launcher still refuses budgets below the context length. Prefix reuse is
refused with an error.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from sglang_kvsparse.config import ResolvedSparsity
from sglang_kvsparse.index_map import IndexMapError, LayerIndexMap, SlotPool, round_up
from sglang_kvsparse.policies import build_policy


@dataclass(frozen=True)
class GroupPlan:
    """Kernel inputs of one layer group for one forward (tensors on the buffers' device).

    `kv_indptr`/`kv_indices`: the rows' slots in position order. `new_slots`: where this forward's
    kept tokens go (decode: one per row; prefill: the rows' slots, request-major). `budget` and
    `compress` (a prefill row longer than the budget) tell the prefill whether to select.
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    new_slots: torch.Tensor
    budget: int = 0
    compress: bool = False


@dataclass(frozen=True)
class ForwardPlan:
    """Everything a sparse layer's forward needs beyond its own buffers."""

    qo_indptr: torch.Tensor
    groups: tuple[GroupPlan, ...]
    sink: int = 0
    window: int = 0


@dataclass(frozen=True)
class LayerBuffers:
    """One sparse layer's K/V and score storage."""

    k: torch.Tensor
    v: torch.Tensor
    scores: torch.Tensor


class SparseState:
    """Slots, index maps and K/V buffers of every sparse layer, keyed by request row.

    Duck-types SGLang's aux-cache interface: `alloc_to_lengths`, `free`, `clear`,
    `reset_allocator`, `dense_capacity`.
    """

    def __init__(
        self,
        resolved: ResolvedSparsity,
        *,
        slots_per_layer: int,
        max_requests: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        dense_capacity: int,
        page_size: int = 1,
        device: str | torch.device = "cpu",
    ) -> None:
        self.resolved = resolved
        self.policy = build_policy(resolved.config)
        self.dense_capacity = dense_capacity
        self.page_size = page_size
        self.device = torch.device(device)
        slots = round_up(slots_per_layer, page_size)
        by_budget: dict[int, list[int]] = {}
        for layer in resolved.sparse_layers:
            by_budget.setdefault(resolved.budget(layer), []).append(layer)
        self.maps: list[LayerIndexMap] = []
        self.budgets: list[int] = []
        self.group_of: dict[int, int] = {}
        for budget, layers in sorted(by_budget.items()):
            self.group_of.update({layer: len(self.maps) for layer in layers})
            self.budgets.append(budget)
            max_entries = resolved.max_entries(layers[0])
            self.maps.append(LayerIndexMap(SlotPool(slots, page_size), max_requests, max_entries, self.device))
        rows = slots + page_size  # the padding page, see index_map
        self.buffers: dict[int, LayerBuffers] = {
            layer: LayerBuffers(
                k=torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=self.device),
                v=torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=self.device),
                scores=torch.zeros(rows, num_kv_heads, dtype=torch.float32, device=self.device),
            )
            for layer in resolved.sparse_layers
        }
        self.initial_free_slots = [m.pool.available_slots() for m in self.maps]
        self.requests_running_peak = 0
        self.logical = [0] * max_requests  # each row's sequence length (its entries may be fewer)
        self.forward_plans = 0  # forwards planned by the backend wrapper: proof the path runs

    # -- aux-cache interface (called by SGLang's ReqToTokenPool) -----------------------------
    def alloc_to_lengths(self, *, req_pool_indices_cpu: torch.Tensor, target_seq_lens_cpu: torch.Tensor) -> None:
        """Grow each row to its target length: a new row gets min(length, budget) entries (its
        prefill keeps that many), a running row one more.

        All-or-nothing across rows and groups, so a failure leaves no half-allocated row behind
        (SGLang frees the full-pool tokens and re-raises).
        """
        rows = [int(r) for r in req_pool_indices_cpu.tolist()]
        targets = [int(n) for n in target_seq_lens_cpu.tolist()]
        done: list[tuple[LayerIndexMap, list[int], list[int]]] = []
        try:
            for index_map, budget in zip(self.maps, self.budgets):
                new = [(row, min(n, budget)) for row, n in zip(rows, targets) if not index_map.is_active(row)]
                growing = [row for row, n in zip(rows, targets) if index_map.is_active(row)]
                for row, n in zip(rows, targets):
                    if index_map.is_active(row) and n != self.logical[row] + 1:
                        raise IndexMapError(
                            f"row {row} grows from {self.logical[row]} to {n} tokens: only one "
                            "decode token per step is supported (no chunked prefill or speculation)"
                        )
                    if index_map.is_active(row) and index_map.length(row) >= index_map.max_entries:
                        raise IndexMapError(
                            f"row {row} holds {index_map.max_entries} entries in a sparse layer; "
                            "decode eviction is not built yet"
                        )
                assigned: list[int] = []
                try:
                    for row, n in new:
                        index_map.assign(row, n)
                        assigned.append(row)
                    index_map.append_rows(growing)
                except Exception:
                    for row in assigned:
                        index_map.release(row)
                    raise
                done.append((index_map, assigned, growing))
        except Exception:
            for index_map, assigned, growing in done:
                for row in assigned:
                    index_map.release(row)
                for row in growing:
                    index_map.shrink(row, index_map.length(row) - 1)
            raise
        for row, n in zip(rows, targets):
            self.logical[row] = n
        self.requests_running_peak = max(self.requests_running_peak, self.requests_running())

    def free(self, row: int) -> None:
        """Release the row's slots in every group; a row that never got any is a no-op."""
        self.logical[row] = 0
        for index_map in self.maps:
            if index_map.is_active(row):
                index_map.release(row)

    def clear(self) -> None:
        self.logical = [0] * len(self.logical)
        for index_map in self.maps:
            for row in index_map.active_rows():
                index_map.release(row)

    def reset_allocator(self) -> None:
        self.clear()

    # -- forward -----------------------------------------------------------------------------
    def is_sparse(self, layer: int) -> bool:
        return layer in self.group_of

    def plan_extend(self, rows: Sequence[int], prefix_lens: Sequence[int], extend_lens: Sequence[int]) -> ForwardPlan:
        """Plan a prefill: every row is new and its slots receive min(length, budget) kept tokens."""
        if any(prefix_lens):
            raise IndexMapError(
                "an extend with a cached prefix reached a sparse layer: prefix reuse and chunked "
                "prefill must be off (SGLANG_RADIX_FORCE_MISS=1, --chunked-prefill-size -1)"
            )
        self.forward_plans += 1
        qo_indptr = _indptr(extend_lens)
        groups = []
        for index_map, budget in zip(self.maps, self.budgets):
            lengths = [index_map.length(row) for row in rows]
            kept = [min(int(n), budget) for n in extend_lens]
            if lengths != kept:
                raise IndexMapError(f"sparse rows hold {lengths} entries for a prefill keeping {kept}")
            indices = self._indices(index_map, rows)
            compress = any(int(n) > budget for n in extend_lens)
            groups.append(GroupPlan(self._to_device(_indptr(lengths)), indices, indices, budget, compress))
        config = self.resolved.config
        return ForwardPlan(self._to_device(qo_indptr), tuple(groups), config.sink, config.window)

    def plan_decode(self, rows: Sequence[int]) -> ForwardPlan:
        """Plan a decode step: each row's newest slot (appended by alloc) takes the new token."""
        self.forward_plans += 1
        groups = []
        for index_map in self.maps:
            lengths = [index_map.length(row) for row in rows]
            indptr = _indptr(lengths)
            indices = self._indices(index_map, rows)
            last = torch.tensor(indptr[1:], dtype=torch.int64, device=self.device) - 1
            groups.append(GroupPlan(self._to_device(indptr), indices, indices[last]))
        return ForwardPlan(self._to_device(_indptr([1] * len(rows))), tuple(groups))

    def group_plan(self, plan: ForwardPlan, layer: int) -> GroupPlan:
        return plan.groups[self.group_of[layer]]

    # -- observability -----------------------------------------------------------------------
    def requests_running(self) -> int:
        return len(self.maps[0].active_rows()) if self.maps else 0

    def stats(self) -> dict:
        """Per-layer slot use, for `/kvsparse/stats` and the leak checks of the tests."""
        layers = []
        for layer, (kind, budget) in enumerate(zip(self.resolved.kinds, self.resolved.budgets)):
            row = {"layer": layer, "kind": kind, "budget": budget}
            if kind == "sparse":
                pool = self.maps[self.group_of[layer]].pool
                row.update(slots_in_use=pool.slots_in_use(), slots_total=pool.num_slots)
            layers.append(row)
        return {
            "enabled": True,
            "config": self.resolved.config.to_dict(),
            "layers": layers,
            "pools": [
                {"budget": b, "max_entries": m.max_entries, "free_slots": m.pool.available_slots(), "initial_free_slots": free}
                for m, b, free in zip(self.maps, self.budgets, self.initial_free_slots)
            ],
            "requests_running": self.requests_running(),
            "requests_running_peak": self.requests_running_peak,
            "forward_plans": self.forward_plans,
        }

    # -- internals ---------------------------------------------------------------------------
    def _indices(self, index_map: LayerIndexMap, rows: Sequence[int]) -> torch.Tensor:
        parts = [index_map.slots(row) for row in rows]
        flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        return self._to_device(flat)

    def _to_device(self, values: list[int] | torch.Tensor) -> torch.Tensor:
        if isinstance(values, list):
            values = torch.tensor(values, dtype=torch.int32)
        return values.to(self.device, non_blocking=True)


def _indptr(lengths: Sequence[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + int(n))
    return out
