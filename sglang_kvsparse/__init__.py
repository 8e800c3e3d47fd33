"""sglang-kvsparse: layer-wise KV-cache sparsity for SGLang.

`Engine` is the in-process entry (see `sglang_kvsparse.engine`); the server is
``python -m sglang_kvsparse.launch_server``. Importing this package does not import SGLang.
"""

from __future__ import annotations

from typing import Any


def Engine(**kwargs: Any):  # noqa: N802 - named like the sglang.Engine it returns
    """`sglang.Engine` with the kvsparse plugin configured; see `sglang_kvsparse.engine.Engine`."""
    from sglang_kvsparse.engine import Engine as make_engine

    return make_engine(**kwargs)
