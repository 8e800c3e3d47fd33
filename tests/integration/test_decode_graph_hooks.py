"""The wrapper backend's CUDA-graph hooks, driven as SGLang 0.5.23's decode graph runner drives them
(`model_executor/runner/decode_cuda_graph_runner.py`): `init_cuda_graph_state` once; per captured
batch size `init_forward_metadata_out_graph(in_capture=True)` and the layers' capture; per replay
the batch padded to a captured size, its real rows handed over (`graph_execute`), the planning out
of the graph (`init_forward_metadata_out_graph`), then the recorded work again.

With no GPU nothing can be captured, so "capture" records what the sparse layers dispatch (each
op, its shapes, and which tensors that existed before it ran it reads or writes), and every
"replay" runs the layers again on the same fixed inputs: it must dispatch the same sequence on the
same tensors, which is what a real replay re-runs, and its outputs must equal the eager decode of
a twin state, step for step, while requests of different scoring policies join, evict and finish;
every heap row comes back.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from tests.unit.heap import H_KV, OWN_POLICY_SETTINGS, D, grow, make_state, prefill_alone

pytestmark = pytest.mark.integration

from sglang.srt.layers.attention.base_attn_backend import AttentionBackend  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402

from sglang_kvsparse.patches.attention import KVSparseBackend, graph_execute  # noqa: E402

G = 2  # query heads per KV head
CAPTURED = (2, 4, 8)  # batch sizes captured, as SGLang's --cuda-graph-bs


class StockBackend(AttentionBackend):
    """The full layers' backend: records the graph calls the wrapper forwards to it."""

    def __init__(self) -> None:
        self.req_to_token_pool = self.token_to_kv_pool = None
        self.calls: list[tuple] = []

    def init_forward_metadata(self, forward_batch) -> None:
        self.calls.append(("eager", forward_batch.batch_size))

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.calls.append(("state", max_bs))

    def init_forward_metadata_out_graph(self, forward_batch, in_capture: bool = False) -> None:
        self.calls.append(("out_graph", forward_batch.batch_size, in_capture))

    def init_forward_metadata_in_graph(self, forward_batch) -> None:
        self.calls.append(("in_graph", forward_batch.batch_size))

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1


class Recorder(TorchDispatchMode):
    """Each op the block dispatches: its name, its tensors' shapes, and for the tensors that
    existed before (`known` storages) which one, by position in `known`."""

    def __init__(self, known: list[torch.Tensor]) -> None:
        super().__init__()
        self.known = {t.untyped_storage().data_ptr(): i for i, t in enumerate(known)}
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [x for x in tree_flatten((args, kwargs or {}))[0] if isinstance(x, torch.Tensor)]
        shapes = tuple(tuple(t.shape) for t in tensors)
        reads = tuple(self.known.get(t.untyped_storage().data_ptr()) for t in tensors)
        self.ops.append((str(func), shapes, reads))
        return func(*args, **(kwargs or {}))


def layers_of(state) -> list[SimpleNamespace]:
    return [
        SimpleNamespace(
            layer_id=layer, tp_q_head_num=H_KV * G, qk_head_dim=D, scaling=0.3, k_scale_float=None, v_scale_float=None
        )
        for layer in sorted(state.layout.layer_places)
    ]


def twin_states():
    return [
        make_state(
            num_layers=5, full_layers=(0, 1), budget=8, window=2, evict_page=4, rows=4096, max_requests=10, context=4096
        )
        for _ in range(2)
    ]


def decode(backend, forward_batch, q, k, v) -> torch.Tensor:
    """Every sparse layer's decode through the wrapper, outputs stacked [layers, B, H_q * D]."""
    return torch.stack([backend.forward_decode(q, k, v, layer, forward_batch) for layer in layers_of(backend.state)])


