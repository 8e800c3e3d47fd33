"""KV memory of a sparse server in the scheduler process (SGLang 0.5.23).

Three hooks, in the order SGLang runs them while `ModelRunner.alloc_memory_pool` builds the pools:

* `size_pools` (AROUND `KVCacheConfigurator._resolve_memory_pool_config`): the first kvsparse
  code in the scheduler process, so it checks the guards and that every patch is in place, and
  raises (SGLang swallows plugin exceptions, and a half-applied plugin would serve stock attention
  under a sparse configuration). It then takes the KV bytes stock SGLang would use (its token
  count N times every layer) and divides them between the full layers and the sparse pools
  (`accounting.split_pool`): SGLang's pool gets `full_tokens` ids, which only the full layers
  store.
* `pool_class` (AROUND `KVCacheConfigurator._resolve_kv_pool_class`): SGLang's MHA pool class,
  subclassed so that sparse layers get a one-page stub instead of `full_tokens` rows.
* `attach_state` (AFTER `ModelRunner.alloc_memory_pool`): builds the `SparseState` (index maps,
  sparse K/V and score buffers, sized by the split) and attaches it as the request-to-token pool's
  aux cache, so SGLang's own allocation and release paths drive it.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

import torch
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.runtime_context import get_server_args

from sglang_kvsparse.accounting import (
    PoolSplit,
    footprint_table,
    format_footprint_table,
    kv_bytes_per_token,
    split_pool,
)
from sglang_kvsparse.config import ResolvedSparsity, SparsityConfig
from sglang_kvsparse.index_map import round_up
from sglang_kvsparse.sparse_state import SparseState, score_bytes_per_slot

from . import attention

_CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator"
SIZE_TARGET = f"{_CONFIGURATOR}._resolve_memory_pool_config"
POOL_CLASS_TARGET = f"{_CONFIGURATOR}._resolve_kv_pool_class"
TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"

#: The state of this scheduler process (TP=1: one runner), read by the stats and admission hooks.
STATE: SparseState | None = None
#: The split `size_pools` chose, read by `attach_state`.
SPLIT: PoolSplit | None = None


class KVSparseStartupError(RuntimeError):
    """A setting this build cannot serve with sparse layers; the message names the flag."""


def make_size_pools(config: SparsityConfig, other_targets: tuple[str, ...]):
    """The AROUND hook for `SIZE_TARGET`, bound to the configuration."""

    def size_pools(original: Any, configurator: Any, *args: Any, **kwargs: Any) -> Any:
        global SPLIT
        check_guards(other_targets)
        pool_config = original(configurator, *args, **kwargs)
        model = configurator.model_config
        resolved = config.resolve(model.num_hidden_layers, model.context_len)
        head_dim, num_kv_heads = model.head_dim, model.get_num_kv_heads(1)
        bpt = kv_bytes_per_token(num_kv_heads, head_dim, configurator.kv_cache_dtype.itemsize)
        dense_tokens = pool_config.max_total_num_tokens
        SPLIT = split_pool(
            dense_tokens * resolved.num_layers * bpt,
            resolved,
            bpt,
            page_size=configurator.page_size,
            sparse_slot_bytes=bpt + score_bytes_per_slot(num_kv_heads),
        )
        check_split(SPLIT, resolved, configurator.page_size)
        # Without full layers SGLang's ids cost nothing; give it room for every sparse request.
        full_tokens = SPLIT.full_tokens or round_up(
            max(SPLIT.requests_at_target, 1) * SPLIT.target_len, configurator.page_size
        )
        return dataclasses.replace(pool_config, max_total_num_tokens=full_tokens)

    return size_pools


def make_pool_class(config: SparsityConfig):
    """The AROUND hook for `POOL_CLASS_TARGET`: sparse layers get stubs in SGLang's MHA pool."""

    def pool_class(original: Any, configurator: Any, *args: Any, kind: str, default: type, **kwargs: Any) -> type:
        cls = original(configurator, *args, kind=kind, default=default, **kwargs)
        if kind != "mha":
            return cls
        if not (isinstance(cls, type) and issubclass(cls, MHATokenToKVPool)) or cls.__name__.startswith("PageMajor"):
            raise KVSparseStartupError(f"kvsparse: the KV pool {cls!r} is not supported with sparse layers")
        model = configurator.model_config
        resolved = config.resolve(model.num_hidden_layers, model.context_len)
        return stub_pool_class(cls, frozenset(resolved.sparse_layers))

    return pool_class


