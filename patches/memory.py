"""The one KV heap of a sparse server, built on SGLang's own pools (SGLang 0.5.23).

Three hooks, in the order SGLang runs them while `ModelRunner.alloc_memory_pool` builds the pools:

* `size_heap` (AROUND `KVCacheConfigurator._resolve_memory_pool_config`): the first kvsparse code
  in the scheduler process, so it checks the guards and that every patch is in place, and raises
  (SGLang swallows plugin exceptions, and a half-applied plugin would serve stock attention under
  a sparse configuration). It takes the KV bytes stock SGLang would use (its token count N times
  every layer) and turns them into heap rows (`layout.heap_rows`): SGLang's pool gets that many
  ids, and each of its full layers a buffer of that many rows (the heap's lanes).
* `pool_class` (AROUND `KVCacheConfigurator._resolve_kv_pool_class`): SGLang's MHA pool class,
  subclassed so that sparse layers get a one-page stub instead of a buffer.
* `attach_state` (AFTER `ModelRunner.alloc_memory_pool`): turns SGLang's allocator into the
  heap's (`patches/allocator.py`), builds the `SparseState` on the lanes and attaches it as the
  request-to-token pool's aux cache, so SGLang's own allocation and release paths drive it.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.runtime_context import get_memory, get_model, get_schedule, get_server_args, get_serving
from sglang.srt.utils.hf_transformers_utils import get_tokenizer

from sglang_kvsparse.config import ResolvedSparsity, SparsityConfig
from sglang_kvsparse.policies.sentences import SentenceMarks, sentence_end_tokens
from sglang_kvsparse.server.accounting import footprint_table, format_footprint_table, human_bytes, kv_bytes_per_token
from sglang_kvsparse.server.backends import BACKEND_OPTIONS, WRAPPED_BACKENDS
from sglang_kvsparse.server.model_support import resolve_for_model, unsupported_features
from sglang_kvsparse.server.option_support import checked_values, option_problems
from sglang_kvsparse.server.stats import describe_tables, table_warning
from sglang_kvsparse.state.layout import HeapLayout, heap_rows, scores_per_row
from sglang_kvsparse.state.sparse_group import LaneBuffers
from sglang_kvsparse.state.sparse_state import SparseState

from . import allocator, attention, context
from .hooks import unpatched


class KVSparseStartupError(RuntimeError):
    """A setting this build cannot serve with sparse layers; the message names the flag."""


def make_size_heap(config: SparsityConfig):
    """The AROUND hook for `hooks.SIZE_POOLS`, bound to the configuration."""

    def size_heap(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
        model = configurator.model_config
        check_guards(model)
        pool_config = original(configurator, *args, **kwargs)
        dtype_bytes, page = configurator.kv_cache_dtype.itemsize, configurator.page_size
        layout = HeapLayout.from_resolved(
            resolved_for(config, model),
            scores_per_row(model.head_dim, dtype_bytes),
            page,
        )
        bpt = kv_bytes_per_token(model.get_num_kv_heads(1), model.head_dim, dtype_bytes)
        total = pool_config.max_total_num_tokens * layout.num_layers * bpt
        rows = heap_rows(total, layout.lanes, bpt, page)
        check_heap(layout, rows)
        return dataclasses.replace(pool_config, max_total_num_tokens=rows)

    return size_heap


def make_pool_class(config: SparsityConfig):
    """The AROUND hook for `hooks.POOL_CLASS`: sparse layers get stubs in SGLang's MHA pool."""

    def pool_class(original: Any, configurator: Any, *args: Any, kind: str, default: type, **kwargs: Any) -> type:
        cls = original(configurator, *args, kind=kind, default=default, **kwargs)
        if kind != "mha":
            return cls
        if not (isinstance(cls, type) and issubclass(cls, MHATokenToKVPool)) or cls.__name__.startswith("PageMajor"):
            raise KVSparseStartupError(f"kvsparse: the KV pool {cls!r} is not supported with sparse layers")
        model = configurator.model_config
        resolved = resolved_for(config, model)
        return stub_pool_class(cls, frozenset(resolved.heap_layers))

    return pool_class


