"""Import-time workarounds that let stock SGLang 0.5.23 run on a machine with no GPU.

1. With ``SGLANG_USE_CPU_ENGINE=1`` a few SGLang modules import ``sgl_kernel`` at module level (for
   CPU kernels that the torch-native path never calls). PyPI's ``sglang-kernel`` only holds CUDA
   builds, so on a CPU machine the import fails and SGLang cannot start. A last-resort import
   finder answers ``import sgl_kernel`` with a stand-in whose functions raise a clear error if
   anything ever calls them. It acts only when no real ``sgl_kernel`` is importable (the finder
   sits at the end of ``sys.meta_path``, so a real install always wins).
2. With ``--tp-size`` above 1, SGLang builds a PyNccl communicator for every model-parallel group
   on every in-tree platform, the CPU included, and fails at start-up. Once its
   ``parallel_state`` module is imported, the groups it builds default to no PyNccl
   (`sglang_kvsparse.patches.cpu_parallel`), so their collectives fall back to
   ``torch.distributed`` (gloo).
3. Stock SGLang refuses an FP8 KV cache on a CPU without Intel AMX; once its KV-cache modules
   are imported, both FP8 formats take SGLang's plain FP8 pool, read by ``torch_native``
   (`sglang_kvsparse.patches.cpu_fp8`): the CPU's FP8 reference.

All three act only with the CPU engine requested (``SGLANG_USE_CPU_ENGINE=1``), for stock SGLang and the
sparse server alike: they adapt SGLang to the machine, not to the sparse layers. The CPU setup
registers this module in every Python process of the virtual environment through a ``.pth`` file,
because SGLang spawns its scheduler processes and imports ``sgl_kernel`` before any plugin code
runs there. It imports nothing heavy: it runs at every interpreter start.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types
from collections.abc import Callable

STANDIN_ROOT = "sgl_kernel"
PARALLEL_STATE = "sglang.srt.distributed.parallel_state"


def cpu_engine_requested() -> bool:
    """SGLang's CPU engine switch, read when a module is looked up (processes inherit it)."""
    return os.environ.get("SGLANG_USE_CPU_ENGINE") == "1"


class _StandInModule(types.ModuleType):
    """A module whose CPU-kernel names (``*_cpu``) are functions that raise when called.

    Any other name is missing (``AttributeError``, so ``from sgl_kernel import x`` raises
    ``ImportError``): SGLang guards its optional GPU imports with ``try/except ImportError`` and
    must keep taking its fallbacks. Only the CPU-path names are imported unguarded.
    """

    def __getattr__(self, name: str):
        if not name.endswith("_cpu"):
            raise AttributeError(f"{self.__name__}.{name} (CPU stand-in of sgl_kernel)")
        qualified = f"{self.__name__}.{name}"

        def unavailable(*args, **kwargs):
            raise NotImplementedError(
                f"{qualified} is a CPU stand-in installed by sglang_kvsparse.server.cpu_shims: the "
                f"real sgl_kernel is not available on this machine"
            )

        unavailable.__name__ = name
        unavailable.__qualname__ = qualified
        return unavailable


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        # Only the top-level module: its submodules (scalar_type, mamba, ...) stay missing so that
        # SGLang's guarded imports of them fall back as on any machine without sgl_kernel.
        if fullname != STANDIN_ROOT or not cpu_engine_requested():
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__kvsparse_standin__ = True
        return module

    def exec_module(self, module):
        return None


class _AfterImportLoader(importlib.abc.Loader):
    """A module's own loader, then `action` on the executed module."""

    def __init__(self, loader: importlib.abc.Loader, action: Callable[[types.ModuleType], None]) -> None:
        self.loader, self.action = loader, action

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.action(module)


class _AfterImportFinder(importlib.abc.MetaPathFinder):
    """Finds the SGLang modules of `AFTER_IMPORT` through the other finders and patches each
    once it is loaded."""

    def find_spec(self, fullname, path=None, target=None):
        action = AFTER_IMPORT.get(fullname)
        if action is None or not cpu_engine_requested():
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _AfterImportLoader(spec.loader, action)
                return spec
        return None


def _patch_parallel_state(module: types.ModuleType) -> None:
    from sglang_kvsparse.patches.cpu_parallel import default_no_pynccl

    default_no_pynccl(module)


def _patch_fp8_check(module: types.ModuleType) -> None:
    from sglang_kvsparse.patches.cpu_fp8 import plain_fp8_pool

    plain_fp8_pool(module)


#: SGLang module -> what to do to it once imported (with the CPU engine requested).
AFTER_IMPORT: dict[str, Callable[[types.ModuleType], None]] = {
    PARALLEL_STATE: _patch_parallel_state,
    "sglang.srt.mem_cache.kv_cache_dtype": _patch_fp8_check,
    "sglang.srt.mem_cache.kv_cache_configurator": _patch_fp8_check,
}


def install() -> None:
    """Put the finders on ``sys.meta_path`` once (idempotent): the stand-in last, the
    after-import patches first."""
    if not any(isinstance(finder, _StandInFinder) for finder in sys.meta_path):
        sys.meta_path.append(_StandInFinder())
    if not any(isinstance(finder, _AfterImportFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImportFinder())


install()
