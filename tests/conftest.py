"""Test-wide environment, set before anything imports triton.

Without a GPU, Triton kernels run in the interpreter (TRITON_INTERPRET must be set before triton
is first imported), and single-threaded BLAS keeps its many small matmuls fast on 2 cores.
Server processes started by the end-to-end tests get a clean copy of the environment instead
(see tests/e2e/servers.py), which keeps one setting made here: SGLang skips importing the model
modules of architectures no test serves (every served model is a `LlamaForCausalLM` or the test
bed's `Gemma3ForCausalLM`), ~260
modules that each server's scheduler would otherwise import at start-up (measured: 14.7 s
instead of 20.8 s for SGLang's model registry on 2 busy cores; CI starts ~20 such processes).

A test's tier is its folder: every test under tests/integration/ is marked `integration`, every
test under tests/e2e/ `e2e` (so an unmarked one is never skipped by a tier's `-m`), and a tier
marker that disagrees with the folder fails collection. Each test's call runs under its folder's
time limit (`TIME_LIMITS_S`), so a hung test fails with its name rather than stalling CI.
"""

import importlib.util
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

#: SGLang model modules the tests serve (`SGLANG_DISABLED_MODEL_ARCHS` names the others).
SERVED_MODEL_MODULES = ("llama", "gemma3_causal")


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


#: Folder -> its tier marker (none for unit and kernels, which run whole).
TIER_MARKERS = {"unit": None, "kernels": None, "integration": "integration", "e2e": "e2e"}
#: Folder -> the longest one test's call may run, in seconds (server starts are the fixtures').
TIME_LIMITS_S = {"unit": 300, "kernels": 600, "integration": 900, "e2e": 3600}


def _folder(item: pytest.Item) -> str:
    return Path(str(item.path)).relative_to(Path(__file__).parent).parts[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = _folder(item)
        wanted = TIER_MARKERS.get(folder)
        for other in {marker for marker in TIER_MARKERS.values() if marker} - {wanted}:
            if item.get_closest_marker(other) is not None:
                raise pytest.UsageError(f"{item.nodeid}: marked {other} but lives in tests/{folder}/")
        if wanted is not None:
            item.add_marker(wanted)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    limit = TIME_LIMITS_S.get(_folder(item))
    if limit is None:
        yield
        return

    def expire(signum: int, frame: object) -> None:
        raise TimeoutError(f"{item.nodeid} ran past its {limit} s limit (tests/conftest.py TIME_LIMITS_S)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
