"""A guard that fails on any operation that would make the host wait for the device.

On a GPU these are the calls that copy a value back (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`)
or whose output shape depends on values (`nonzero`, boolean-mask indexing, `repeat_interleave`
without `output_size`, `unique`). On the CPU nothing waits, so the guard finds them by name: the
function-level names through a `TorchFunctionMode`, and the aten ops that they and tensor
internals reach through a `TorchDispatchMode` (a mask index, for instance, shows only there).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


class HostSync(AssertionError):
    """Something in the guarded code would wait on the device."""


_FUNCTIONS = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero"}
_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.nonzero.default,
    torch.ops.aten.masked_select.default,
    torch.ops.aten._unique2.default,
    torch.ops.aten.unique_dim.default,
    torch.ops.aten.unique_consecutive.default,
}


class _Functions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", None) in _FUNCTIONS:
            raise HostSync(f"{func.__name__}() waits on the device")
        return func(*args, **(kwargs or {}))


class _Ops(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _OPS:
            raise HostSync(f"{func} waits on the device")
        if func is torch.ops.aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            raise HostSync("repeat_interleave without output_size waits on the device")
        if func is torch.ops.aten.index.Tensor and any(t is not None and t.dtype == torch.bool for t in args[1]):
            raise HostSync("boolean-mask indexing waits on the device")
        return func(*args, **kwargs)


@contextmanager
def no_host_sync() -> Iterator[None]:
    """Run a block that must never wait on the device; raises `HostSync` where it would."""
    with _Functions(), _Ops():
        yield
