"""The sparse state of this scheduler process, reached one way by every patch.

SGLang runs one scheduler (and, at TP=1, one model runner) per process. `patches/memory.py`
builds the `SparseState` while SGLang builds its pools and installs it here; the attention
backend, admission, the prefix cap and the stats read it from here. A leaf module (it imports no
other patch), so the patches never import each other in a circle.
"""

from __future__ import annotations

from sglang_kvsparse.sparse_state import SparseState

_state: SparseState | None = None


def install(state: SparseState) -> None:
    global _state
    _state = state


def current() -> SparseState | None:
    """The state, or None in a process that has none (stock SGLang, or pools not built yet)."""
    return _state


def state() -> SparseState:
    """The state; raises if this process has none (a hook ran where no sparse pools were built)."""
    if _state is None:
        raise RuntimeError("kvsparse: no sparse state in this process (the KV pools were built without the plugin)")
    return _state
