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
from sglang_kvsparse.policies import POLICIES

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


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_decode_steps_wait_for_nothing_and_launch_the_same_at_every_batch_size(policy):
    runs = {
        batch: step_cost.measure(batch, 20, SimDevice.device, 0, step_cost.SMALL_SHAPE, config(policy))
        for batch in (1, 6)
    }
    launches = {}
    for batch, run in runs.items():
        assert all(sum(step["syncs"].values()) == 0 for step in run.steps), [s["sync_kinds"] for s in run.steps]
        assert all(step["launches"]["allocation"] == 0 for step in run.steps)  # host tables only

        def forward(step):  # the step's plan, evictions and layers (a release copies finished requests' ids)
            return step["launches"]["planning"] + step["launches"]["eviction"] + step["launches"]["layers"]

        evicting = [forward(step) for step in run.steps if step["evicting"]]
        other = [forward(step) for step in run.steps if not step["evicting"]]
        assert evicting and other, batch
        launches[batch] = (max(evicting), max(other))
    assert launches[1] == launches[6]
