"""The attention backend of a sparse server (SGLang 0.5.23 attention registry).

The stock backend names stay (SGLang keys scheduler helpers on them); `install` re-registers
every MHA/GQA backend (`sglang_kvsparse.backends.WRAPPED_BACKENDS`: SGLang's default on each
device among them) with a factory that wraps the stock backend in `KVSparseBackend`. Full
layers go to the stock backend unchanged; sparse layers read and write their own rows of the
heap's lanes (`SparseState.lanes`) through `sglang_kvsparse.sparse_attention`. The forward's plan
is built once per step in `init_forward_metadata` (`sglang_kvsparse.planning`) from host data
only (the request indices from SGLang's host copy, which `with_host_indices` keeps for decode batches
too), and a decode step's evictions run there, in every sparse layer at once (`prepare_decode`).
Once SGLang has issued the whole forward (`release_after_forward`, after `_forward_raw`), the state
releases what the step's evictions and prefix reads held: outside the layers, so a captured graph
has no host side effect. A mixed forward (`--enable-mixed-chunk`: a prefill with the running
requests' decode tokens appended) gets a prefill plan and a decode plan, split where the decoding
rows begin.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from sglang.srt.layers.attention import attention_registry
from sglang.srt.layers.attention.base_attn_backend import AttentionBackend

from sglang_kvsparse.backends import WRAPPED_BACKENDS
from sglang_kvsparse.decode_graph import DecodeBuffers
from sglang_kvsparse.guide import PrefillGuide
from sglang_kvsparse.planning import plan_extend
from sglang_kvsparse.plans import ForwardPlan, MixedPlan
from sglang_kvsparse.requests import Phase
from sglang_kvsparse.sparse_attention import prepare_decode, sparse_decode, sparse_extend, sparse_mixed
from sglang_kvsparse.sparse_state import SparseState

from . import context

_MARK = "__kvsparse_wrapped__"


class KVSparseBackend(AttentionBackend):
    """Full layers: the inner stock backend. Sparse layers: the project's path."""

    def __init__(self, inner: AttentionBackend, state: SparseState) -> None:
        self.inner = inner
        self.state = state
        # Generic SGLang code reads the pools off whatever backend is current.
        self.req_to_token_pool = inner.req_to_token_pool
        self.token_to_kv_pool = inner.token_to_kv_pool
        self.data_type = inner.data_type
        self.kv_cache_dtype = inner.kv_cache_dtype
        self._plan: ForwardPlan | MixedPlan | None = None
        self._guide: PrefillGuide | None = None
        self._last_sparse_layer = max(state.layout.layer_places, default=-1)
        self._graph_buffers: DecodeBuffers | None = None
        #: The request indices of the decode step about to replay (`graph_execute`).
        self.replay_requests: list[int] | None = None

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
        self._guide = None
        if mode.is_idle():
            self._plan = None
            return
        marks = self.state.sentence_marks
        if marks is not None:
            marks.record(forward_batch.out_cache_loc, forward_batch.input_ids)
        req_indices = self._req_indices(forward_batch)
        device = self.state.lanes[0].k.device
        if mode.is_decode():
            self._plan = self._plan_decode(req_indices, device)
        elif mode.is_extend() and not mode.is_target_verify():
            # SGLang runs a mixed batch (prefills, then running requests' decode tokens) as an extend.
            decoding = self.state.requests.is_(Phase.DECODING, req_indices)
            prefilling = int((~decoding).sum())
            if bool(decoding[:prefilling].any()):
                raise NotImplementedError("kvsparse: a mixed batch whose decoding requests do not follow its prefills")
            extend = self._plan_extend(forward_batch, req_indices[:prefilling], device)
            if prefilling == len(req_indices):
                self._plan = extend
            else:
                tokens = sum(int(n) for n in forward_batch.extend_seq_lens_cpu[:prefilling])
                self._plan = MixedPlan(extend, self._plan_decode(req_indices[prefilling:], device), tokens)
            self._guide = self._prefill_guide(extend)
        else:
            raise NotImplementedError(f"kvsparse: forward mode {mode} is not supported with sparse layers")

    # -- SGLang's decode CUDA graphs ---------------------------------------------------------
    # The sparse layers of a captured step read `DecodeBuffers` (fixed shapes, filled in place);
    # everything variable (the plan from the host tables, the evictions, the release) runs outside
    # the graph: `init_forward_metadata_out_graph` before a replay, `release_after_forward` after.
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)
        self._graph_buffers = DecodeBuffers(self.state, max_bs, self.state.lanes[0].k.device)

    def get_cuda_graph_seq_len_fill_value(self) -> Any:
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Before capturing a decode step of `batch_size` requests: the plan over the buffers.
        Before replaying one: its real requests (`replay_requests`, the first `batch_size -
        num_padding`) planned from the host tables, their evictions run, the buffers filled."""
        self.inner.init_forward_metadata_out_graph(forward_batch, in_capture=in_capture)
        self._guide = None
        if not in_capture:
            req_indices, self.replay_requests = self.replay_requests, None
            if req_indices is None or len(req_indices) != forward_batch.batch_size - forward_batch.num_padding:
                raise RuntimeError("kvsparse: a decode graph replay without its requests' indices")
            marks = self.state.sentence_marks
            if marks is not None:
                marks.record(forward_batch.out_cache_loc, forward_batch.input_ids[: len(req_indices)])
            self._graph_buffers.fill(self._plan_decode(req_indices, self.state.lanes[0].k.device))
        self._plan = self._graph_buffers.plan(forward_batch.batch_size)

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        self.inner.init_forward_metadata_in_graph(forward_batch)

    def on_after_cuda_graph_warmup(self) -> None:
        self.inner.on_after_cuda_graph_warmup()

    def can_replay(self, forward_batch: Any) -> bool:
        """Whether a decode step of this batch can replay a captured graph: not when a request
        scores with a policy of its own (the graph scores with the server's); counted."""
        req_indices = self._req_indices(forward_batch)
        if any(self.state.requests.policy[req_idx] is not None for req_idx in req_indices):
            self.state.counters.eager_decode_steps += 1
            return False
        return True

    def _req_indices(self, forward_batch: Any) -> list[int]:
        """The batch's request indices, from SGLang's host copy. Without one (a path that gives a
        forward none) they are read from the device: counted, as it makes the host wait."""
        req_indices = forward_batch.req_pool_indices_cpu
        if req_indices is None:
            self.state.counters.host_syncs += 1
            req_indices = forward_batch.req_pool_indices
        return req_indices.tolist()

    def _plan_decode(self, req_indices: list[int], device: Any) -> ForwardPlan:
        """The decode plan of these requests, its evictions already run in every sparse layer."""
        return prepare_decode(self.state, req_indices, device)

    def _prefill_guide(self, plan: ForwardPlan) -> PrefillGuide | None:
        """A guide for this prefill when the configuration names guide layers and some sparse
        layer selects (a prompt is longer than its budget) for a request the guide chooses for
        (its budget there below `guide_below` of its prompt: `ColumnPlan.guided`)."""
        guide_layers = self.state.resolved.guide_layers
        columns = [column for group in plan.columns for column in group if column.compress]
        if guide_layers and any(bool(column.guided.any()) for column in columns):
            return PrefillGuide(guide_layers)
        return None

    def _plan_extend(self, forward_batch: Any, req_indices: list[int], device: Any) -> ForwardPlan:
        """The prefill plan of the batch's first len(req_indices) requests."""
        prefix_lens = [int(n) for n in forward_batch.extend_prefix_lens_cpu[: len(req_indices)]]
        extend_lens = [int(n) for n in forward_batch.extend_seq_lens_cpu[: len(req_indices)]]
        table = self.req_to_token_pool.req_to_token
        prefix_ids = [table[req_idx, :n] for req_idx, n in zip(req_indices, prefix_lens)]
        new_ids = forward_batch.out_cache_loc[: sum(extend_lens)]
        plan = plan_extend(self.state, req_indices, prefix_lens, extend_lens, prefix_ids, new_ids, device)
        marks = self.state.sentence_marks
        if marks is None:
            return plan
        ends = marks.ends_at(prefix_ids, new_ids, extend_lens)
        # Counted for the requests that keep entries (a chunk before its prompt's last only
        # stores them; the last one reads the whole prompt).
        marks.count(ends if plan.kept_positions is None else ends[plan.kept_positions])
        return dataclasses.replace(plan, sentence_ends=ends)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not self.state.layout.is_sparse(layer.layer_id):
            return self.inner.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        q3 = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        place = self.state.layout.layer_places[layer.layer_id]
        lane, policy = self.state.lanes[place.lane], self.state.policy
        if isinstance(self._plan, MixedPlan):
            plan, positions = self._plan, forward_batch.positions
            o = sparse_mixed(q3, k, v, layer.scaling, plan, place, lane, policy, positions, layer.layer_id, self._guide)
        else:
            column = self._plan.column(place)
            o = sparse_extend(q3, k, v, layer.scaling, self._plan, column, lane, policy, layer.layer_id, self._guide)
        self._after_sparse_layer(layer.layer_id)
        return o.reshape(q3.shape[0], -1)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache: bool = True, **kwargs):
        if not self.state.layout.is_sparse(layer.layer_id):
            return self.inner.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.qk_head_dim)
        place = self.state.layout.layer_places[layer.layer_id]
        lane, policy = self.state.lanes[place.lane], self.state.policy
        o = sparse_decode(
            q3, k, v, layer.scaling, self._plan, self._plan.column(place), lane, policy, forward_batch.positions
        )
        self._after_sparse_layer(layer.layer_id)
        return o.reshape(q3.shape[0], -1)

    def _after_sparse_layer(self, layer_id: int) -> None:
        if layer_id == self._last_sparse_layer and self._guide is not None:
            self._guide.finish()
            self._guide = None

    def support_triton(self) -> bool:
        return self.inner.support_triton()


def graph_can_run(original: Callable[..., bool], runner: Any, forward_batch: Any) -> bool:
    """AROUND `DecodeCudaGraphRunner.can_run_graph`: SGLang's answer, and the sparse layers'."""
    backend = runner.attn_backend
    ok = original(runner, forward_batch)
    return ok and (not isinstance(backend, KVSparseBackend) or backend.can_replay(forward_batch))


def graph_execute(original: Callable[..., Any], runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `DecodeCudaGraphRunner.execute`: the replay's planning (`init_forward_metadata_out_graph`,
    which SGLang calls with a padded view of the batch) learns the real batch's request indices."""
    backend = runner.attn_backend
    if isinstance(backend, KVSparseBackend):
        backend.replay_requests = backend._req_indices(forward_batch)
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
    "graph_can_run",
    "graph_execute",
    "install",
    "installed",
    "release_after_forward",
    "with_host_indices",
]
