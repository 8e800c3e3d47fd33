"""Host tensors onto the device without making the host wait (no SGLang imports).

A copy from pageable host memory, or one that is not `non_blocking`, waits for every kernel queued
before it on the stream: on a GPU that stalls the scheduler behind the previous forward and voids
SGLang's overlap scheduling. The host data a forward needs (its plan's indices) is known on the
host, so it is staged in pinned memory and copied asynchronously, all of it in one copy.

Any device other than the CPU is treated as an accelerator (a simulated one too, for counting:
`bench/common/device_cost.py`); on the CPU the "copy" is a plain host copy, so later changes to
the host tables never reach a plan already built.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def on_accelerator(device: torch.device | str) -> bool:
    return torch.device(device).type != "cpu"


def upload(tensors: Sequence[torch.Tensor], device: torch.device | str) -> list[torch.Tensor]:
    """`tensors` (host; int64, int32 or bool) on `device`, each with its shape and dtype, through
    one pinned, non-blocking copy of their int64 concatenation (a cast per tensor that is not
    int64)."""
    if not tensors:
        return []
    flat = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])
    if on_accelerator(device):
        flat = flat.pin_memory().to(device, non_blocking=True)
    out = []
    offset = 0
    for tensor in tensors:
        part = flat[offset : offset + tensor.numel()].view(tensor.shape)
        offset += tensor.numel()
        out.append(part if tensor.dtype == torch.int64 else part.to(tensor.dtype))
    return out


class HostCopy:
    """A device tensor on its way to the host: copied into pinned memory without waiting, with an
    event that tells when it has landed (`ready`); `value` waits only if it has not."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if not on_accelerator(tensor.device):
            self._host = tensor.clone()  # later changes to the source do not reach it
            return
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._host.copy_(tensor, non_blocking=True)
        if tensor.is_cuda:
            self._event = torch.cuda.Event()
            self._event.record()

    def ready(self) -> bool:
        return self._event is None or self._event.query()

    def value(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
        return self._host
