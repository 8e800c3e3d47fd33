"""Count what a GPU would pay for a piece of host code: kernel launches and host syncs.

On a GPU without a CUDA graph every tensor op on the device is a kernel launch (5-10 us of host
time), and a read of a device value (`.item()`, `.tolist()`, `.cpu()`, a blocking copy, an op
whose output shape depends on values) makes the host wait for everything queued before it. A CPU
run hides both, so they are counted instead of timed: counts are deterministic.

`DeviceCost` is a dispatch mode that sees every aten op, counts it as a **host op** (any tensor op
the host dispatches, on the host or the device, views and allocations included: each costs the host
microseconds whether or not it launches, so their number is the host's share of a step), and
classifies it:
* a **launch**: an op that reads or writes a device tensor and produces or writes data (views,
  metadata and allocations are free); each Triton kernel launch counts once (`JITFunction.run`);
* a **sync**: a device-to-host copy (but a non-blocking one into pinned memory, whose wait, if
  any, comes later: `device_copy.HostCopy`), a scalar read, a data-dependent output shape on the
  device, a host-to-device copy from pageable memory or not `non_blocking`, or a host tensor mixed
  into a device op (an implicit blocking copy).

It works on a real GPU (device = CUDA) and, with no GPU, on a **simulated device**: `SimDevice`
reports tensors on the `meta` device that carry real CPU data (or none, for buffers created with
`SimDevice.shapes_only`, so a Llama-sized KV heap costs no memory). Code under test treats any
device other than "cpu" as an accelerator, so it takes its GPU branches there (pinned, non-blocking
copies). Project kernels run their Triton wrapper for the count (launches are counted, not run)
and then their torch reference for the effect (`count_kernels`).
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_map

from common.checkout import ROOT

aten = torch.ops.aten

#: The product's folders in a checkout: where a launch or a sync is attributed (`sources`).
PRODUCT = ("sglang_kvsparse", "kernels", "patches")

#: Allocations: the caching allocator hands memory out without a kernel.
_ALLOCATIONS = {
    aten.empty.memory_format,
    aten.empty_strided.default,
    aten.empty_like.default,
    aten.new_empty.default,
    aten.new_empty_strided.default,
}
#: Ops whose output shape depends on device values: the host must wait to learn it.
_DATA_DEPENDENT = {
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.masked_scatter.default,
}
_COPIES = {aten._to_copy.default, aten.copy_.default}


def _is_view(func: Any) -> bool:
    """An op whose outputs alias an input without writing it (view, slice, expand, ...)."""
    returns = func._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def _product_frame() -> str:
    """`file:line` of the innermost frame of the product (not the bench, not torch) on the stack."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename)
        if ROOT in path.parents and path.relative_to(ROOT).parts[0] in PRODUCT:
            return f"{path.relative_to(ROOT)}:{frame.lineno}"
    return "outside the product"


class SimTensor(torch.Tensor):
    """A tensor on the simulated device: reports device `meta`, holds `payload` (CPU data, or
    a meta tensor for a shapes-only buffer)."""

    payload: torch.Tensor

    @staticmethod
    def __new__(cls, payload: torch.Tensor) -> SimTensor:
        made = torch.Tensor._make_wrapper_subclass(
            cls,
            payload.shape,
            strides=payload.stride(),
            storage_offset=payload.storage_offset(),
            dtype=payload.dtype,
            device=SimDevice.device,
            requires_grad=False,
        )
        made.payload = payload
        return made

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"a simulated-device tensor outside its DeviceCost mode: {func}")

    def __repr__(self) -> str:
        return f"SimTensor({self.payload!r})"

    def tolist(self) -> Any:
        _ACTIVE[-1].note_sync("tolist")
        return self.payload.tolist() if self.payload.device.type == "cpu" else torch.zeros(self.shape).tolist()

    def numpy(self, *args: Any, **kwargs: Any) -> Any:
        _ACTIVE[-1].note_sync("numpy")
        return self.payload.cpu().numpy(*args, **kwargs)


class SimDevice:
    """The simulated accelerator: tensors on `meta` that `DeviceCost(simulated=True)` executes on
    the CPU. `shapes_only` makes a buffer whose values are never needed (K/V lanes)."""

    device = torch.device("meta")

    @staticmethod
    def shapes_only(*shape: int, dtype: torch.dtype) -> SimTensor:
        with _disable_current_modes():  # a real meta tensor, not the simulated device's
            return SimTensor(torch.empty(shape, dtype=dtype, device="meta"))