def stub_pool_class(base: type, sparse_layers: frozenset[int]) -> type:
    """`base` with one-page K/V stubs for `sparse_layers`, sliding ones included (whose K/V live
    in the heap's lanes).

    The buffer lists keep one entry per layer, so SGLang's `layer_id - start_layer` indexing is
    unchanged; a write into a stub raises, so a stray write fails loudly instead of corrupting.
    """

    class KVSparseMHAPool(base):
        def _create_buffers_normal(self) -> None:
            if getattr(self, "kv_cache_layout", "nhd") != "nhd":
                raise KVSparseStartupError(f"kvsparse: KV layout {self.kv_cache_layout!r} is not supported")
            layers = range(self.start_layer, self.start_layer + self.layer_num)
            full = [i for i, layer in enumerate(layers) if layer not in sparse_layers]
            real_layer_num = self.layer_num
            self.layer_num = len(full)  # the stock code allocates only the full layers
            try:
                super()._create_buffers_normal()
            finally:
                self.layer_num = real_layer_num
            full_k, full_v = iter(self.k_buffer), iter(self.v_buffer)
            k_shape, v_shape = self._kv_buffer_shapes()
            stub = (self.page_size,)
            self.k_buffer, self.v_buffer = [], []
            for i in range(real_layer_num):
                is_full = i in full
                self.k_buffer.append(next(full_k) if is_full else self._stub(stub + tuple(k_shape[1:])))
                self.v_buffer.append(next(full_v) if is_full else self._stub(stub + tuple(v_shape[1:])))

        def _stub(self, shape: tuple[int, ...]) -> torch.Tensor:
            return torch.zeros(shape, dtype=self.store_dtype, device=self.device)

        def _build_kv_buffer_descs(self) -> list:
            return []  # only PD transfer and post-capture backing read these; both are refused

        def set_kv_buffer(self, layer: Any, *args: Any, **kwargs: Any) -> Any:
            if layer is not None and layer.layer_id in sparse_layers:
                raise RuntimeError(f"kvsparse: write into SGLang's pool for sparse layer {layer.layer_id}")
            return super().set_kv_buffer(layer, *args, **kwargs)

    KVSparseMHAPool.__qualname__ = KVSparseMHAPool.__name__ = f"KVSparse{base.__name__}"
    return KVSparseMHAPool


