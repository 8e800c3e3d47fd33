"""The plugin entry point: registered with SGLang, a no-op unless sparsity is enabled."""
# Enabled, it installs the wrapping attention factories and its eight hooks (the e2e tests show
# they serve); patches/memory.py refuses to start a scheduler where any is missing.

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sglang_kvsparse.patches import hooks

pytestmark = pytest.mark.integration

PROBE = """
from sglang.srt.plugins import load_plugins
from sglang.srt.plugins.hook_registry import HookRegistry
load_plugins()
print("hooks", sum(len(v) for v in HookRegistry._hooks.values()))
from sglang_kvsparse.patches import attention, plugin
plugin.verify_loaded()
print("attention wrapped", attention.installed())
"""


def _run(env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "SGLANG_USE_CPU_ENGINE": "1", **env_extra}
    return subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env)


def test_entry_point_is_registered():
    from importlib.metadata import entry_points

    names = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert names.get("kvsparse") == "sglang_kvsparse.patches.plugin:load"


def test_plugin_registers_nothing_when_off():
    result = _run({})
    assert result.returncode == 0, result.stderr[-2000:]
    assert "hooks 0" in result.stdout
    off = json.dumps({"enabled": False})
    result = _run({"SGLANG_KVSPARSE_CONFIG": off})
    assert "hooks 0" in result.stdout, result.stderr[-2000:]
    assert "attention wrapped False" in result.stdout


def test_plugin_installs_the_sparse_backend_when_enabled():
    enabled = json.dumps({"enabled": True, "full_layers": [0, 1], "budget": 8192})
    result = _run({"SGLANG_KVSPARSE_CONFIG": enabled})
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"hooks {len(hooks.ALL)}" in result.stdout and "attention wrapped True" in result.stdout
