"""The CPU stand-in for sgl_kernel: only with the CPU engine switch, only the CPU-kernel names."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

PROBE = """
import sglang_kvsparse.server.cpu_shims
try:
    import sgl_kernel
except ImportError:
    print("absent")
else:
    try:
        sgl_kernel.assign_req_to_token_pool_cpu()
    except NotImplementedError as exc:
        print("standin", "CPU stand-in" in str(exc))
    try:
        from sgl_kernel import scalar_types  # an optional GPU import SGLang guards
    except ImportError:
        print("guarded-import-falls-back")
    try:
        import sgl_kernel.scalar_type
    except ImportError:
        print("no-submodules")
"""


def _probe(env_value: str | None) -> str:
    env = {"PATH": "/usr/bin:/bin"}
    if env_value is not None:
        env["SGLANG_USE_CPU_ENGINE"] = env_value
    return subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True
    ).stdout.split("\n")


def test_standin_only_with_cpu_engine():
    assert _probe(None)[0] == "absent"
    assert _probe("0")[0] == "absent"


def test_standin_functions_raise_and_guarded_imports_fall_back():
    lines = _probe("1")
    assert lines[:3] == ["standin True", "guarded-import-falls-back", "no-submodules"]


def test_stock_sglang_imports_its_cpu_path():
    """The modules that import sgl_kernel unguarded on the CPU path import with the stand-in."""
    code = "import sglang.srt.mem_cache.allocation, sglang.kernels.ops.kvcache.cache_move; print('ok')"
    env = {"PATH": "/usr/bin:/bin", "SGLANG_USE_CPU_ENGINE": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.stdout.strip().endswith("ok"), result.stderr[-2000:]


PARALLEL_PROBE = """
import inspect
from sglang.srt.distributed import parallel_state
group = parallel_state.init_model_parallel_group
print(getattr(group, "__kvsparse_cpu_no_pynccl__", False))
print(list(inspect.signature(group).parameters)[:4])
"""


@pytest.mark.parametrize("engine, patched", [("1", "True"), (None, "False")])
def test_parallel_groups_default_to_no_pynccl_only_on_the_cpu_engine(engine: str | None, patched: str):
    """SGLang's model-parallel groups skip PyNccl on the CPU engine (`--tp-size 2` starts), and
    the wrapper keeps the signature SGLang's callers rely on; elsewhere the module is untouched."""
    env = {"PATH": "/usr/bin:/bin"}
    if engine is not None:
        env["SGLANG_USE_CPU_ENGINE"] = engine
    result = subprocess.run([sys.executable, "-c", PARALLEL_PROBE], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.strip().split("\n")
    assert lines[-2] == patched
    assert lines[-1] == "['group_ranks', 'local_rank', 'backend', 'use_pynccl']"


def test_no_pynccl_default_keeps_explicit_choices():
    from sglang_kvsparse.patches.cpu_parallel import default_no_pynccl

    calls: list[dict] = []
    module = type(sys)("fake_parallel_state")
    module.init_model_parallel_group = lambda *args, **kwargs: calls.append(kwargs)
    default_no_pynccl(module)
    default_no_pynccl(module)  # idempotent: wrapped once
    module.init_model_parallel_group([[0, 1]], 0, "gloo")
    module.init_model_parallel_group([[0, 1]], 0, "gloo", use_pynccl=True)
    assert calls == [{"use_pynccl": False}, {"use_pynccl": True}]
