"""The sparse decode step as a GPU pays for it, counted on a simulated device (`bench/step_cost.py`,
`bench/common/device_cost.py`): from SGLang's allocation hook to the release after the forward,
no step waits on the device, and what a step launches does not grow with the batch."""

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
import torch

from sglang_kvsparse.config import SparsityConfig
from sglang_kvsparse.forward.planning import plan_decode
from sglang_kvsparse.patches.allocator import attach, make_heap
from sglang_kvsparse.policies import POLICIES, ScoringPolicy
from sglang_kvsparse.state.sparse_group import LaneBuffers
from sglang_kvsparse.state.sparse_state import SparseState

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is a folder of scripts that import their siblings as `common.*`
try:
    step_cost = importlib.import_module("step_cost")
    from common.device_cost import DeviceCost, SimDevice
finally:
    sys.path.remove(str(BENCH))


def config(policy: str) -> SparsityConfig:
    return dataclasses.replace(step_cost.SMALL_CONFIG, policy=POLICIES[policy]())


def test_the_counter_sees_what_would_wait_and_what_would_launch():
    cost = DeviceCost(simulated=True)
    with cost:
        x = torch.arange(6.0, device=SimDevice.device)
        host = torch.arange(3)
        cost.section = "probe"
        for wait in (
            lambda: x.max().item(),
            lambda: x.tolist(),
            lambda: bool(x[0]),
            lambda: x.cpu(),
            lambda: x[x > 2],
            lambda: torch.nonzero(x),
            lambda: host.to(SimDevice.device),  # pageable and blocking
            lambda: host.to(SimDevice.device, non_blocking=True),  # still pageable
            lambda: x[host],  # a host index: an implicit blocking copy
        ):
            before = cost.syncs["probe"]
            wait()
            assert cost.syncs["probe"] == before + 1
        before = dict(cost.launches), cost.syncs["probe"]
        pinned = host.pin_memory().to(SimDevice.device, non_blocking=True)
        y = (x[:3] + pinned).view(3, 1).expand(3, 2)
        torch.empty(4, device=SimDevice.device)
        assert cost.syncs["probe"] == before[1]
        assert cost.launches["probe"] - before[0]["probe"] == 2  # the copy and the add: views and allocations are free
        assert y.payload.tolist() == [[0, 0], [2, 2], [4, 4]]


#: One policy per decode rule: a decode step does what its policy's rule says and nothing else of
#: the policy (`ScoringPolicy.decodes_like`; evictions rank the stored scores of every policy).
#: The first of each rule's policies by name.
DECODE_RULES = sorted({POLICIES[name]().decode_rule(): name for name in sorted(POLICIES, reverse=True)}.values())


def test_one_policy_per_decode_rule_is_every_rule():
    rules = {POLICIES[name]().decode_rule() for name in POLICIES}
    assert {POLICIES[name]().decode_rule() for name in DECODE_RULES} == rules
    assert all(policy.eviction_scores is ScoringPolicy.eviction_scores for policy in POLICIES.values())


@pytest.mark.parametrize("policy", DECODE_RULES)
def test_decode_steps_wait_for_nothing_and_launch_the_same_at_every_batch_size(policy):
    runs = {
        batch: step_cost.measure(batch, 20, SimDevice.device, 0, step_cost.SMALL_SHAPE, config(policy))
        for batch in (1, 6)
    }
    launches = {}
    for batch, run in runs.items():
        assert all(sum(step["syncs"].values()) == 0 for step in run.steps), [s["sync_kinds"] for s in run.steps]
        assert all(step["launches"]["allocation"] == 0 for step in run.steps)  # host tables only

        def forward(step):  # before the replay and the layers (a release copies finished requests' ids)
            return step["launches"][step_cost.BEFORE_REPLAY] + step["launches"]["layers"]

        evicting = [forward(step) for step in run.steps if step["evicting"]]
        other = [forward(step) for step in run.steps if not step["evicting"]]
        assert evicting and other, batch
        launches[batch] = (max(evicting), max(other))
    assert launches[1] == launches[6]


def test_the_counter_counts_every_op_the_host_dispatches():
    cost = DeviceCost(simulated=True)
    with cost:
        x = torch.arange(6.0, device=SimDevice.device)
        cost.section = "probe"
        x[:3].view(3, 1).expand(3, 2)  # a slice, a view, an expand: host work, no launch
        torch.empty(4, device=SimDevice.device)  # an allocation: the same
        torch.ones(3) * 2  # ops on host tensors
        with cost.paused():
            x + 1  # a kernel's reference, standing in for its launch
    assert (cost.host_ops["probe"], cost.launches["probe"]) == (6, 0)


def test_a_replayed_steps_host_work_does_not_grow_with_the_sparse_layers():
    """Before a replay the host plans, evicts and fills the graph's buffers; the layers' views of
    those buffers are made once per batch size, so a model twice as deep dispatches the same ops."""
    host_ops = {}
    for layers in (6, 12):
        shape = {**step_cost.SMALL_SHAPE, "num_hidden_layers": layers}
        run = step_cost.measure(3, 12, SimDevice.device, 0, shape, config("span"))
        steps = [step["host_ops"][step_cost.BEFORE_REPLAY] for step in run.steps if not step["evicting"]]
        assert steps, layers
        host_ops[layers] = max(steps)
    assert host_ops[6] == host_ops[12]


def test_the_decode_rows_of_a_mixed_batch_are_on_the_host_already():
    """SGLang's mixed chunk allocates a prefill and then the running requests' decode tokens, both
    before the forward: the prefill's allocation keeps every running request's coming decode rows
    on the host free list, so the decode allocation reads nothing back from SGLang's device list
    (`decode_refills`); only prefills refill."""
    config = dataclasses.replace(step_cost.SMALL_CONFIG, evict_page=4)
    resolved = config.resolve(6, 4096)
    allocator = step_cost.TokenAllocatorModel(8192, torch.device("cpu"))
    heap = make_heap(allocator)
    lanes = [LaneBuffers.over(torch.zeros(8193, 2, 16), torch.zeros(8193, 2, 16)) for _ in range(2)]
    state = SparseState(resolved, heap=heap, lanes=lanes, max_requests=8, heap_rows=8192)
    attach(allocator, state)

    def grow(rows, lengths):
        state.alloc_to_lengths(req_pool_indices_cpu=torch.tensor(rows), target_seq_lens_cpu=torch.tensor(lengths))

    state.expect([1], [150])
    grow([1], [100])  # a prefill: compressed to the budget, 40 entries
    for length in range(101, 110):  # decode steps, with evictions
        grow([1], [length])
        plan_decode(state, [1])
        state.finish_forward()
    refills = heap.refills
    state.expect([2], [300])
    grow([2], [200])  # the next prefill's allocation ...
    grow([1], [110])  # ... then the running request's decode token (mixed chunk)
    plan_decode(state, [1])
    state.finish_forward()
    for length in range(111, 150):
        grow([1, 2], [length, length + 90])
        plan_decode(state, [1, 2])
        state.finish_forward()
    assert state.counters.decode_refills == 0 and heap.refills > refills