def test_replays_dispatch_what_was_captured_and_match_eager_decoding_with_evictions():
    (eager_state, eager_heap), (graph_state, graph_heap) = twin_states()
    eager = KVSparseBackend(StockBackend(), eager_state)
    graph = KVSparseBackend(StockBackend(), graph_state)
    free_before = graph_heap.free_rows()

    # Capture, as the runner does: buffers once, then each batch size on fixed inputs.
    graph.init_cuda_graph_state(max(CAPTURED), max(CAPTURED))
    buffers = graph.sparse.graph
    static = {bs: [torch.zeros(bs, h, D) for h in (H_KV * G, H_KV, H_KV)] for bs in CAPTURED}
    positions = {bs: torch.zeros(bs, dtype=torch.int64) for bs in CAPTURED}
    known = [lane.k for lane in graph_state.lanes] + [lane.v for lane in graph_state.lanes]
    known += [t for tables in buffers.tables for t in vars(tables).values()] + [buffers.row_kinds]
    known += [t for bs in CAPTURED for t in (*static[bs], positions[bs])]
    captured = {}
    for bs in CAPTURED:
        view = SimpleNamespace(batch_size=bs, num_padding=bs, forward_mode=ForwardMode.DECODE, out_cache_loc=None)
        graph.init_forward_metadata_out_graph(view, in_capture=True)
        with Recorder(known) as recorder:
            decode(graph, SimpleNamespace(positions=positions[bs]), *static[bs])
        captured[bs] = recorder.ops
    assert ("state", max(CAPTURED)) in graph.inner.calls
    assert [c for c in graph.inner.calls if c[0] == "out_graph"] == [("out_graph", bs, True) for bs in CAPTURED]

    gen = torch.Generator().manual_seed(11)
    lengths: dict[int, int] = {}
    final: dict[int, int] = {}
    steps = evicting = mixed = 0
    settings = OWN_POLICY_SETTINGS  # each joining request's, drawn
    for step in range(420):
        free_rows = [row for row in range(1, 9) if row not in lengths]
        if free_rows and len(lengths) < 7 and step % 5 == 0:  # a request joins, prefilled alone
            row = free_rows[0]
            prompt = int(torch.randint(3, 30, (1,), generator=gen))
            final[row] = prompt + int(torch.randint(10, 70, (1,), generator=gen))
            q, k, v = (torch.randn(prompt, h, D, generator=gen) for h in (H_KV * G, H_KV, H_KV))
            setting = settings[int(torch.randint(len(settings), (1,), generator=gen))]
            for state in (eager_state, graph_state):
                prefill_alone(state, row, final[row], q, k, v, setting)
            lengths[row] = prompt
            continue
        rows = sorted(lengths)
        if not rows:
            continue
        raw = len(rows)
        q, k, v = (torch.randn(raw, h, D, generator=gen) for h in (H_KV * G, H_KV, H_KV))
        where = torch.tensor([lengths[row] for row in rows])
        for state in (eager_state, graph_state):
            grow(state, rows, [lengths[row] + 1 for row in rows])
        batch = SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            batch_size=raw,
            req_pool_indices_cpu=torch.tensor(rows),
            positions=where,
            out_cache_loc=None,  # SGLang's slots and ids: what the sentence marks read (none here)
            input_ids=None,
        )

        eager.init_forward_metadata(batch)
        evicting += bool(eager.sparse.plan.evictions)
        mixed += eager.sparse.plan.row_kinds is not None
        want = decode(eager, batch, q, k, v)
        eager_state.finish_forward()

        bs = next(size for size in CAPTURED if size >= raw)  # the runner pads to a captured size
        runner = SimpleNamespace(attn_backend=graph)
        for buffer, given in zip((*static[bs], positions[bs]), (q, k, v, where)):
            buffer.zero_()
            buffer[:raw].copy_(given)

        def replay(runner, forward_batch, bs=bs, raw=raw):
            view = SimpleNamespace(
                batch_size=bs, num_padding=bs - raw, forward_mode=ForwardMode.DECODE, out_cache_loc=None, input_ids=None
            )
            graph.init_forward_metadata_out_graph(view)
            with Recorder(known) as recorder:
                out = decode(graph, SimpleNamespace(positions=positions[bs]), *static[bs])
            assert recorder.ops == captured[bs]  # the same ops on the same tensors: what a replay runs
            return out

        got = graph_execute(replay, runner, batch)
        graph_state.finish_forward()
        torch.testing.assert_close(got[:, :raw], want, atol=1e-5, rtol=1e-5)
        steps += 1
        for row in rows:
            lengths[row] += 1
            if lengths[row] == final[row]:
                for state in (eager_state, graph_state):
                    state.free(row)
                del lengths[row]
    assert steps > 300 and evicting > 40 and mixed > 100
    for row in list(lengths):
        graph_state.free(row)
    assert graph_heap.free_rows() == free_before