def stub_pool_class(base: type, sparse_layers: frozenset[int]) -> type:
    """`base` with one-page K/V stubs for `sparse_layers` (whose K/V live in the SparseState).

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
    """The AFTER hook for `TARGET`, bound to the configuration."""

    def attach_state(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
        global STATE
        if SPLIT is None:
            raise KVSparseStartupError("kvsparse: the KV pools were built without the kvsparse split")
        model = runner.model_config
        resolved = config.resolve(model.num_hidden_layers, model.context_len)
        pool = runner.token_to_kv_pool
        k0 = pool.get_key_buffer(resolved.full_layers[0] if resolved.full_layers else 0)
        state = SparseState(
            resolved,
            slots_per_layer=SPLIT.sparse_slots,
            max_requests=runner.req_to_token_pool._alloc_size,
            num_kv_heads=k0.shape[1],
            head_dim=k0.shape[2],
            dtype=k0.dtype,
            dense_capacity=runner.token_to_kv_pool_allocator.size,
            page_size=runner.page_size,
            device=k0.device,
            prefix_cache=not get_server_args().disable_radix_cache,
        )
        runner.req_to_token_pool.attach_aux_cache(state)
        STATE = state
        table = format_footprint_table(footprint_table(resolved, SPLIT.bytes_per_token, page_size=runner.page_size))
        print(
            f"[sglang-kvsparse] {config.describe()}\n"
            f"[sglang-kvsparse] {SPLIT.describe()}\n"
            f"[sglang-kvsparse] KV bytes per request:\n"
            + "\n".join(f"[sglang-kvsparse]   {line}" for line in table.splitlines()),
            file=sys.stderr,
            flush=True,
        )

    return attach_state


def check_split(split: PoolSplit, resolved: ResolvedSparsity, page_size: int) -> None:
    """Refuse a KV budget whose sparse pools cannot hold even one request at its largest."""
    for layer, slots in split.sparse_slots.items():
        need = round_up(resolved.max_entries(layer), page_size)
        if slots < need:
            raise KVSparseStartupError(
                f"kvsparse: sparse layer {layer} gets {slots} slots, fewer than one request's "
                f"{need}: raise --max-total-tokens or --mem-fraction-static"
            )


def check_guards(other_targets: tuple[str, ...]) -> None:
    """Refuse, in one line naming the flag, what the sparse layers cannot serve yet."""
    from .plugin import unpatched

    args = get_server_args()
    problems = []
    if (getattr(args, "chunked_prefill_size", None) or -1) > 0 or getattr(args, "enable_mixed_chunk", False):
        problems.append("chunked prefill is not supported with layer-wise sparsity yet; use --chunked-prefill-size -1")
    if getattr(args, "tp_size", 1) != 1 or getattr(args, "dp_size", 1) != 1 or getattr(args, "pp_size", 1) != 1:
        problems.append("--tp-size/--dp-size/--pp-size must be 1 with layer-wise sparsity")
    if not getattr(args, "disable_overlap_schedule", False):
        problems.append("--disable-overlap-schedule is required with layer-wise sparsity")
    if getattr(args, "speculative_algorithm", None):
        problems.append("speculative decoding is not supported with layer-wise sparsity")
    if getattr(args, "kv_cache_dtype", "auto") not in ("auto", None):
        problems.append(f"--kv-cache-dtype {args.kv_cache_dtype}: sparse layers need the model's dtype")
    for option in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        name = getattr(args, option, None)
        if name is not None and name not in attention.WRAPPED_BACKENDS:
            problems.append(f"--{option.replace('_', '-')} {name}: sparse layers support {attention.WRAPPED_BACKENDS}")
    if not attention.installed():
        problems.append("the kvsparse attention backend is not installed in this process (plugin load failed?)")
    missing = unpatched(other_targets)
    if missing:
        problems.append(f"hooks not applied in this process: {', '.join(missing)} (plugin load failed?)")
    if problems:
        raise KVSparseStartupError("kvsparse: " + "; ".join(problems))
