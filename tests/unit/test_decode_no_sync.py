"""The sparse decode forward, its plan built, never waits on the device (issue 12).

The plan is built where the scheduler already knows every length (the host tables), so the step's
evictions (run before its layers) and each sparse layer's forward (the new token's store,
attention with score accumulation) run from tensors alone: on a GPU they queue work without a
single device-to-host synchronisation.
"""

import pytest
import torch

from sglang_kvsparse.policies import POLICIES

from .heap import decode_lifecycle, make_state
from .host_sync import HostSync, no_host_sync


def test_the_guard_catches_what_would_wait_on_the_device():
    x = torch.arange(6.0)
    for wait in (
        lambda: x.max().item(),
        lambda: x.tolist(),
        lambda: bool(x[0]),
        lambda: int(x.sum()),
        lambda: x[x > 2],
        lambda: torch.nonzero(x),
        lambda: torch.repeat_interleave(torch.tensor([1, 2])),
        lambda: x.cpu(),
    ):
        with pytest.raises(HostSync), no_host_sync():
            wait()
    with no_host_sync():  # shapes known up front: fine
        torch.repeat_interleave(torch.tensor([1, 2]), torch.tensor([2, 1]), output_size=3)


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_decode_steps_with_evictions_run_without_host_syncs(policy):
    """Every policy's decode update, new-key scores and eviction ranking included."""
    state, _ = make_state(
        num_layers=4, full_layers=(0,), budget=8, evict_page=4, rows=4096, context=4096, policy=POLICIES[policy]()
    )
    outputs, evicting = decode_lifecycle(state, 120, guard=no_host_sync)
    assert len(outputs) > 80 and evicting > 10  # every one of them inside the guard
