"""SGLang plugin entry point (group ``sglang.srt.plugins``), run by SGLang in every process.

SGLang calls `load` early in each of its processes, the spawned schedulers included. The effective
sparsity configuration arrives through the environment (`sglang_kvsparse.options.CONFIG_ENV`),
set by the project's launcher or engine factory. Without it this plugin registers nothing: an
installed plugin with sparsity off leaves SGLang exactly as shipped.

SGLang logs and swallows a plugin's exceptions, and a hook that fails to apply leaves stock code
running. So failures are made visible elsewhere: the scheduler-side hook (`patches/memory.py`)
refuses to start unless the attention backend is installed, and the launcher calls
`verify_loaded` after SGLang loaded the plugins.
"""

from __future__ import annotations

import json
import os

from sglang_kvsparse.config import SparsityConfig, parse_config
from sglang_kvsparse.options import CONFIG_ENV


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

    from . import admission, attention, memory, observability, prefix

    attention.install()
    hooks = [
        (memory.SIZE_TARGET, memory.make_size_pools(config, _checked_targets()), HookType.AROUND),
        (memory.POOL_CLASS_TARGET, memory.make_pool_class(config), HookType.AROUND),
        (memory.TARGET, memory.make_attach_state(config), HookType.AFTER),
        (admission.TARGET, admission.admit, HookType.AROUND),
        (prefix.TARGET, prefix.cap_match, HookType.AROUND),
        (observability.TARGET, observability.add_stats, HookType.AFTER),
        (observability.METRICS_TARGET, observability.set_gauges, HookType.AFTER),
    ]
    for target, hook, kind in hooks:
        HookRegistry.register(target, hook, kind)


def _checked_targets() -> tuple[str, ...]:
    """Hooked targets whose absence `memory.size_pools` reports (it runs inside the first one)."""
    from . import admission, memory, observability, prefix

    return (
        memory.POOL_CLASS_TARGET,
        memory.TARGET,
        admission.TARGET,
        prefix.TARGET,
        observability.TARGET,
        observability.METRICS_TARGET,
    )


def unpatched(targets: tuple[str, ...]) -> list[str]:
    """The targets that SGLang's hook registry has not wrapped in this process."""
    return [target for target in targets if not hasattr(_resolve(target), "__wrapped__")]


def verify_loaded() -> None:
    """Raise when sparsity is enabled but this process's patches are not in place."""
    if configured() is None:
        return
    from . import attention, memory

    missing = unpatched((memory.SIZE_TARGET, *_checked_targets()))
    if not attention.installed():
        missing.append("attention registry (torch_native/triton)")
    if missing:
        raise RuntimeError(f"kvsparse plugin did not apply: {', '.join(missing)} (see the log above)")


def _resolve(dotted: str) -> object:
    import importlib

    module_name, _, rest = dotted.partition(".")
    obj: object = importlib.import_module(module_name)
    path = module_name
    for part in rest.split("."):
        path = f"{path}.{part}"
        try:
            obj = getattr(obj, part)
        except AttributeError:
            obj = importlib.import_module(path)
    return obj
