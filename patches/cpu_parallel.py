"""SGLang's model-parallel groups on the CPU engine: no PyNccl (SGLang 0.5.23).

`parallel_state.init_model_parallel_group` turns PyNccl on for every in-tree platform but NPU/XPU,
the CPU included, so `--tp-size 2` with `SGLANG_USE_CPU_ENGINE=1` fails at start-up creating a
NCCL communicator for a CPU device. With PyNccl off, `GroupCoordinator`'s collectives fall back
to `torch.distributed` on the gloo group SGLang builds anyway. Applied by
`sglang_kvsparse.server.cpu_shims` the moment the module is imported, in stock and sparse servers alike;
a caller that asks for PyNccl explicitly still gets it.
"""

from __future__ import annotations

import functools
import types
from typing import Any

PATCHED = "__kvsparse_cpu_no_pynccl__"


def default_no_pynccl(parallel_state: types.ModuleType) -> None:
    """Make `use_pynccl` default to False in the module's `init_model_parallel_group` (idempotent)."""
    original = parallel_state.init_model_parallel_group
    if getattr(original, PATCHED, False):
        return

    @functools.wraps(original)
    def init_model_parallel_group(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("use_pynccl") is None and len(args) < 4:
            kwargs["use_pynccl"] = False
        return original(*args, **kwargs)

    setattr(init_model_parallel_group, PATCHED, True)
    parallel_state.init_model_parallel_group = init_model_parallel_group
