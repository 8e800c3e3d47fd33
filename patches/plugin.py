"""SGLang plugin entry point (group ``sglang.srt.plugins``), run by SGLang in every process.

SGLang calls `load` early in each of its processes, the spawned schedulers included. The effective
sparsity configuration arrives through the environment (`sglang_kvsparse.server.options.CONFIG_ENV`),
set by the project's launcher or engine factory. Without it this plugin registers nothing: an
installed plugin with sparsity off leaves SGLang exactly as shipped.

SGLang logs and swallows a plugin's exceptions, and a hook that fails to apply leaves stock code
running. So failures are made visible elsewhere: the scheduler-side hook (`memory.check_guards`)
refuses to start unless the attention backend and every hook are installed, and the launcher calls
`verify_loaded` after SGLang loaded the plugins.
"""

from __future__ import annotations

import json
import os

from sglang_kvsparse.config import SparsityConfig, parse_config
from sglang_kvsparse.server.options import CONFIG_ENV

from . import hooks


def configured() -> SparsityConfig | None:
    """The enabled configuration from the environment, or None when this server is stock."""
    raw = os.environ.get(CONFIG_ENV)
    if raw is None:
        return None
    config = parse_config(json.dumps(json.loads(raw)))
    return config if config.enabled else None


def load() -> None:
    """Register the project's hooks when sparsity is enabled for this server; else do nothing."""
    config = configured()
    if config is None:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from . import admission, attention, chunking, memory, observability, prefix, validation

    attention.install()
    registrations = [
        (hooks.SIZE_POOLS, memory.make_size_heap(config), HookType.AROUND),
        (hooks.POOL_CLASS, memory.make_pool_class(config), HookType.AROUND),
        (hooks.ALLOC_MEMORY_POOL, memory.make_attach_state(config), HookType.AFTER),
        (hooks.ADD_ONE_REQ, admission.admit, HookType.AROUND),
        (hooks.REQ_ALLOC, admission.expect_lengths, HookType.AFTER),
        (hooks.MATCH_KV_CACHE, prefix.cap_match, HookType.AROUND),
        (hooks.ADD_CHUNKED_REQ, admission.admit_chunk, HookType.AROUND),
        (hooks.SELECT_PREFILL, chunking.fit_admission, HookType.AROUND),
        (hooks.FLOOR_CHUNK, chunking.fit_floor, HookType.AROUND),
        (hooks.UNIFIED_INSERT, prefix.adopt_duplicates, HookType.AROUND),
        (hooks.RADIX_INSERT, prefix.adopt_duplicates, HookType.AROUND),
        (hooks.CREATE_REQUEST, validation.make_check_setting(config), HookType.AFTER),
        (hooks.WAIT_RESPONSE, validation.make_report_setting(config), HookType.AROUND),
        (hooks.INTERNAL_STATE, observability.add_stats, HookType.AFTER),
        (hooks.FORWARD_BATCH, attention.with_host_indices, HookType.AFTER),
        (hooks.FORWARD_RAW, attention.release_after_forward, HookType.AFTER),
        (hooks.GRAPH_EXECUTE, attention.graph_execute, HookType.AROUND),
        (hooks.LOG_STATS, observability.set_gauges, HookType.AFTER),
    ]
    for target, hook, kind in registrations:
        HookRegistry.register(target, hook, kind)


def verify_loaded() -> None:
    """Raise when sparsity is enabled but this process's patches are not in place."""
    if configured() is None:
        return
    from . import attention

    missing = hooks.unpatched()
    if not attention.installed():
        missing.append("attention registry (torch_native/triton)")
    if missing:
        raise RuntimeError(f"kvsparse plugin did not apply: {', '.join(missing)} (see the log above)")
