"""`/kvsparse/stats` and the Prometheus gauges: the sparse layers' state (SGLang 0.5.23).

The scheduler answers SGLang's internal-state query; an AFTER hook on it adds the sparse stats
(`sglang_kvsparse.server.stats.collect`) under the key "kvsparse". With `--tp-size` above 1 every rank
of a replica answers the query in the same place of its loop (SGLang broadcasts it to them), so
the hook gathers the ranks' stats over the replica's CPU group and combines them
(`stats.combine_tp_ranks`: counts that must agree, bytes that add up); only rank 0's reply
reaches the server. The HTTP route, in the launcher's process, asks for that state the same way
`/server_info` does, gets one reply per data-parallel replica and adds them up
(`stats.combine_replicas`).

With `--enable-metrics`, SGLang's scheduler logs its gauges through
`SchedulerMetricsCollector.log_stats`; an AFTER hook sets ours next to them, with SGLang's labels
(`tp_rank`, `dp_rank` among them). prometheus_client runs in multiprocess mode there, so gauges
made in the scheduler process appear on `/metrics`. SGLang logs from each replica's TP rank 0
(every rank with `--enable-metrics-for-all-schedulers`): a dashboard sums a gauge over `dp_rank`;
the `kv_bytes_*` gauges are one rank's KV heads' share, so with every rank logging they sum over
`tp_rank` too.
"""

from __future__ import annotations

from typing import Any

from sglang_kvsparse.server.stats import SparseStats, collect, combine_replicas, combine_tp_ranks

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
    """AFTER hook: put the replica's sparse stats (every TP rank's, combined) into the reply."""
    stats = current_stats()
    own = stats.to_dict() if stats is not None else {"enabled": False}
    result.internal_state["kvsparse"] = combine_tp_ranks(gather_tp_ranks(own))


def gather_tp_ranks(own: dict[str, Any]) -> list[dict[str, Any]]:
    """Every tensor-parallel rank's `own`, in rank order (a collective: every rank calls it)."""
    import torch.distributed as dist
    from sglang.srt.distributed.parallel_state import get_tp_group

    group = get_tp_group()
    if group.world_size == 1:
        return [own]
    gathered: list[Any] = [None] * group.world_size
    dist.all_gather_object(gathered, own, group=group.cpu_group)
    return gathered


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
        return combine_replicas([state.get("kvsparse", {"enabled": False}) for state in states])

    if not any(getattr(route, "path", None) == ROUTE for route in http_server.app.routes):
        http_server.app.add_api_route(ROUTE, kvsparse_stats, methods=["GET"])
