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

A prefill keeps min(length, budget) entries per row (`sparse_attention.sparse_extend` fills
them, compressing when the prompt is longer than the budget). During decode a row grows one entry
per step; when it holds `max_entries` (budget + evict_page) the step first evicts: the row is cut
back to `budget` entries here, at allocation time, and the forward (`sparse_attention.sparse_decode`)
moves the `budget` best-scored of the old entries into the kept positions before it writes the new
token. So a row never holds more than budget + one eviction page, however long the output.

Prefix reuse: with SGLang's radix cache on, each group also has a `PrefixStore`, which keeps the
uncompressed sparse-layer K/V of prompt tokens in free pages of the group's pool (evicted, least
recently used first, whenever rows need the pages). A prefill whose request matched a cached
prefix reads the prefix's K/V from there, so it attends, scores and selects exactly as without
the hit, and copies what it keeps into the row's own slots. Pages a step's prefill reads are
pinned from admission until the step is over (`begin_round`, or the next decode allocation).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from sglang_kvsparse.accounting import dense_kv_bytes, kv_bytes_in_use, kv_bytes_per_token
from sglang_kvsparse.config import ResolvedSparsity
from sglang_kvsparse.index_map import IndexMapError, LayerIndexMap, SlotPool, SlotPoolExhausted, round_up
from sglang_kvsparse.policies import build_policy
from sglang_kvsparse.prefix_store import PrefixStore


def score_bytes_per_slot(num_kv_heads: int) -> int:
    """Bytes of one sparse slot's scores: one float32 per KV head."""
    return 4 * num_kv_heads


