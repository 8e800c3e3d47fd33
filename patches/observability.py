"""`/kvsparse/stats`: the sparse layers' state, read from the scheduler (SGLang 0.5.23).

The scheduler answers SGLang's internal-state query; an AFTER hook on it adds the `SparseState`
stats under the key "kvsparse". The HTTP route, in the launcher's process, asks for that state
the same way `/server_info` does and returns the first (DP=1) scheduler's entry.
"""

from __future__ import annotations

from typing import Any

from . import memory

TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController.get_internal_state"
)

ROUTE = "/kvsparse/stats"


def add_stats(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook: put the scheduler's sparse stats into its internal-state reply."""
    result.internal_state["kvsparse"] = memory.STATE.stats() if memory.STATE is not None else {"enabled": False}


def add_route() -> None:
    """Register `GET /kvsparse/stats` on SGLang's FastAPI app (call before the server starts)."""
    from sglang.srt.entrypoints import http_server

    async def kvsparse_stats() -> dict:
        states = await http_server._global_state.tokenizer_manager.get_internal_state()
        return states[0].get("kvsparse", {"enabled": False})

    if not any(getattr(route, "path", None) == ROUTE for route in http_server.app.routes):
        http_server.app.add_api_route(ROUTE, kvsparse_stats, methods=["GET"])
