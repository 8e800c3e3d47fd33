"""The attention backend of a sparse server (SGLang 0.5.23 attention registry).

The stock backend names stay (SGLang keys scheduler helpers on them); `install` re-registers
every MHA/GQA backend (`sglang_kvsparse.server.backends.WRAPPED_BACKENDS`: SGLang's default on each
device among them) with a factory that wraps the stock backend in `KVSparseBackend`. Full
layers go to the stock backend unchanged; sparse layers go to `sglang_kvsparse.forward.sparse_forward`
(SGLang-free), which plans the forward once per step in `init_forward_metadata` from host data
only (the request indices from SGLang's host copy, which `with_host_indices` keeps for decode
batches too) and runs each sparse layer: this module only translates SGLang's calls. Once SGLang
has issued the whole forward (`release_after_forward`, after `_forward_raw`), the state releases
what the step's evictions and prefix reads held: outside the layers, so a captured graph has no
host side effect.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sglang.srt.layers.attention import attention_registry
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_kvsparse.forward.sparse_attention import KVScales
from sglang_kvsparse.forward.sparse_forward import SparseForward
from sglang_kvsparse.server.backends import WRAPPED_BACKENDS
from sglang_kvsparse.state.sparse_state import SparseState

from . import context

_MARK = "__kvsparse_wrapped__"


class KVSparseBackend(AttentionBackend):
    """Full layers: the inner stock backend. Sparse layers: the project's path
    (`SparseForward`), given the forward's plain values read off SGLang's `ForwardBatch`."""

    def __init__(self, inner: AttentionBackend, state: SparseState) -> None:
        self.inner = inner
        self.state = state
        self.sparse = SparseForward(state)
        # Generic SGLang code reads the pools off whatever backend is current.
        self.req_to_token_pool = inner.req_to_token_pool
        self.token_to_kv_pool = inner.token_to_kv_pool
        self.data_type = inner.data_type
        self.kv_cache_dtype = inner.kv_cache_dtype
        #: The request indices of the decode step about to replay (`graph_execute`).
        self.replay_requests: list[int] | None = None
        #: Sparse and sliding layers whose window SGLang's layer was found to agree with (`_checked`).
        self._windows_checked: set[int] = set()

    # Attributes the base class declares (so __getattr__ would never see them) but the inner
    # backend owns: forward them, so a translator bound to the wrapper reaches the inner one.
    @property
    def kv_index_translator(self) -> Any:
        return self.inner.kv_index_translator

    @kv_index_translator.setter
    def kv_index_translator(self, value: Any) -> None:
        self.inner.kv_index_translator = value

    @property
    def forward_metadata(self) -> Any:
        return self.inner.forward_metadata

    @forward_metadata.setter
    def forward_metadata(self, value: Any) -> None:
        self.inner.forward_metadata = value

    def __getattr__(self, name: str) -> Any:
        # Only reached for names neither this class nor the base defines (backend-specific
        # helpers such as CUDA-graph state); those belong to the inner backend.
        return getattr(self.__dict__["inner"], name)

    def init_forward_metadata(self, forward_batch: Any) -> None:
        self.inner.init_forward_metadata(forward_batch)
        mode = forward_batch.forward_mode
        if mode.is_idle():
            self.sparse.idle()
            return
        req_indices = self._req_indices(forward_batch)
        slots, ids = forward_batch.out_cache_loc, forward_batch.input_ids
        if mode.is_decode():
            self.sparse.begin_decode(req_indices, slots, ids)
        elif mode.is_extend() and not mode.is_target_verify():
            # SGLang runs a mixed batch (prefills, then running requests' decode tokens) as an extend.
            prefix_lens = [int(n) for n in forward_batch.extend_prefix_lens_cpu]
            table = self.req_to_token_pool.req_to_token
            prefix_ids = [table[req_idx, :n] for req_idx, n in zip(req_indices, prefix_lens)]
            extend_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu]
            self.sparse.begin_extend(req_indices, prefix_lens, extend_lens, prefix_ids, slots, ids)
        else:
            raise NotImplementedError(f"kvsparse: forward mode {mode} is not supported with sparse layers")

    # -- SGLang's decode CUDA graphs ---------------------------------------------------------
    # The sparse layers of a captured step read fixed buffers (`SparseForward.init_graph`);
    # everything variable runs outside the graph: `init_forward_metadata_out_graph` before a
    # replay, `release_after_forward` after.
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)
        self.sparse.init_graph(max_bs)

    def get_cuda_graph_seq_len_fill_value(self) -> Any:
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Before capturing a decode step of `batch_size` requests: the plan over the buffers.
        Before replaying one: its real requests (`replay_requests`, the first `batch_size -
        num_padding`) planned into the buffers."""
        self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        if in_capture:
            self.sparse.begin_capture(forward_batch.batch_size)
            return
        req_indices, self.replay_requests = self.replay_requests, None
        if req_indices is None or len(req_indices) != forward_batch.batch_size - forward_batch.num_padding:
            raise RuntimeError("kvsparse: a decode graph replay without its requests' indices")
        self.sparse.begin_replay(
            req_indices, forward_batch.batch_size, forward_batch.out_cache_loc, forward_batch.input_ids
        )

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        self.inner.init_forward_metadata_in_graph(forward_batch)

    def on_after_cuda_graph_warmup(self) -> None:
        self.inner.on_after_cuda_graph_warmup()

    def expect_replay(self, forward_batch: Any) -> None:
        """The decode step about to replay this batch: its real request indices, for the replay's
        planning (`init_forward_metadata_out_graph`, which SGLang calls with a padded view)."""
        self.replay_requests = self._req_indices(forward_batch)

    def _req_indices(self, forward_batch: Any) -> list[int]:
        """The batch's request indices, from SGLang's host copy. Without one (a path that gives a
        forward none) they are read from the device: counted, as it makes the host wait."""
        req_indices = forward_batch.req_pool_indices_cpu
        if req_indices is None:
            self.state.counters.add(host_syncs=1)
            req_indices = forward_batch.req_pool_indices
        return req_indices.tolist()

    def _checked(self, layer: Any) -> bool:
        """Whether the layer is one of the heap's (sparse or sliding), checking once that the
        window SGLang's layer applies (`sliding_window_size`: the keys before the query's own that
        it reads, -1 or None for all) is the one the layout keeps and the kernels apply: a
        mismatch would answer wrongly without a word."""
        layer_id = layer.layer_id
        place = self.state.layout.layer_places.get(layer_id)
        if place is None or layer_id in self._windows_checked:
            return place is not None
        window = self.state.layout.groups[place.group].sliding_window
        size = getattr(layer, "sliding_window_size", None)
        theirs = 0 if size is None or size < 0 else size + 1
        if theirs != window:
            raise RuntimeError(
                f"kvsparse: layer {layer_id} attends over a window of {theirs or 'every'} key(s) in SGLang "
                f"but {window or 'every'} in the sparse layout (from the model's config.json)"
            )
        self._windows_checked.add(layer_id)
        return True

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not self._checked(layer):
            return self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        q3 = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = self.sparse.extend(q3, k, v, layer.layer_id, layer.scaling, forward_batch.positions, kv_scales(layer))
        return o.reshape(q3.shape[0], -1)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not self._checked(layer):
            return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = self.sparse.decode(q3, k, v, layer.layer_id, layer.scaling, forward_batch.positions, kv_scales(layer))
        return o.reshape(q3.shape[0], -1)

    def support_triton(self) -> bool:
        return self.inner.support_triton()


