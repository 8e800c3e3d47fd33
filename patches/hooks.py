"""Hook targets: the SGLang functions the plugin wraps, and a check that the wrapping took.

A leaf module (it imports no other patch), so `plugin.py`, which registers the hooks, and
`memory.py`, which refuses to start when one did not apply, both read the targets from here.
SGLang's hook registry marks a wrapped function with `__wrapped__`.
"""

from __future__ import annotations

import importlib

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"

#: AROUND: the KV bytes stock SGLang would use become the heap's rows (`memory.size_heap`).
SIZE_POOLS = f"{_CONFIGURATOR}._resolve_memory_pool_config"
#: AROUND: SGLang's MHA pool class gets stubs for the sparse layers (`memory.pool_class`).
POOL_CLASS = f"{_CONFIGURATOR}._resolve_kv_pool_class"
#: AFTER: the sparse state is built on SGLang's pools and allocator (`memory.attach_state`).
ALLOC_MEMORY_POOL = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"
#: AROUND: admission charges the sparse entries and pins a hit's prefix (`admission.admit`).
ADD_ONE_REQ = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
#: AFTER: requests given their indices tell the state how long they may grow (`admission.expect_lengths`).
REQ_ALLOC = "sglang.srt.mem_cache.memory_pool.ReqToTokenPool.alloc"
#: AROUND: a radix match is cut to what the prefix store can serve (`prefix.cap_match`).
MATCH_KV_CACHE = "sglang.srt.mem_cache.common.match_kv_cache"
#: AROUND: the next chunk of a chunked prompt is charged its sparse rows (`admission.admit_chunk`).
ADD_CHUNKED_REQ = "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req"
#: AROUND: a new request's first chunk leaves its last chunk the whole window (`chunking.fit_admission`).
SELECT_PREFILL = "sglang.srt.managers.schedule_policy.PrefillAdder._select_prefill_admission"
#: AROUND: so does a chunked request's next chunk (`chunking.fit_floor`).
FLOOR_CHUNK = "sglang.srt.managers.schedule_policy.PrefillAdder.floor_chunked_tokens"
#: AROUND: store entries of duplicates the tree frees move to its ids (`prefix.adopt_duplicates`),
#: in SGLang's default tree and in its plain radix tree.
UNIFIED_INSERT = "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache.insert"
RADIX_INSERT = "sglang.srt.mem_cache.radix_cache.RadixCache.insert"
#: AFTER: a request's own sparsity setting is checked before it is queued (`validation.make_check_setting`).
CREATE_REQUEST = "sglang.srt.managers.tokenizer_manager.TokenizerManager._create_tokenized_object"
#: AROUND: a response's meta_info reports the setting applied (`validation.make_report_setting`).
WAIT_RESPONSE = "sglang.srt.managers.tokenizer_manager.TokenizerManager._wait_one_response"
#: AFTER: the scheduler's internal state carries the sparse stats (`observability.add_stats`).
INTERNAL_STATE = (
    "sglang.srt.managers.scheduler_components.internal_state.SchedulerInternalStateController.get_internal_state"
)
#: AFTER: a decode forward keeps the scheduler's host copy of its request indices (`attention.with_host_indices`).
FORWARD_BATCH = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
#: AFTER: the issued forward's evicted rows and prefix pins go back (`attention.release_after_forward`).
FORWARD_RAW = "sglang.srt.model_executor.model_runner.ModelRunner._forward_raw"
_GRAPH_RUNNER = "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner"
#: AROUND: a replay's planning learns the real batch's request indices (`attention.graph_execute`).
GRAPH_EXECUTE = f"{_GRAPH_RUNNER}.execute"
#: AFTER: SGLang's metrics logging sets the sparse gauges too (`observability.set_gauges`).
LOG_STATS = "sglang.srt.observability.metrics_collector.SchedulerMetricsCollector.log_stats"

#: Every target, in the order `plugin.load` registers them.
ALL: tuple[str, ...] = (
    SIZE_POOLS,
    POOL_CLASS,
    ALLOC_MEMORY_POOL,
    ADD_ONE_REQ,
    REQ_ALLOC,
    MATCH_KV_CACHE,
    ADD_CHUNKED_REQ,
    SELECT_PREFILL,
    FLOOR_CHUNK,
    UNIFIED_INSERT,
    RADIX_INSERT,
    CREATE_REQUEST,
    WAIT_RESPONSE,
    INTERNAL_STATE,
    FORWARD_BATCH,
    FORWARD_RAW,
    GRAPH_EXECUTE,
    LOG_STATS,
)


def unpatched(targets: tuple[str, ...] = ALL) -> list[str]:
    """The targets that SGLang's hook registry has not wrapped in this process."""
    return [target for target in targets if not hasattr(resolve(target), "__wrapped__")]


def resolve(dotted: str) -> object:
    """The object a dotted path names (modules imported as needed)."""
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
