"""Import-time workaround that lets stock SGLang 0.5.23 run on a machine with no GPU.

With ``SGLANG_USE_CPU_ENGINE=1`` a few SGLang modules import ``sgl_kernel`` at module level (for
CPU kernels that the torch-native path never calls). PyPI's ``sglang-kernel`` only holds CUDA
builds, so on a CPU machine the import fails and SGLang cannot start. This module installs a
last-resort import finder that answers ``import sgl_kernel`` with a stand-in whose functions raise
a clear error if anything ever calls them.

It acts only when both hold: the CPU engine is requested (``SGLANG_USE_CPU_ENGINE=1``) and no real
``sgl_kernel`` is importable (the finder sits at the end of ``sys.meta_path``, so a real install
always wins). The CPU setup registers it in every Python process of the virtual environment
through a ``.pth`` file, because SGLang spawns its scheduler processes and imports ``sgl_kernel``
before any plugin code runs there. It imports nothing heavy: it runs at every interpreter start.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import types

STANDIN_ROOT = "sgl_kernel"


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
                f"{qualified} is a CPU stand-in installed by sglang_kvsparse.cpu_shims: the "
                f"real sgl_kernel is not available on this machine"
            )

        unavailable.__name__ = name
        unavailable.__qualname__ = qualified
        return unavailable


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        # Only the top-level module: its submodules (scalar_type, mamba, ...) stay missing so that
        # SGLang's guarded imports of them fall back as on any machine without sgl_kernel.
        if fullname != STANDIN_ROOT:
            return None
        if os.environ.get("SGLANG_USE_CPU_ENGINE") != "1":
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec):
        module = _StandInModule(spec.name)
        module.__kvsparse_standin__ = True
        return module

    def exec_module(self, module):
        return None


def install() -> None:
    """Append the stand-in finder to ``sys.meta_path`` once (idempotent)."""
    if not any(isinstance(finder, _StandInFinder) for finder in sys.meta_path):
        sys.meta_path.append(_StandInFinder())


install()
