"""Import the project from a plain checkout, installed or not.

The wheel maps `kernels/` to `sglang_kvsparse.kernels`, `patches/` to `sglang_kvsparse.patches`
and `testbed/` to `kvsparse_testbed` (pyproject.toml). A machine that only has the checkout (a lent
GPU, whose image has torch and Triton but not SGLang) gets the same names from the same folders.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


def importable() -> None:
    """Make `sglang_kvsparse` (with its kernels and patches) and `kvsparse_testbed` importable."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    import sglang_kvsparse

    if importlib.util.find_spec("sglang_kvsparse.kernels") is None:
        sglang_kvsparse.__path__.append(str(ROOT))  # its subpackages kernels/ and patches/ live at the root
    if importlib.util.find_spec("kvsparse_testbed") is None:
        spec = importlib.util.spec_from_file_location(
            "kvsparse_testbed", ROOT / "testbed" / "__init__.py", submodule_search_locations=[str(ROOT / "testbed")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["kvsparse_testbed"] = module
        spec.loader.exec_module(module)
