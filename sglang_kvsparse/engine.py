"""In-process engine with the plugin active: `sglang_kvsparse.Engine(**kwargs)`.

It takes every `sglang.Engine` keyword argument, plus the launcher's `--kvsparse-*` options as
keyword arguments (`kvsparse_budget`, ...: `options.SPARSITY_OPTIONS`), and applies the launcher's
defaults and refusals: the embedded model when no `model_path` is given, the SGLang options the
sparse layers cannot serve refused (`option_support.py`), and on a machine with no GPU the CPU
engine, torch-native attention and a bounded KV pool.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any

from sglang_kvsparse.models import ensure_default_model, resolve_model_path
from sglang_kvsparse.server.options import (
    SPARSITY_OPTIONS,
    check_model,
    check_sglang_options,
    export_to_processes,
    sparse_sglang_defaults,
    sparsity_from_args,
)
from sglang_kvsparse.server.serving_defaults import (
    check_model_path,
    cpu_defaults,
    enable_cpu_engine,
    gpu_available,
)

logger = logging.getLogger(__name__)


def Engine(**kwargs: Any):  # noqa: N802 - named like the sglang.Engine it returns
    """Return a `sglang.Engine` with the kvsparse plugin configured for it."""
    sparsity = argparse.Namespace(**{name: kwargs.pop(name, None) for name in SPARSITY_OPTIONS})
    if kwargs.get("model_path") is None:
        kwargs["model_path"] = str(ensure_default_model())
    else:
        kwargs["model_path"] = resolve_model_path(kwargs["model_path"], log=logger.info)
        check_model_path(kwargs["model_path"])
    config = sparsity_from_args(sparsity)
    check_model(config, kwargs["model_path"])
    check_sglang_options(config, kwargs)
    export_to_processes(config)
    needed, notes = sparse_sglang_defaults(config, kwargs, cpu=not gpu_available())
    for note in notes:
        logger.warning("kvsparse: %s", note)
    kwargs.update(needed)
    if not gpu_available():
        enable_cpu_engine()
        kwargs.update(cpu_defaults(set(kwargs)))

    import sglang  # only now: the CPU engine switch must precede SGLang's first import

    return sglang.Engine(**kwargs)
