"""A `HeapRows` test double and a `SparseState` built on it, for the unit tests.

`FreeList` is the heap as SGLang's allocator would hand it out (pages of `page_size` rows, ids
from 1), with the checks a test needs: a double free or a partial page raises, and
`cached`/`evict_cache` stand in for SGLang's radix tree (ids it holds, freed on demand).
`decode_lifecycle` drives a state through requests that join, decode, evict and finish, with the
decode step pluggable (eager, or through fixed buffers as a replayed graph; `bench/gpu_check.py`
runs it on a GPU too).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sglang_kvsparse.config import SparsityConfig
from sglang_kvsparse.config.request_sparsity import SERVER_SETTING, RequestSparsity
from sglang_kvsparse.forward.eviction import evict_planned
from sglang_kvsparse.forward.planning import plan_decode, plan_extend
from sglang_kvsparse.forward.plans import ForwardPlan
from sglang_kvsparse.forward.sparse_attention import sparse_decode, sparse_extend
from sglang_kvsparse.forward.sparse_forward import SparseForward
from sglang_kvsparse.policies import POLICIES, ScoringPolicy, SnapKVPolicy
from sglang_kvsparse.state.requests import Phase
from sglang_kvsparse.state.sparse_group import LaneBuffers
from sglang_kvsparse.state.sparse_state import SparseState

H_KV, D = 2, 8


class FreeList:
    def __init__(self, rows: int, page_size: int = 1) -> None:
        assert rows % page_size == 0
        self.page_size = page_size
        self.rows = rows
        self.free = list(range(rows // page_size, 0, -1))  # page ids, low ids taken first
        self.in_use = torch.zeros(rows // page_size + 1, dtype=torch.bool)
        self.cached: list[torch.Tensor] = []  # "radix tree" entries: SGLang ids, oldest first
        self.refills = 0  # one free list, on the host: nothing is ever read back
        # With a prefix store, SGLang's free of its own ids goes to the state (as the allocator's).
        self.on_free = None

    def take(self, rows: int) -> torch.Tensor | None:
        assert rows % self.page_size == 0
        pages = rows // self.page_size
        if pages > len(self.free):
            return None
        taken = torch.tensor([self.free.pop() for _ in range(pages)], dtype=torch.int64)
        assert not bool(self.in_use[taken].any())
        self.in_use[taken] = True
        return (taken[:, None] * self.page_size + torch.arange(self.page_size)).reshape(-1)

    def give(self, rows: torch.Tensor) -> None:
        rows = rows.reshape(-1).long()
        if rows.numel() == 0:
            return
        assert rows.numel() % self.page_size == 0, "partial page"
        pages = rows.view(-1, self.page_size)
        assert torch.equal(pages, pages[:, :1] + torch.arange(self.page_size)), "not whole pages"
        ids = pages[:, 0] // self.page_size
        assert bool(self.in_use[ids].all()) and ids.unique().numel() == ids.numel(), "double free"
        self.in_use[ids] = False
        self.free.extend(ids.tolist())

    def free_rows(self) -> int:
        return len(self.free) * self.page_size

    def reserve(self, rows: int) -> None:
        return None  # one free list, on the host: nothing to move

    def sglang_alloc(self, tokens: int) -> torch.Tensor:
        """SGLang's own allocation of full-pool ids (no reclaim: tests make room themselves)."""
        rows = self.take(tokens)
        assert rows is not None, "heap exhausted"
        return rows

    def sglang_free(self, ids: torch.Tensor) -> None:
        """As the heap allocator's `free`: with a prefix store the ids reach the free list through
        the state (after their store entries are gone), without one directly."""
        if self.on_free is None:
            self.give(ids)
        else:
            self.on_free(ids)

    def evict_cache(self, rows: int) -> None:
        while self.cached and self.free_rows() < rows:
            self.sglang_free(self.cached.pop(0))


