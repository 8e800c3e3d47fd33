"""The whole sparse decode path with SGLang's own token allocator, counted on a simulated device
(`bench/common/device_cost.py`): allocation through the heap's hooks on SGLang 0.5.23's
`TokenToKVPoolAllocator`, planning, evictions, the sparse layers, the release after the forward,
and the releases of a finished, an aborted and a retracted request; 64 decode steps, no host
sync anywhere, every heap row back after.

On this CPU a server's "device" is host memory, so a counter inside it cannot tell a device read
from a host one; the simulated device can (its tensors are a subclass the counter knows), and the
code under it is the server's: the same hooks on the same allocator class."""

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest
import torch
from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is a folder of scripts that import their siblings as `common.*`
try:
    step_cost = importlib.import_module("step_cost")
    from common.device_cost import DeviceCost, SimDevice
finally:
    sys.path.remove(str(BENCH))

STEPS = 64
BATCH = 5


def sglang_allocator(need_sort: bool):
    def make(rows: int, device: torch.device) -> TokenToKVPoolAllocator:
        return TokenToKVPoolAllocator(rows, torch.bfloat16, device, kvcache=None, need_sort=need_sort)

    return make


@pytest.mark.parametrize("need_sort", [False, True])
def test_decode_path_with_sglangs_allocator_waits_for_nothing(need_sort):
    config = dataclasses.replace(step_cost.SMALL_CONFIG, evict_page=4)
    cost = DeviceCost(simulated=True)
    syncs: dict[str, int] = {}
    kinds = set()

    def count(section: str, waited: dict, what: dict) -> None:
        syncs[section] = syncs.get(section, 0) + sum(waited.values())
        kinds.update(what)

    with cost:
        harness = step_cost.Harness(
            cost, SimDevice.device, BATCH, 1, step_cost.SMALL_SHAPE, config, allocator=sglang_allocator(need_sort)
        )
        assert isinstance(harness.allocator, TokenToKVPoolAllocator)  # the heap's class over SGLang's
        free_at_start = harness.allocator.available_size()
        steps = evicting = aborted = retracted = 0
        retracting = None
        while steps < STEPS:
            while len(harness.running) < BATCH - bool(retracting):  # a retracted request's place waits for it
                harness.join()
            step = harness.step()
            steps += 1
            evicting += step["evicting"]
            count("step", step["syncs"], step["sync_kinds"])
            if steps % 30 == 15:  # abort a running request mid-decode (as a client's disconnect does)
                cost.reset()
                cost.section = "abort"
                harness.finish(next(iter(harness.running.values())))
                count("abort", cost.syncs, cost.sync_kinds)
                aborted += 1
            if steps % 30 == 22:  # retract one: released now, prefilled again from its tokens later
                cost.reset()
                cost.section = "retract"
                request = next(iter(harness.running.values()))
                harness.finish(request)
                count("retract", cost.syncs, cost.sync_kinds)
                retracting, retracted = (request.length, request.final), retracted + 1
            if retracting and steps % 30 == 25:
                harness.join(*retracting)
                retracting = None
        for request in list(harness.running.values()):
            harness.finish(request)
        harness.state.finish_forward()
        assert harness.allocator.available_size() == free_at_start
    assert evicting > STEPS // 3 and aborted >= 2 and retracted >= 2
    assert syncs == {"step": 0, "abort": 0, "retract": 0}, kinds
    assert all(harness.state.rows_held(row) == 0 for row in range(harness.max_requests))