def kv_scales(layer: Any) -> KVScales:
    """The layer's FP8 KV scales (`RadixAttention.k_scale_float`, from the checkpoint; None: 1)."""
    return KVScales(layer.k_scale_float or 1.0, layer.v_scale_float or 1.0)


def graph_execute(original: Callable[..., Any], runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `DecodeCudaGraphRunner.execute`: the replay's planning (`init_forward_metadata_out_graph`,
    which SGLang calls with a padded view of the batch) learns the real batch's request indices."""
    backend = runner.attn_backend
    if isinstance(backend, KVSparseBackend):
        backend.expect_replay(forward_batch)
    return original(runner, forward_batch, *args, **kwargs)


def with_host_indices(forward_batch: Any, cls: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `ForwardBatch.init_new`: SGLang hands a forward its request indices on the host for
    extends only, while the scheduler's batch keeps them for decodes too: keep them, so the plan
    never reads them back from the device."""
    if forward_batch.req_pool_indices_cpu is None:
        forward_batch.req_pool_indices_cpu = getattr(batch, "req_pool_indices_cpu", None)


def release_after_forward(result: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER `ModelRunner._forward_raw`: the whole forward has been issued, so the rows its
    evictions read and the prefixes it read can go back (`SparseState.finish_forward`)."""
    context.state().finish_forward()


def _wrapping_factory(stock: Callable[[Any], AttentionBackend]) -> Callable[[Any], AttentionBackend]:
    def factory(runner: Any) -> AttentionBackend:
        inner = stock(runner)
        return KVSparseBackend(inner, context.state())

    setattr(factory, _MARK, True)
    return factory


def install() -> None:
    """Replace the stock factories of `WRAPPED_BACKENDS` with wrapping ones (idempotent)."""
    for name in WRAPPED_BACKENDS:
        stock = attention_registry.ATTENTION_BACKENDS.get(name)
        if stock is None:  # not registered in this SGLang build
            continue
        if not getattr(stock, _MARK, False):
            attention_registry.register_attention_backend(name)(_wrapping_factory(stock))


def installed() -> bool:
    """True when every wrapped name resolves to a wrapping factory in this process."""
    registered = [attention_registry.ATTENTION_BACKENDS.get(n) for n in WRAPPED_BACKENDS]
    return all(getattr(factory, _MARK, False) for factory in registered if factory is not None)


__all__ = [
    "KVSparseBackend",
    "WRAPPED_BACKENDS",
    "graph_execute",
    "install",
    "installed",
    "release_after_forward",
    "with_host_indices",
]