def make_state(
    num_layers=4,
    full_layers=(0,),
    context=64,
    rows=256,
    page=1,
    max_requests=8,
    budget=None,
    window=2,
    evict_page=16,
    prefix_cache=False,
    pool_kernel=1,
    device="cpu",
    policy: ScoringPolicy | None = None,
    max_request_budget: int | None = None,
    guide_from: float | None = None,
    guide_below: float | None = None,
    head_dim: int = D,
    dtype: torch.dtype = torch.float32,
    sliding_layers: tuple[int, ...] = (),
    sliding_window: int = 0,
    sink: int = 1,
) -> tuple[SparseState, FreeList]:
    """A state of `num_layers` layers (`full_layers` full, one lane per full layer; the model's
    `sliding_layers` of `sliding_window`) on a heap of `rows` rows, its lanes ([rows, H_KV,
    head_dim] of `dtype`) on `device`. The policy: SnapKV of `pool_kernel` unless given
    (pool_kernel 1: no pooling, so no score ties)."""
    config = SparsityConfig(
        full_layers=full_layers,
        budget=budget or context,
        sink=sink,
        window=window,
        policy=policy or SnapKVPolicy(pool_kernel=pool_kernel),
        evict_page=evict_page,
        max_request_budget=max_request_budget,
        guide_from=guide_from,
        guide_below=guide_below,
    )
    resolved = config.resolve(num_layers, context, sliding_layers, sliding_window)
    heap = FreeList(rows, page)
    shape = (rows + page, H_KV, head_dim)
    lanes = [
        LaneBuffers.over(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(max(len(full_layers), 1))
    ]
    state = SparseState(
        resolved, heap=heap, lanes=lanes, max_requests=max_requests, heap_rows=rows, prefix_cache=prefix_cache
    )
    heap.on_free = state.released.freed if state.released is not None else None
    return state, heap


def grow(state: SparseState, req_indices, lengths) -> None:
    """SGLang's allocation of these requests' tokens; as SGLang gives a request its index first
    (`SparseState.expect`), one the test did not admit is admitted here, its final length unknown."""
    new = [req_idx for req_idx in req_indices if state.requests.phase[req_idx] == Phase.FREE]
    if new:
        state.expect(new, [0] * len(new))
    state.alloc_to_lengths(req_pool_indices_cpu=torch.tensor(req_indices), target_seq_lens_cpu=torch.tensor(lengths))


def assert_device_tables_mirror_the_host(state):
    """What the decode kernels read (the device tables, with the changes the next plan uploads
    applied) is what the host tables hold, for every live entry and score row of every active
    request."""
    for group in state.groups:
        entries, values, score_entries, score_values = group.stale_entries()
        group.device_table.view(-1)[entries] = values.to(torch.int32)
        group.device_scores.view(-1)[score_entries] = score_values.to(torch.int32)
        for req_idx in group.table.active_requests().tolist():
            n = group.table.count(req_idx)
            assert torch.equal(group.device_table[req_idx, :n].long(), group.table.table[req_idx, :n]), req_idx
            assert torch.equal(group.device_scores[req_idx].long(), group.score_table[req_idx]), req_idx


#: Requests of the server's policy, or of one of their own that decodes otherwise: TOVA replaces
#: scores; KeyNorm and random leave them and score a new key each its own way.
OWN_POLICY_SETTINGS = (
    SERVER_SETTING,
    *(RequestSparsity(policy=POLICIES[name]()) for name in ("tova", "keynorm", "random")),
)


def prefill_alone(
    state: SparseState, req_idx: int, final: int, q, k, v, setting: RequestSparsity | None = None
) -> None:
    """A request of final length `final` joins in `req_idx`: its prompt (q/k/v [prompt, H, D])
    prefilled in a batch of its own, through every sparse layer; `setting`: its own."""
    prompt = k.shape[0]
    state.expect([req_idx], [final], settings=None if setting is None else [setting])
    grow(state, [req_idx], [prompt])
    plan = plan_extend(state, [req_idx], [0], [prompt], device=state.lanes[0].k.device)
    for place in state.layout.layer_places.values():
        window = state.layout.groups[place.group].sliding_window
        lane = state.lanes[place.lane]
        sparse_extend(q, k, v, 0.3, plan, plan.column(place), lane, state.policy, sliding_window=window)
    state.finish_forward()


#: A decode step, its plan and evictions included: (state, request indices, q [B, H_q, D], k, v,
#: positions [B]) -> every sparse layer's outputs [layers, B, H_q, D].
DecodeStep = Callable[[SparseState, list[int], torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

GROUP = 2  # query heads per KV head in `decode_lifecycle`
SM_SCALE = 0.3


def eager_decode(state: SparseState, plan: ForwardPlan, q, k, v, positions) -> torch.Tensor:
    """Every sparse layer's decode forward on the plan, as the server runs it."""
    outputs = []
    for place in state.layout.layer_places.values():
        lane, window = state.lanes[place.lane], state.layout.groups[place.group].sliding_window
        column = plan.column(place)
        outputs.append(
            sparse_decode(q, k, v, SM_SCALE, plan, column, lane, state.policy, positions, sliding_window=window)
        )
    return torch.stack(outputs)


def eager_step(state: SparseState, req_indices: list[int], q, k, v, positions) -> torch.Tensor:
    """A decode step run eagerly: planned, its evictions run, every sparse layer."""
    plan = plan_decode(state, req_indices, q.device)
    evict_planned(plan, state.layout, state.lanes, state.policy)
    return eager_decode(state, plan, q, k, v, positions)


class ReplayStep:
    """A decode step as SGLang's graph runner drives the sparse side of the backend
    (`SparseForward`): the fixed buffers once (`init_graph`), the plan over them at capture
    (`begin_capture`), then each step's requests planned into them (`begin_replay`) and the
    sparse layers run over fixed inputs of `batch_size` rows, the padding included."""

    def __init__(self, state: SparseState, batch_size: int) -> None:
        self.sparse = SparseForward(state)
        self.sparse.init_graph(batch_size)
        self.sparse.begin_capture(batch_size)
        self.batch_size = batch_size
        self.layers = sorted(state.layout.layer_places)

    def fill(self, req_indices: list[int]) -> None:
        """What runs before a replay: the step planned, its evictions run, the buffers filled."""
        no_tokens = torch.zeros(self.batch_size, dtype=torch.int64)  # the sentence marks' (none here)
        self.sparse.begin_replay(req_indices, self.batch_size, no_tokens, no_tokens)

    def layers_over(self, q, k, v, positions) -> torch.Tensor:
        """What a captured graph replays: every sparse layer over the fixed-shape inputs."""
        return torch.stack([self.sparse.decode(q, k, v, layer, SM_SCALE, positions) for layer in self.layers])

    def __call__(self, state: SparseState, req_indices: list[int], q, k, v, positions) -> torch.Tensor:
        self.fill(req_indices)
        pad = self.batch_size - q.shape[0]
        q, k, v = (torch.cat([t, t.new_zeros(pad, *t.shape[1:])]) for t in (q, k, v))
        positions = torch.cat([positions, positions.new_zeros(pad)])
        return self.layers_over(q, k, v, positions)[:, : len(req_indices)]


def decode_lifecycle(
    state: SparseState,
    steps: int,
    decode: DecodeStep = eager_step,
    seed: int = 5,
    settings: tuple[RequestSparsity, ...] = (),
):
    """A seeded lifecycle: requests join (prefilled alone), decode together, evict and finish,
    on a state of up to 7 requests (indices 1..7); with `settings`, each joins with one of them,
    drawn. Each decode step (after SGLang's allocation) goes to `decode`, which plans it, runs its
    evictions and its sparse layers. Returns (each decode step's outputs on the host, steps with
    an eviction). Inputs come from a seeded generator, in the lanes' head dim and dtype: two runs
    see the same."""
    lane = state.lanes[0].k
    device, head_dim = lane.device, lane.shape[2]
    gen = torch.Generator().manual_seed(seed)

    def inputs(n: int) -> list[torch.Tensor]:
        return [torch.randn(n, h, head_dim, generator=gen).to(device, lane.dtype) for h in (H_KV * GROUP, H_KV, H_KV)]

    lengths: dict[int, int] = {}
    final: dict[int, int] = {}
    outputs, evicting = [], 0
    for step in range(steps):
        free = [req_idx for req_idx in range(1, 8) if req_idx not in lengths]
        if free and len(lengths) < 5 and step % 7 == 0:
            req_idx = free[0]
            prompt = int(torch.randint(2, 30, (1,), generator=gen))
            final[req_idx] = prompt + int(torch.randint(5, 80, (1,), generator=gen))
            setting = settings[int(torch.randint(len(settings), (1,), generator=gen))] if settings else None
            prefill_alone(state, req_idx, final[req_idx], *inputs(prompt), setting)
            lengths[req_idx] = prompt
            continue
        req_indices = sorted(lengths)
        if not req_indices:
            continue
        grow(state, req_indices, [lengths[req_idx] + 1 for req_idx in req_indices])
        q, k, v = inputs(len(req_indices))
        positions = torch.tensor([lengths[req_idx] for req_idx in req_indices], device=device)
        evictions = state.counters.evictions
        out = decode(state, req_indices, q, k, v, positions)
        evicting += state.counters.evictions > evictions
        outputs.append(out.cpu())
        state.finish_forward()
        for req_idx in req_indices:
            lengths[req_idx] += 1
            if lengths[req_idx] == final[req_idx]:
                state.free(req_idx)
                del lengths[req_idx]
    return outputs, evicting
