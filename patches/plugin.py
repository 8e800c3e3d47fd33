"""SGLang plugin entry point (group ``sglang.srt.plugins``), run by SGLang in every process.

SGLang calls `load` early in each of its processes, the spawned schedulers included. The effective
sparsity configuration arrives through the environment (`sglang_kvsparse.options.CONFIG_ENV`),
set by the project's launcher or engine factory. Without it this plugin registers nothing: an
installed plugin with sparsity off leaves SGLang exactly as shipped.
"""

from __future__ import annotations

import json
import os

from sglang_kvsparse.config import parse_config
from sglang_kvsparse.options import CONFIG_ENV


def load() -> None:
    """Register the project's hooks when sparsity is enabled for this server; else do nothing."""
    raw = os.environ.get(CONFIG_ENV)
    if raw is None:
        return
    config = parse_config(json.dumps(json.loads(raw)))
    if config.enabled:
        raise RuntimeError(
            f"{CONFIG_ENV} enables layer-wise sparsity, but this build has no sparse attention "
            "backend yet; unset it or use --kvsparse-preset off"
        )
