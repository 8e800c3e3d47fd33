"""`/kvsparse/stats` and the Prometheus gauges: the sparse layers' state (SGLang 0.5.23).

The scheduler answers SGLang's internal-state query; an AFTER hook on it adds the sparse stats
(`sglang_kvsparse.stats.collect`) under the key "kvsparse". The HTTP route, in the launcher's
process, asks for that state the same way `/server_info` does and returns the first (DP=1)
scheduler's entry.

With `--enable-metrics`, SGLang's scheduler logs its gauges through
`SchedulerMetricsCollector.log_stats`; an AFTER hook sets ours next to them. prometheus_client
runs in multiprocess mode there, so gauges made in the scheduler process appear on `/metrics`.
"""

from __future__ import annotations

from typing import Any

from sglang_kvsparse.stats import SparseStats, collect

from . import context

ROUTE = "/kvsparse/stats"

#: name -> documentation of the gauges with one value per server.
GAUGES: dict[str, str] = {
    "kv_bytes_in_use": "KV bytes the running requests hold across all layers",
    "kv_bytes_if_dense": "KV bytes stock SGLang would hold for the same running requests",
    "requests_running": "Requests holding KV",
    "prefix_tokens_reused": "Prompt tokens whose sparse-layer K/V came from the prefix cache",
}

#: name -> documentation of the per-layer gauges (label "layer").
LAYER_GAUGES: dict[str, str] = {
    "slots_in_use": "KV entries the running requests hold, per layer",
    "slots_total": "KV entries a layer could hold (the heap's rows)",
}

#: Owners of the heap's rows (label "owner"), each a field of `HeapStats`.
HEAP_OWNERS: tuple[str, ...] = ("free", "full_running", "full_cached", "sparse", "prefix_store", "evicting")

_gauges: dict[str, Any] = {}


def current_stats() -> SparseStats | None:
    state = context.current()
    return None if state is None else collect(state, state.heap.free_rows())


def add_stats(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook: put the scheduler's sparse stats into its internal-state reply."""
    stats = current_stats()
    result.internal_state["kvsparse"] = stats.to_dict() if stats is not None else {"enabled": False}


def set_gauges(result: Any, collector: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook on SGLang's metrics logging: set the `sglang_kvsparse:*` gauges."""
    stats = current_stats()
    if stats is None:
        return
    from prometheus_client import Gauge

    labels = dict(collector.labels)
    if not _gauges:

        def gauge(name: str, doc: str, extra: list[str]) -> Any:
            return Gauge(f"sglang_kvsparse:{name}", doc, labelnames=[*labels, *extra], multiprocess_mode="mostrecent")

        _gauges.update({name: gauge(name, doc, []) for name, doc in GAUGES.items()})
        _gauges.update({name: gauge(name, doc, ["layer"]) for name, doc in LAYER_GAUGES.items()})
        _gauges["heap_rows"] = gauge("heap_rows", "Rows of the one KV heap, by owner", ["owner"])
    for name in GAUGES:
        _gauges[name].labels(**labels).set(getattr(stats, name))
    for layer in stats.layers:
        for name in LAYER_GAUGES:
            _gauges[name].labels(**labels, layer=str(layer.layer)).set(getattr(layer, name))
    for owner in HEAP_OWNERS:
        _gauges["heap_rows"].labels(**labels, owner=owner).set(getattr(stats.heap, owner))


def add_route() -> None:
    """Register `GET /kvsparse/stats` on SGLang's FastAPI app (call before the server starts)."""
    from sglang.srt.entrypoints import http_server

    async def kvsparse_stats() -> dict:
        states = await http_server._global_state.tokenizer_manager.get_internal_state()
        return states[0].get("kvsparse", {"enabled": False})

    if not any(getattr(route, "path", None) == ROUTE for route in http_server.app.routes):
        http_server.app.add_api_route(ROUTE, kvsparse_stats, methods=["GET"])