_ACTIVE: list[DeviceCost] = []


class DeviceCost(TorchDispatchMode):
    """Counts launches and syncs per `section` (a name the caller sets between blocks)."""

    def __init__(self, *, simulated: bool, sources: bool = False) -> None:
        super().__init__()
        self.simulated = simulated
        self.section = "harness"
        self.launches: Counter[str] = Counter()
        self.host_ops: Counter[str] = Counter()
        #: With `sources`: launches and syncs by (section, the product's innermost file:line).
        self.sources = sources
        self.launch_sources: Counter[tuple[str, str]] = Counter()
        self.sync_sources: Counter[tuple[str, str]] = Counter()
        self.syncs: Counter[str] = Counter()
        self.sync_kinds: Counter[str] = Counter()
        self._paused = 0
        self._pinned: set[int] = set()  # storages of host tensors pinned for the simulated device

    # -- the caller's view ----------------------------------------------------------------------
    def reset(self) -> None:
        self.launches.clear()
        self.host_ops.clear()
        self.syncs.clear()
        self.sync_kinds.clear()
        self.launch_sources.clear()
        self.sync_sources.clear()

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Run a block uncounted (a kernel's torch reference standing in for its launch)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def note_launch(self, count: int = 1) -> None:
        if not self._paused:
            self.launches[self.section] += count
            if self.sources:
                self.launch_sources[self.section, _product_frame()] += count

    def note_sync(self, kind: str) -> None:
        if not self._paused:
            self.syncs[self.section] += 1
            self.sync_kinds[f"{self.section}: {kind}"] += 1
            if self.sources:
                self.sync_sources[self.section, f"{_product_frame()} ({kind})"] += 1

    def __enter__(self) -> DeviceCost:
        _ACTIVE.append(self)
        if self.simulated:
            self._lazy_init, torch.cuda._lazy_init = torch.cuda._lazy_init, lambda: None
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        _ACTIVE.pop()
        if self.simulated:
            torch.cuda._lazy_init = self._lazy_init

    # -- classification ------------------------------------------------------------------------
    def _on_device(self, value: Any) -> bool:
        if not isinstance(value, torch.Tensor):
            return False
        return isinstance(value, SimTensor) if self.simulated else value.is_cuda

    def _is_device(self, value: Any) -> bool:
        if isinstance(value, torch.device):
            return value.type != "cpu"
        if isinstance(value, str) and value not in ("cpu",):
            try:
                return torch.device(value).type != "cpu"
            except RuntimeError:
                return False
        return False

    def _pinned_host(self, value: Any) -> bool:
        if not isinstance(value, torch.Tensor) or self._on_device(value):
            return False
        return value.untyped_storage().data_ptr() in self._pinned if self.simulated else value.is_pinned()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self._paused:
            self.host_ops[self.section] += 1
        if func is aten.is_pinned.default and self.simulated:
            return args[0].untyped_storage().data_ptr() in self._pinned
        if func is aten._pin_memory.default and self.simulated:
            pinned = args[0].clone()
            self._pinned.add(pinned.untyped_storage().data_ptr())
            return pinned
        if kwargs.get("pin_memory") and self.simulated:  # a factory of pinned host memory
            pinned = func(*args, **{**kwargs, "pin_memory": False})
            self._pinned.add(pinned.untyped_storage().data_ptr())
            return pinned
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        device_in = [x for x in inputs if self._on_device(x)]
        to_device = self._is_device(kwargs.get("device"))
        out = self._run(func, args, kwargs, wrap=bool(device_in) or to_device)
        device_out = any(self._on_device(x) for x in tree_flatten(out)[0])
        if not (device_in or device_out):
            return out
        self._classify(func, args, kwargs, inputs, device_in, device_out)
        return out

    def _classify(self, func, args, kwargs, inputs, device_in, device_out) -> None:
        if func is aten._local_scalar_dense.default:
            self.note_sync("scalar read (.item(), bool(), int())")
            return
        if func in _COPIES:
            source = args[1] if func is aten.copy_.default else args[0]
            host_to_device = not self._on_device(source)
            lands_on_host = not device_out if func is aten._to_copy.default else not self._on_device(args[0])
            non_blocking = bool(kwargs.get("non_blocking") or args[2:3] == (True,))
            self.note_launch()
            if lands_on_host and not (non_blocking and func is aten.copy_.default and self._pinned_host(args[0])):
                self.note_sync("device-to-host copy")
            elif host_to_device and not non_blocking:
                self.note_sync("blocking host-to-device copy")
            elif host_to_device and not self._pinned_host(source):
                self.note_sync("host-to-device copy from pageable memory")
            return
        if func in _DATA_DEPENDENT:
            self.note_sync(f"data-dependent shape ({func})")
        if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
            self.note_sync("repeat_interleave without output_size")
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
            if any(t is not None and t.dtype == torch.bool for t in args[1]):
                self.note_sync("boolean-mask indexing")
        mixed = [x for x in inputs if not self._on_device(x) and x.dim() > 0]
        if mixed:
            self.note_sync("host tensor in a device op (implicit blocking copy)")
        if _is_view(func) or func in _ALLOCATIONS or func in (aten.lift_fresh.default, aten.detach.default):
            return
        self.note_launch()

    def _run(self, func, args, kwargs, *, wrap: bool) -> Any:
        """Run the op; on the simulated device, on the payloads, re-wrapping device outputs. With
        a shapes-only buffer among the inputs everything runs on `meta` (values never needed)."""
        if not self.simulated:
            return func(*args, **kwargs)
        shapes_only = any(
            isinstance(x, SimTensor) and x.payload.device.type == "meta" for x in tree_flatten((args, kwargs))[0]
        )
        to_host = func is aten._to_copy.default and not self._is_device(kwargs.get("device", SimDevice.device))
        if to_host and shapes_only:  # values nobody has: the count is what matters
            source = args[0]
            return torch.zeros(source.shape, dtype=kwargs.get("dtype") or source.dtype)

        def unwrap(x: Any) -> Any:
            if isinstance(x, SimTensor):
                return x.payload.to("meta") if shapes_only else x.payload
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("meta" if shapes_only else "cpu")
            if isinstance(x, torch.Tensor) and shapes_only and x.dim() > 0:
                return x.to("meta")
            return x

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if to_host or not wrap:
            return out
        if func is aten.copy_.default and not isinstance(args[0], SimTensor):
            return args[0]  # a copy into a host tensor stays on the host
        return tree_map(lambda x: SimTensor(x) if isinstance(x, torch.Tensor) else x, out)


def count_kernels(cost: DeviceCost, modules: list[Any], names: tuple[str, ...]) -> Callable[[], None]:
    """Make the project kernel dispatchers `names` in `modules` count as their Triton path:
    on a GPU they run it (launches counted by `count_triton_launches`); on the simulated device
    the Triton wrapper runs for the count with its launches skipped, then the torch reference runs
    uncounted for the effect. Returns a function that restores the originals."""
    from sglang_kvsparse import kernels

    saved = []
    for name in names:
        triton_fn, torch_fn = getattr(kernels, f"{name}_triton"), getattr(kernels, f"{name}_torch")

        def dispatcher(*args: Any, _triton=triton_fn, _torch=torch_fn, **kwargs: Any) -> Any:
            kwargs.pop("backend", None)
            if not cost.simulated:
                return _triton(*args, **kwargs)
            _triton(*args, **kwargs)
            with cost.paused():
                return _torch(*args, **kwargs)

        for module in modules:
            if hasattr(module, name):
                saved.append((module, name, getattr(module, name)))
                setattr(module, name, dispatcher)

    def restore() -> None:
        for module, name, original in saved:
            setattr(module, name, original)

    return restore


def count_triton_launches(cost: DeviceCost) -> Callable[[], None]:
    """Count every Triton kernel launch as one (compiled or, under TRITON_INTERPRET=1,
    interpreted); on the simulated device, do not run it."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    originals = [(kind, kind.run) for kind in (JITFunction, InterpretedFunction)]

    def counted(original: Callable[..., Any]) -> Callable[..., Any]:
        def run(self: Any, *args: Any, **kwargs: Any) -> Any:
            cost.note_launch()
            if cost.simulated:
                return None
            with cost.paused():
                return original(self, *args, **kwargs)

        return run

    for kind, original in originals:
        kind.run = counted(original)

    def restore() -> None:
        for kind, original in originals:
            kind.run = original

    return restore