@dataclass(frozen=True)
class GroupPlan:
    """Kernel inputs of one layer group for one forward (tensors on the buffers' device).

    `kv_indptr`/`kv_indices`: the rows' slots in position order. `new_slots`: where this forward's
    kept tokens go (decode: one per row; prefill: the rows' slots, request-major). `budget` and
    `compress` (a prefill row longer than the budget) tell the prefill whether to select.
    `evict_slots` (decode): [N, max_entries] old slots, in position order, of the N rows that
    evict this step; the forward keeps `budget` of them in the first `budget` slots.
    Prefill with the prefix store: `prefix_slots` (the matched prefixes' store slots,
    request-major, aligned with `ForwardPlan.prefix_positions`) and `store_slots` (where the
    batch's first `len(store_slots)` new tokens are stored for later hits).
    """

    kv_indptr: torch.Tensor
    kv_indices: torch.Tensor
    new_slots: torch.Tensor
    budget: int = 0
    compress: bool = False
    evict_slots: torch.Tensor | None = None
    prefix_slots: torch.Tensor | None = None
    store_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class ForwardPlan:
    """Everything a sparse layer's forward needs beyond its own buffers.

    A prefill attends over each request's whole sequence, prefix then new tokens, laid out
    request-major with boundaries `kv_indptr` (`qo_indptr` when no request has a prefix).
    `prefix_positions`/`new_positions` say where the prefixes' store entries and the batch's new
    tokens go in that layout (None when no request has a prefix).
    """

    qo_indptr: torch.Tensor
    groups: tuple[GroupPlan, ...]
    sink: int = 0
    window: int = 0
    kv_indptr: torch.Tensor | None = None
    prefix_positions: torch.Tensor | None = None
    new_positions: torch.Tensor | None = None


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
        slots_per_layer: Mapping[int, int],
        max_requests: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        dense_capacity: int,
        page_size: int = 1,
        device: str | torch.device = "cpu",
        prefix_cache: bool = False,
    ) -> None:
        """`dense_capacity`: SGLang's full-pool tokens (its ids are 1..dense_capacity + a page).
        `prefix_cache`: keep prompt tokens' K/V for radix-tree hits (SGLang's cache is on)."""
        self.resolved = resolved
        self.policy = build_policy(resolved.config)
        self.dense_capacity = dense_capacity
        self.page_size = page_size
        self.device = torch.device(device)
        self.bytes_per_token = kv_bytes_per_token(num_kv_heads, head_dim, dtype.itemsize)
        self.slot_bytes = self.bytes_per_token + score_bytes_per_slot(num_kv_heads)
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
            slots = min(slots_per_layer[layer] for layer in layers) // page_size * page_size
            self.maps.append(LayerIndexMap(SlotPool(slots, page_size), max_requests, max_entries, self.device))
        self.buffers: dict[int, LayerBuffers] = {}
        for layer in resolved.sparse_layers:
            rows = self.maps[self.group_of[layer]].pool.buffer_slots  # includes the padding page
            self.buffers[layer] = LayerBuffers(
                k=torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=self.device),
                v=torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=self.device),
                scores=torch.zeros(rows, num_kv_heads, dtype=torch.float32, device=self.device),
            )
        self.stores = [PrefixStore(m.pool, dense_capacity + page_size) for m in self.maps] if prefix_cache else []
        self.initial_free_slots = [m.pool.available_slots() for m in self.maps]
        self.requests_running_peak = 0
        self.prefix_hits = 0  # prefills that reused a cached prefix
        self.prefix_tokens_reused = 0
        self.logical = [0] * max_requests  # each row's sequence length (its entries may be fewer)
        # Per group: row -> its slots before the eviction alloc_to_lengths made, until the next
        # decode forward moves the survivors (plan_decode hands them over).
        self._evictions: list[dict[int, torch.Tensor]] = [{} for _ in self.maps]
        self.forward_plans = 0  # forwards planned by the backend wrapper: proof the path runs
        self.evictions = 0  # (row, group) evictions handed to decode forwards

    # -- aux-cache interface (called by SGLang's ReqToTokenPool) -----------------------------
    def alloc_to_lengths(self, *, req_pool_indices_cpu: torch.Tensor, target_seq_lens_cpu: torch.Tensor) -> None:
        """Grow each row to its target length: a new row gets min(length, budget) entries (its
        prefill keeps that many), a running row one more, after evicting down to the budget when
        it holds `max_entries` (the forward then moves the survivors' data, see `plan_decode`).

        All-or-nothing: every row and group is checked, free pages included, before anything
        changes, so a refusal leaves no half-allocated row behind (SGLang frees the full-pool
        tokens and re-raises).
        """
        rows = [int(r) for r in req_pool_indices_cpu.tolist()]
        targets = [int(n) for n in target_seq_lens_cpu.tolist()]
        if self.maps and all(self.maps[0].is_active(row) for row in rows):
            self._unpin()  # a decode step: the prefill that read the pinned pages is over
        needs = [self._check_growth(group, rows, targets) for group in range(len(self.maps))]
        for group, (index_map, budget) in enumerate(zip(self.maps, self.budgets)):
            if self.stores:
                self.stores[group].reclaim(needs[group])
            growing = []
            for row, n in zip(rows, targets):
                if not index_map.is_active(row):
                    index_map.assign(row, min(n, budget))
                    continue
                if index_map.length(row) == index_map.max_entries:
                    self._evictions[group][row] = index_map.slots(row)
                    index_map.shrink(row, budget)
                growing.append(row)
            index_map.append_rows(growing)
        for row, n in zip(rows, targets):
            self.logical[row] = n
        self.requests_running_peak = max(self.requests_running_peak, self.requests_running())

    def _check_growth(self, group: int, rows: list[int], targets: list[int]) -> int:
        """The pages `alloc_to_lengths` needs in `group`; raises, changing nothing, unless the
        group's free pages and the store's evictable ones cover them."""
        index_map, budget, page = self.maps[group], self.budgets[group], self.page_size
        pages = 0
        for row, n in zip(rows, targets):
            if not index_map.is_active(row):
                pages += round_up(min(n, budget), page) // page
                continue
            if n != self.logical[row] + 1:
                raise IndexMapError(
                    f"row {row} grows from {self.logical[row]} to {n} tokens: only one "
                    "decode token per step is supported (no chunked prefill or speculation)"
                )
            if row in self._evictions[group]:
                raise IndexMapError(f"row {row} grows again before its eviction ran in a forward")
            held = index_map.length(row)
            kept = budget if held == index_map.max_entries else held
            pages += round_up(kept + 1, page) // page - round_up(held, page) // page
        if pages > self.available_pages(group):
            raise SlotPoolExhausted(
                f"sparse pool needs {pages} pages, {self.available_pages(group)} free or evictable: "
                "admission let in more than fits"
            )
        return pages

    def free(self, row: int) -> None:
        """Release the row's slots in every group; a row that never got any is a no-op."""
        self.logical[row] = 0
        for index_map, evictions in zip(self.maps, self._evictions):
            evictions.pop(row, None)
            if index_map.is_active(row):
                index_map.release(row)

    def clear(self) -> None:
        for row in range(len(self.logical)):
            self.free(row)
        for store in self.stores:
            store.clear()

    def reset_allocator(self) -> None:
        self.clear()

    # -- admission (see sglang_kvsparse.admission) --------------------------------------------
    def available_pages(self, group: int) -> int:
        """Pages of the group a request can be given: free ones and the store's evictable ones."""
        store = self.stores[group].evictable_pages() if self.stores else 0
        return self.maps[group].pool.available_pages() + store

    def begin_round(self) -> None:
        """A new scheduling round: the previous step's forward is over, unpin its prefixes."""
        self._unpin()

    def prefix_pages_to_pin(self, prefix_ids: torch.Tensor) -> list[int]:
        """Per group, the evictable store pages a request reusing `prefix_ids` would pin."""
        return [store.unpinned_pages_of(prefix_ids) for store in self.stores] or [0] * len(self.maps)

    def pin_prefix(self, prefix_ids: torch.Tensor) -> None:
        """Keep the prefix's store pages until the step that reads them is over."""
        for store in self.stores:
            store.pin(prefix_ids)

    def reusable_prefix_len(self, prefix_ids: torch.Tensor, seq_len: int) -> int:
        """How much of a radix match of `prefix_ids` a prefill of `seq_len` tokens can reuse:
        the leading ids with store entries in every group, leaving the last `window` tokens (the
        observation window) to the prefill, whole pages only. 0 without a store."""
        if not self.stores:
            return 0
        valid = min(store.valid_prefix_len(prefix_ids) for store in self.stores)
        usable = max(min(valid, seq_len - self.resolved.config.window), 0)
        return usable - usable % self.page_size

    def pages_to_hold(self, final_len: int) -> list[int]:
        """Per group, the most pages a request that reaches `final_len` tokens ever holds."""
        return [
            round_up(min(final_len, index_map.max_entries), self.page_size) // self.page_size
            for index_map in self.maps
        ]

    def pages_held(self, row: int) -> list[int]:
        """Per group, the pages the row holds now (0 for a row without slots)."""
        return [
            round_up(index_map.length(row), self.page_size) // self.page_size if index_map.is_active(row) else 0
            for index_map in self.maps
        ]

    # -- forward -----------------------------------------------------------------------------
    def is_sparse(self, layer: int) -> bool:
        return layer in self.group_of

    def plan_extend(
        self,
        rows: Sequence[int],
        prefix_lens: Sequence[int],
        extend_lens: Sequence[int],
        prefix_ids: Sequence[torch.Tensor] = (),
        new_ids: torch.Tensor | None = None,
    ) -> ForwardPlan:
        """Plan a prefill: every row is new and its slots receive min(length, budget) kept
        entries of its whole sequence (cached prefix + new tokens).

        With the prefix store, `prefix_ids` (per row, SGLang's full-pool ids of its matched
        prefix) and `new_ids` (the batch's new tokens' ids, request-major) are required: the new
        ids' old entries are invalidated, the prefixes' store slots looked up (they were pinned at
        admission, so they are there), and the new tokens get store slots where the pool has room.
        """
        prefix_lens = [int(n) for n in prefix_lens]
        extend_lens = [int(n) for n in extend_lens]
        if any(prefix_lens) and not self.stores:
            raise IndexMapError(
                "an extend with a cached prefix reached a sparse layer without a prefix store: "
                "chunked prefill must be off (--chunked-prefill-size -1)"
            )
        self.forward_plans += 1
        self.prefix_hits += sum(1 for n in prefix_lens if n)
        self.prefix_tokens_reused += sum(prefix_lens)
        seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
        new_cpu = None if new_ids is None else new_ids.to("cpu", torch.int64)
        prefix_cpu = [ids.to("cpu") for ids in prefix_ids] if self.stores else []
        groups = []
        for group, (index_map, budget) in enumerate(zip(self.maps, self.budgets)):
            lengths = [index_map.length(row) for row in rows]
            kept = [min(n, budget) for n in seq_lens]
            if lengths != kept:
                raise IndexMapError(f"sparse rows hold {lengths} entries for a prefill keeping {kept}")
            indices = self._indices(index_map, rows)
            compress = any(n > budget for n in seq_lens)
            prefix_slots = store_slots = None
            if self.stores:
                prefix_slots, store_slots = self._use_store(self.stores[group], rows, prefix_cpu, new_cpu)
            groups.append(
                GroupPlan(self._to_device(_indptr(lengths)), indices, indices, budget, compress,
                          prefix_slots=prefix_slots, store_slots=store_slots)
            )
        config = self.resolved.config
        plan = ForwardPlan(self._to_device(_indptr(extend_lens)), tuple(groups), config.sink, config.window)
        if not any(prefix_lens):
            return plan
        kv_indptr = _indptr(seq_lens)
        prefix_positions = torch.cat([torch.arange(n) + start for n, start in zip(prefix_lens, kv_indptr)])
        new_positions = torch.cat([torch.arange(e) + start + p for p, e, start in zip(prefix_lens, extend_lens, kv_indptr)])
        return dataclasses.replace(
            plan,
            kv_indptr=self._to_device(kv_indptr),
            prefix_positions=self._to_device(prefix_positions),
            new_positions=self._to_device(new_positions),
        )

    def _use_store(
        self, store: PrefixStore, rows: Sequence[int], prefix_ids: Sequence[torch.Tensor], new_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the prefixes' store slots, the new tokens' store slots) of one group, on the device;
        `prefix_ids` and `new_ids` on the CPU."""
        if new_ids is None or len(prefix_ids) != len(rows):
            raise IndexMapError("a prefill with the prefix store needs every row's prefix ids and the new ids")
        store.invalidate(new_ids)
        parts = [store.lookup(ids) for ids in prefix_ids]
        prefix_slots = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
        if bool((prefix_slots == 0).any()):
            raise IndexMapError("a matched prefix lost its store entries before its prefill (not pinned?)")
        store.touch(prefix_slots)
        return self._to_device(prefix_slots), self._to_device(store.put(new_ids))

    def plan_decode(self, rows: Sequence[int], new_ids: torch.Tensor | None = None) -> ForwardPlan:
        """Plan a decode step: each row's newest slot (appended by alloc) takes the new token,
        and the rows that alloc cut back to the budget get their eviction (`evict_slots`).
        `new_ids` (SGLang's full-pool ids of the new tokens) lose their old store entries."""
        self.forward_plans += 1
        if self.stores:
            if new_ids is None:
                raise IndexMapError("a decode with the prefix store needs the new tokens' ids")
            new_cpu = new_ids.to("cpu")
            for store in self.stores:
                store.invalidate(new_cpu)
        groups = []
        for index_map, budget, evictions in zip(self.maps, self.budgets, self._evictions):
            lengths = [index_map.length(row) for row in rows]
            indptr = _indptr(lengths)
            indices = self._indices(index_map, rows)
            last = torch.tensor(indptr[1:], dtype=torch.int64, device=self.device) - 1
            evicting = [evictions.pop(row) for row in rows if row in evictions]
            if evictions:
                raise IndexMapError(f"rows {sorted(evictions)} evicted but are not in this decode batch")
            evict_slots = self._to_device(torch.stack(evicting)) if evicting else None
            self.evictions += len(evicting)
            groups.append(GroupPlan(self._to_device(indptr), indices, indices[last], budget, evict_slots=evict_slots))
        config = self.resolved.config
        return ForwardPlan(self._to_device(_indptr([1] * len(rows))), tuple(groups), config.sink, config.window)

    def group_plan(self, plan: ForwardPlan, layer: int) -> GroupPlan:
        return plan.groups[self.group_of[layer]]

    def _unpin(self) -> None:
        for store in self.stores:
            store.unpin_all()

    # -- observability -----------------------------------------------------------------------
    def requests_running(self) -> int:
        return len(self._running_rows())

    def _running_rows(self) -> list[int]:
        return self.maps[0].active_rows() if self.maps else []

    def _full_tokens_in_use(self, rows: list[int]) -> int:
        """SGLang's pool tokens the running `rows` hold (every token, rounded to pages)."""
        return sum(round_up(self.logical[row], self.page_size) for row in rows)

    def kv_bytes(self) -> tuple[int, int]:
        """(bytes the running requests hold, bytes stock SGLang would hold for them).

        Running rows only: tokens the radix tree caches for finished requests belong to none.
        """
        rows = self._running_rows()
        resolved, page = self.resolved, self.page_size
        full_tokens = self._full_tokens_in_use(rows)
        sparse_slots = {layer: self.row_slots_in_use(group) for layer, group in self.group_of.items()}
        in_use = kv_bytes_in_use(full_tokens, sparse_slots, resolved, self.bytes_per_token, self.slot_bytes)
        dense = sum(dense_kv_bytes(self.logical[row], resolved.num_layers, self.bytes_per_token, page) for row in rows)
        return in_use, dense

    def row_slots_in_use(self, group: int) -> int:
        """Slots the group's request rows hold (the pool's used slots less the store's)."""
        return self.maps[group].pool.slots_in_use() - self.prefix_cache_slots(group)

    def prefix_cache_slots(self, group: int) -> int:
        return self.stores[group].slots() if self.stores else 0

    def stats(self) -> dict:
        """Per-layer slot use and bytes, for `/kvsparse/stats`, the metrics and the tests."""
        layers = []
        full_in_use = self._full_tokens_in_use(self._running_rows())
        for layer, (kind, budget) in enumerate(zip(self.resolved.kinds, self.resolved.budgets)):
            if kind == "sparse":
                group = self.group_of[layer]
                in_use, total = self.row_slots_in_use(group), self.maps[group].pool.num_slots
                cached = {"prefix_cache_slots": self.prefix_cache_slots(group)}
            else:  # SGLang's pool: the running requests' tokens (the radix tree may cache more)
                in_use, total, cached = full_in_use, self.dense_capacity, {}
            layers.append(
                {"layer": layer, "kind": kind, "budget": budget, "slots_in_use": in_use, "slots_total": total, **cached}
            )
        in_use, dense = self.kv_bytes()
        return {
            "enabled": True,
            "config": self.resolved.config.to_dict(),
            "layers": layers,
            "kv_bytes_in_use": in_use,
            "kv_bytes_if_dense": dense,
            "pools": [
                {
                    "budget": b,
                    "max_entries": m.max_entries,
                    "free_slots": m.pool.available_slots(),
                    "prefix_cache_slots": self.prefix_cache_slots(group),
                    "initial_free_slots": free,
                }
                for group, (m, b, free) in enumerate(zip(self.maps, self.budgets, self.initial_free_slots))
            ],
            "prefix_cache": bool(self.stores),
            "prefix_hits": self.prefix_hits,
            "prefix_tokens_reused": self.prefix_tokens_reused,
            "requests_running": self.requests_running(),
            "requests_running_peak": self.requests_running_peak,
            "forward_plans": self.forward_plans,
            "evictions": self.evictions,
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