def make_attach_state(config: SparsityConfig):
    """The AFTER hook for `hooks.ALLOC_MEMORY_POOL`, bound to the configuration."""

    def attach_state(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
        model = runner.model_config
        resolved = resolved_for(config, model)
        token_allocator = runner.token_to_kv_pool_allocator
        rows = token_allocator.size
        lanes = lane_buffers(runner.token_to_kv_pool, resolved.full_layers, rows + runner.page_size)
        heap = allocator.make_heap(token_allocator)
        state = SparseState(
            resolved,
            heap=heap,
            lanes=lanes,
            max_requests=runner.req_to_token_pool._alloc_size,
            heap_rows=rows,
            prefix_cache=needs_prefix_store(get_memory(), get_schedule()),
            sentence_marks=sentence_marks(rows + runner.page_size, lanes[0].k.device),
        )
        allocator.attach(token_allocator, state)
        runner.req_to_token_pool.attach_aux_cache(state)
        context.install(state)
        log_layout(config, state.layout, lanes[0], rows, resolved.context_len)
        print(f"[sglang-kvsparse] {describe_tables(state)}", file=sys.stderr, flush=True)
        warning = table_warning(state)
        if warning is not None:
            print(f"[sglang-kvsparse] {warning}", file=sys.stderr, flush=True)

    return attach_state


def sentence_marks(slots: int, device: torch.device) -> SentenceMarks | None:
    """The marks of sentence-ending tokens (`sglang_kvsparse.policies.sentences`), from the tokenizer the
    scheduler loads too (`Scheduler.init_tokenizer`'s arguments); None, said in the log, when
    SGLang skips the tokenizer (policies then score without sentences)."""
    serving, model = get_serving(), get_model()
    if serving.skip_tokenizer_init:
        print(
            "[sglang-kvsparse] no tokenizer (--skip-tokenizer-init): policies score without sentences", file=sys.stderr
        )
        return None
    tokenizer = get_tokenizer(
        serving.tokenizer_path,
        tokenizer_mode=serving.tokenizer_mode,
        trust_remote_code=model.trust_remote_code,
        revision=model.revision,
        tokenizer_backend=serving.tokenizer_backend,
    )
    ends = sentence_end_tokens(tokenizer.batch_decode, len(tokenizer))
    print(f"[sglang-kvsparse] sentences: {int(ends.sum())} of {len(tokenizer)} token ids end one", file=sys.stderr)
    return SentenceMarks(ends, slots, device)


def lane_buffers(pool: Any, full_layers: tuple[int, ...], buffer_rows: int) -> list[LaneBuffers]:
    """The heap's lanes: the K/V buffers of the i-th full layer in SGLang's pool are lane i (with
    no full layer, one lane of our own); their K bytes also hold the score rows' scores."""
    if full_layers:
        kv = [(pool.get_key_buffer(layer), pool.get_value_buffer(layer)) for layer in full_layers]
    else:
        k0 = pool.get_key_buffer(0)  # a stub: it has the shape and dtype
        shape = (buffer_rows, *k0.shape[1:])
        kv = [
            (torch.zeros(shape, dtype=k0.dtype, device=k0.device), torch.zeros(shape, dtype=k0.dtype, device=k0.device))
        ]
    for k, _ in kv:
        if k.shape[0] != buffer_rows:
            raise KVSparseStartupError(
                f"kvsparse: a full layer's KV buffer has {k.shape[0]} rows, the heap {buffer_rows}"
            )
    return [LaneBuffers.over(k, v) for k, v in kv]


def log_layout(config: SparsityConfig, layout: HeapLayout, lane: LaneBuffers, rows: int, context_len: int) -> None:
    bpt = kv_bytes_per_token(lane.k.shape[1], lane.k.shape[2], lane.k.element_size())
    heap_bytes = rows * layout.lanes * bpt
    table = format_footprint_table(footprint_table(layout, bpt, context_len))
    print(
        f"[sglang-kvsparse] {config.describe()}\n"
        f"[sglang-kvsparse] KV heap: {rows} rows x {layout.lanes} lane(s), {human_bytes(heap_bytes)} "
        f"(the KV bytes of stock SGLang's pool); {layout.describe()}\n"
        f"[sglang-kvsparse] KV bytes per request (requests of one length fit at the ratio shown):\n"
        + "\n".join(f"[sglang-kvsparse]   {line}" for line in table.splitlines()),
        file=sys.stderr,
        flush=True,
    )


def check_heap(layout: HeapLayout, rows: int) -> None:
    """Refuse a KV budget in which no request can outgrow its budget, the server's or the
    largest one a request may ask for."""
    longest = max((layout.widest_request(group) for group in layout.groups), default=0) + 1
    need = max(layout.rows_held(longest), layout.rows_held(longest, layout.request_cap)) + layout.page_size
    if rows < need:
        raise KVSparseStartupError(
            f"kvsparse: the KV heap has {rows} rows, fewer than one {longest}-token request's {need}: "
            "raise --max-total-tokens or --mem-fraction-static"
        )


def needs_prefix_store(memory: Any, schedule: Any) -> bool:
    """The sparse layers keep prompt K/V for the radix cache's hits and for chunked prefill.

    Both as SGLang resolved them (its `memory` and `schedule` settings), not as given: SGLang's
    server args keep an unset --chunked-prefill-size as None while its scheduler chunks at its
    own default (4,096 tokens on the CPU), and a server started with --disable-radix-cache and
    no chunk size then met its first chunked prompt without a store and stopped."""
    return not memory.disable_radix_cache or (schedule.chunked_prefill_size or -1) > 0


def resolved_for(config: SparsityConfig, model: Any) -> ResolvedSparsity:
    """The configuration resolved for SGLang's `ModelConfig`, its sliding-window layers included."""
    return resolve_for_model(config, model.hf_config.to_dict(), model.num_hidden_layers, model.context_len)


def check_guards(model: Any) -> None:
    """Refuse, in one line naming the flag or the model's feature, what the sparse layers cannot
    serve. The launcher refuses such models before SGLang starts (`options.check_model`); this
    covers every other way in (`sglang.Engine`, `sglang.launch_server` with the plugin's variable):
    an MLA model, say, would otherwise size an MHA heap from its latent cache."""
    args = get_server_args()
    problems = [f"the model has {feature}" for feature in unsupported_features(model.hf_config.to_dict())]
    problems += option_problems(checked_values(args), os.environ)
    for option in BACKEND_OPTIONS:
        name = getattr(args, option, None)
        if name is not None and name not in WRAPPED_BACKENDS:
            problems.append(f"--{option.replace('_', '-')} {name}: sparse layers run beside {WRAPPED_BACKENDS}")
    if not attention.installed():
        problems.append("the kvsparse attention backend is not installed in this process (plugin load failed?)")
    missing = unpatched()
    if missing:
        problems.append(f"hooks not applied in this process: {', '.join(missing)} (plugin load failed?)")
    if problems:
        raise KVSparseStartupError("kvsparse: " + "; ".join(problems))
