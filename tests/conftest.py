"""Test-wide environment, set before anything imports triton.

Without a GPU, Triton kernels run in the interpreter (TRITON_INTERPRET must be set before triton
is first imported), and single-threaded BLAS keeps its many small matmuls fast on 2 cores.
Server processes started by the end-to-end tests get a clean copy of the environment instead
(see tests/e2e/servers.py), which keeps one setting made here: SGLang skips importing the model
modules of architectures no test serves (every served model is a `LlamaForCausalLM`), ~260
modules that each server's scheduler would otherwise import at start-up (measured: 14.7 s
instead of 20.8 s for SGLang's model registry on 2 busy cores; CI starts ~20 such processes).
"""

import importlib.util
import os
from pathlib import Path

#: SGLang model modules the tests serve (`SGLANG_DISABLED_MODEL_ARCHS` names the others).
SERVED_MODEL_MODULES = ("llama",)


def unserved_model_modules() -> str:
    """Comma-separated names of SGLang's other model modules ("" when SGLang is not installed)."""
    spec = importlib.util.find_spec("sglang")  # finds the package without importing it
    if spec is None or spec.origin is None:
        return ""
    models = Path(spec.origin).parent / "srt" / "models"
    return ",".join(sorted(path.stem for path in models.glob("*.py") if path.stem not in SERVED_MODEL_MODULES))


if not Path("/dev/nvidia0").exists():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("SGLANG_DISABLED_MODEL_ARCHS", unserved_model_modules())
