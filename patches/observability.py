"""`/kvsparse/stats` and the Prometheus gauges: the sparse layers' state (SGLang 0.5.23).

The scheduler answers SGLang's internal-state query; an AFTER hook on it adds the `SparseState`
stats under the key "kvsparse". The HTTP route, in the launcher's process, asks for that state
the same way `/server_info` does and returns the first (DP=1) scheduler's entry.

With `--enable-metrics`, SGLang's scheduler logs its gauges through
`SchedulerMetricsCollector.log_stats`; an AFTER hook sets ours next to them. prometheus_client
runs in multiprocess mode there, so gauges made in the scheduler process appear on `/metrics`.
"""

from __future__ import annotations

from typing import Any

from . import memory

TARGET = (
    "sglang.srt.managers.scheduler_components.internal_state."
    "SchedulerInternalStateController.get_internal_state"
)

METRICS_TARGET = "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector.log_stats"

ROUTE = "/kvsparse/stats"

#: name -> (documentation, per layer?) of the gauges `set_gauges` keeps.
GAUGES: dict[str, tuple[str, bool]] = {
    "kv_bytes_in_use": ("KV bytes the running requests hold across all layers", False),
    "kv_bytes_if_dense": ("KV bytes stock SGLang would hold for the same running requests", False),
    "requests_running": ("Requests holding KV slots", False),
    "slots_in_use": ("KV slots in use, per layer (full layers: the running requests' tokens)", True),
    "slots_total": ("KV slots per layer", True),
    "prefix_cache_slots": ("Slots of a sparse layer holding cached prefixes' K/V (evictable)", True),
    "prefix_tokens_reused": ("Prompt tokens whose sparse-layer K/V came from the prefix cache", False),
}

_gauges: dict[str, object] = {}


def add_stats(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook: put the scheduler's sparse stats into its internal-state reply."""
    result.internal_state["kvsparse"] = memory.STATE.stats() if memory.STATE is not None else {"enabled": False}


def set_gauges(result: Any, collector: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on SGLang's metrics logging: set the `sglang_kvsparse:*` gauges."""
    if memory.STATE is None:
        return
    from prometheus_client import Gauge

    labels = dict(collector.labels)
    if not _gauges:
        for name, (doc, per_layer) in GAUGES.items():
            names = [*labels, "layer"] if per_layer else list(labels)
            _gauges[name] = Gauge(f"sglang_kvsparse:{name}", doc, labelnames=names, multiprocess_mode="mostrecent")
    stats = memory.STATE.stats()
    for name, (_, per_layer) in GAUGES.items():
        if per_layer:
            for layer in stats["layers"]:
                if name in layer:  # full layers have no prefix store
                    _gauges[name].labels(**labels, layer=str(layer["layer"])).set(layer[name])
        else:
            _gauges[name].labels(**labels).set(stats[name])


def add_route() -> None:
    """Register `GET /kvsparse/stats` on SGLang's FastAPI app (call before the server starts)."""
    from sglang.srt.entrypoints import http_server

    async def kvsparse_stats() -> dict:
        states = await http_server._global_state.tokenizer_manager.get_internal_state()
        return states[0].get("kvsparse", {"enabled": False})

    if not any(getattr(route, "path", None) == ROUTE for route in http_server.app.routes):
        http_server.app.add_api_route(ROUTE, kvsparse_stats, methods=["GET"])
