"""Triton decode attention with score accumulation against its torch reference (interpreter on CPU).

Relative error bounds (normwise): output fp32 1e-5, fp16 5e-3 (probabilities rounded to fp16
before P@V); score buffer 1e-5 in fp32 and 1e-4 in fp16 (fp32 logits of the same inputs). The
output is NaN-poisoned; the score buffer starts random and is compared whole, so slots outside the
batch must stay untouched. The rows of `kv_indices` are padded with random slots past each length
(`as_table`), so reading past a length fails.
"""

import dataclasses

import pytest
import torch

from sglang_kvsparse.kernels import SCORE_UPDATES, DecodeConfig, decode_attention, decode_attention_with_scores
from sglang_kvsparse.kernels.decode_attention import decode_splits
from sglang_kvsparse.kernels.testing import as_table, decode_queries, kv_lens_of, make_ragged_batch, rel_error

OUT_REL = {torch.float32: 1e-5, torch.float16: 5e-3}
SCORE_REL = {torch.float32: 1e-5, torch.float16: 1e-4}
KV_LENS = [1, 290, 77, 130]


def run_both(batch, q, num_kv_splits, config=None, window=0, score_update="add", backends=("triton", "torch")):
    init = torch.rand(batch.k_buf.shape[:2], generator=torch.Generator().manual_seed(9)).to(q.device)
    results = []
    for backend in backends:
        score_buf = init.clone()
        o = decode_attention_with_scores(
            q,
            batch.k_buf,
            batch.v_buf,
            kv_lens_of(batch),
            as_table(batch),
            score_buf,
            batch.sm_scale,
            num_kv_splits=num_kv_splits,
            out=torch.full_like(q, float("nan")),
            config=config,
            backend=backend,
            window=window,
            score_update=score_update,
        )
        results.append((o, score_buf))
    return results


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_decode_matches_reference(group, head_dim, dtype, device):
    batch = make_ragged_batch([0] * len(KV_LENS), KV_LENS, 2, group, head_dim, dtype, device, seed=group)
    q = decode_queries(batch)
    (o, scores), (o_ref, scores_ref) = run_both(batch, q, num_kv_splits=2)
    assert o.dtype == dtype
    assert rel_error(o, o_ref) <= OUT_REL[dtype]
    assert rel_error(scores, scores_ref) <= SCORE_REL[dtype]


@pytest.mark.parametrize("num_kv_splits", [1, 3, 8])
def test_decode_splits(num_kv_splits, device):
    """More splits than key blocks leaves empty splits, which the merge must ignore."""
    batch = make_ragged_batch([0] * len(KV_LENS), KV_LENS, 1, 4, 64, torch.float32, device, seed=3)
    batch = dataclasses.replace(batch, kv_indices=batch.kv_indices.int())  # int32 indices work too
    q = decode_queries(batch)
    (o, scores), (o_ref, scores_ref) = run_both(batch, q, num_kv_splits, DecodeConfig(block_n=32))
    assert rel_error(o, o_ref) <= OUT_REL[torch.float32]
    assert rel_error(scores, scores_ref) <= SCORE_REL[torch.float32]


def test_decode_bf16_and_empty_request(device):
    """bf16 inputs (upcast in the interpreter), and a request with no keys gets a zero output."""
    batch = make_ragged_batch([0, 0, 0], [40, 0, 70], 2, 3, 64, torch.bfloat16, device, seed=8)
    q = decode_queries(batch)
    (o, scores), (o_ref, scores_ref) = run_both(batch, q, num_kv_splits=2)
    assert rel_error(o, o_ref) <= 2e-2
    assert rel_error(scores, scores_ref) <= 1e-4
    assert torch.count_nonzero(o[1]) == 0


def test_decode_scores_add_one_per_query_head(device):
    """Probabilities of each query head sum to 1: the batch's score mass grows by B * H_q."""
    batch = make_ragged_batch([0] * len(KV_LENS), KV_LENS, 2, 3, 64, torch.float32, device, seed=6)
    q = decode_queries(batch)
    score_buf = torch.zeros(batch.k_buf.shape[:2], device=device)
    decode_attention_with_scores(
        q,
        batch.k_buf,
        batch.v_buf,
        kv_lens_of(batch),
        as_table(batch),
        score_buf,
        batch.sm_scale,
        num_kv_splits=3,
        backend="triton",
    )
    assert abs(score_buf.sum().item() - len(KV_LENS) * 6) < 1e-4


def test_decode_scores_go_to_their_own_slots(device):
    """With `score_indices` the scores land in a slot space of their own (the heap's score rows):
    the same sums as without, moved to the given slots, and nothing else touched."""
    batch = make_ragged_batch([0] * len(KV_LENS), KV_LENS, 2, 3, 64, torch.float32, device, seed=4)
    q = decode_queries(batch)
    total = batch.kv_indices.numel()
    perm = torch.randperm(3 * total, generator=torch.Generator().manual_seed(2))[:total].to(device)
    plain = torch.zeros(batch.k_buf.shape[:2], device=device)
    lens, table = kv_lens_of(batch), as_table(batch)
    decode_attention_with_scores(q, batch.k_buf, batch.v_buf, lens, table, plain, batch.sm_scale, backend="torch")
    for backend in ("triton", "torch"):
        moved = torch.zeros(3 * total, 2, device=device)
        decode_attention_with_scores(
            q,
            batch.k_buf,
            batch.v_buf,
            lens,
            table,
            moved,
            batch.sm_scale,
            score_indices=as_table(batch, perm),
            backend=backend,
        )
        assert rel_error(moved[perm], plain[batch.kv_indices.long()]) <= SCORE_REL[torch.float32], backend
        untouched = torch.ones(3 * total, dtype=torch.bool, device=device)
        untouched[perm] = False
        assert torch.count_nonzero(moved[untouched]) == 0


@pytest.mark.parametrize("score_update", ["replace", "none"])
def test_decode_score_updates_other_than_add(score_update, device):
    """ "replace" leaves each key's score at this step's probability mass (what "add" adds to a
    zeroed buffer), "none" leaves the buffer as it was; slots outside the batch stay untouched
    either way, and the output is the same as with "add"."""
    batch = make_ragged_batch([0] * len(KV_LENS), KV_LENS, 2, 3, 64, torch.float32, device, seed=11)
    q = decode_queries(batch)
    lens, table = kv_lens_of(batch), as_table(batch)
    init = torch.rand(batch.k_buf.shape[:2], generator=torch.Generator().manual_seed(3)).to(device)
    mass = torch.zeros_like(init)
    o_add = decode_attention_with_scores(
        q, batch.k_buf, batch.v_buf, lens, table, mass, batch.sm_scale, backend="torch"
    )
    expected = init.clone()
    if score_update == "replace":
        keys = batch.kv_indices.long()
        expected[keys] = mass[keys]
    for backend, o, score_buf in _launch_both(batch, q, init, score_update=score_update):
        assert rel_error(score_buf, expected) <= SCORE_REL[torch.float32], backend
        assert rel_error(o, o_add) <= OUT_REL[torch.float32], backend


def _launch_both(batch, q, init, **rule):
    """Each backend's (name, output, scores) of one launch over `init`'s scores, in 3 splits,
    with this score rule (`score_update` or `row_updates`)."""
    lens, table = kv_lens_of(batch), as_table(batch)
    for backend in ("triton", "torch"):
        score_buf = init.clone()
        o = decode_attention_with_scores(
            q,
            batch.k_buf,
            batch.v_buf,
            lens,
            table,
            score_buf,
            batch.sm_scale,
            num_kv_splits=3,
            backend=backend,
            **rule,
        )
        yield backend, o, score_buf


def test_each_request_updates_its_scores_by_its_own_rule(device):
    """`row_updates` (a strided column, as a plan's `row_kinds[:, 0]`): each request's scores
    end as a launch with its own `score_update` leaves them, in one launch, and the outputs are
    unchanged."""
    batch = make_ragged_batch([0] * len(KV_LENS), KV_LENS, 2, 3, 64, torch.float32, device, seed=5)
    q = decode_queries(batch)
    lens, table = kv_lens_of(batch), as_table(batch)
    init = torch.rand(batch.k_buf.shape[:2], generator=torch.Generator().manual_seed(8)).to(device)
    rules = [i % len(SCORE_UPDATES) for i in range(len(KV_LENS))]
    expected, o_want = init.clone(), None
    for update in SCORE_UPDATES:  # each request's keys are its own: one launch per rule composes
        scratch = init.clone()
        o_want = decode_attention_with_scores(
            q, batch.k_buf, batch.v_buf, lens, table, scratch, batch.sm_scale, score_update=update, backend="torch"
        )
        for request, rule in enumerate(rules):
            if SCORE_UPDATES[rule] == update:
                keys = batch.kv_indices[int(batch.kv_indptr[request]) : int(batch.kv_indptr[request + 1])].long()
                expected[keys] = scratch[keys]
    column = torch.tensor([[r, 0] for r in rules], dtype=torch.int32, device=device)[:, 0]
    for backend, o, score_buf in _launch_both(batch, q, init, row_updates=column):
        assert rel_error(score_buf, expected) <= SCORE_REL[torch.float32], backend
        assert rel_error(o, o_want) <= OUT_REL[torch.float32], backend
    with pytest.raises(ValueError, match="row_updates must be"):
        decode_attention_with_scores(
            q, batch.k_buf, batch.v_buf, lens, table, init.clone(), batch.sm_scale, row_updates=column[:1]
        )


def test_decode_rejects_mismatched_shapes():
    batch = make_ragged_batch([0, 0], [3, 5], 1, 2, 16, torch.float32, "cpu")
    q = decode_queries(batch)
    score_buf = torch.zeros(batch.k_buf.shape[:2])
    args = (q, batch.k_buf, batch.v_buf)
    with pytest.raises(ValueError, match="kv_indices"):
        decode_attention_with_scores(*args, kv_lens_of(batch), batch.kv_indices, score_buf, 0.1)
    with pytest.raises(ValueError, match="score_indices"):
        table = as_table(batch)
        decode_attention_with_scores(*args, kv_lens_of(batch), table, score_buf, 0.1, score_indices=table[:, :2])
    with pytest.raises(ValueError, match="score_update must be one of add, replace, none; got 'max'"):
        decode_attention_with_scores(*args, kv_lens_of(batch), as_table(batch), score_buf, 0.1, score_update="max")


@pytest.mark.parametrize(
    ("batch", "kv_heads", "width", "processors", "splits"),
    [
        (1, 8, 1104, 132, 8),  # one request at the default budget's width: cut to chunks of >= 128 keys
        (1, 8, 32768, 132, 16),  # a long full row: at most MAX_SPLITS
        (16, 8, 1104, 132, 4),  # 16 x 8 programs, 528 wanted
        (64, 8, 1104, 132, 2),  # 512 programs: just short of 4 per SM
        (128, 8, 1104, 132, 1),  # already 4 programs per SM
        (3, 2, 64, 1, 1),  # the interpreter: one processor
    ],
)
def test_decode_splits_fill_the_device_from_the_batch_and_the_tables_width(batch, kv_heads, width, processors, splits):
    assert decode_splits(batch, kv_heads, width, processors) == splits


def test_the_default_splits_match_the_reference(device):
    """No `num_kv_splits`: the kernel picks them (`decode_splits`) and agrees with the reference."""
    batch = make_ragged_batch(
        [0, 0], [150, 61], num_kv_heads=2, group=4, head_dim=64, dtype=torch.float32, device=device
    )
    q = decode_queries(batch)
    (o, scores), (o_ref, scores_ref) = run_both(batch, q, num_kv_splits=None)
    assert rel_error(o, o_ref) < 1e-4 and rel_error(scores, scores_ref) < 1e-4


@pytest.mark.parametrize("score_update", ["add", "replace"])
@pytest.mark.parametrize(("window", "splits"), [(1, 1), (33, 3), (100, 2), (1000, 4)])
def test_decode_sliding_window_matches_reference(window, splits, score_update, device):
    """Each row attends to its last `window` entries only, split or not; the entries before the
    window keep their scores (the whole score buffer is compared)."""
    batch = make_ragged_batch([0] * len(KV_LENS), KV_LENS, 2, 4, 64, torch.float32, device, seed=window)
    q = decode_queries(batch)
    (o, scores), (o_ref, scores_ref) = run_both(batch, q, splits, DecodeConfig(block_n=32), window, score_update)
    assert rel_error(o, o_ref) < OUT_REL[torch.float32] and rel_error(scores, scores_ref) < SCORE_REL[torch.float32]


def test_reference_gathers_into_kept_buffers(monkeypatch):
    """On a CPU the torch reference gathers K and V above glibc's mmap threshold (32 MiB) into
    buffers kept between calls: it gives what fresh tensors give, also after a larger batch's call
    and one of another dtype, and an output it returned is not changed by later calls."""

    def run(batch):
        return run_both(batch, decode_queries(batch), None, backends=("torch",))[0]

    def ragged(lengths, dtype, seed):  # 4 KV heads of 128: 2 KiB a float32 row
        return make_ragged_batch([0] * len(lengths), lengths, 4, 1, 128, dtype, "cpu", seed=seed)

    kept_size = ragged([9_000, 9_001], torch.float32, 11)  # 36 MiB a gather
    assert as_table(kept_size).numel() * 2048 > 32 << 20
    with monkeypatch.context() as patched:
        patched.setattr(decode_attention, "_MMAP_THRESHOLD", 1 << 40)  # every gather a fresh tensor
        kept = run(kept_size)
    first = run(kept_size)
    for other in (ragged([12_000, 40, 7_000], torch.float32, 12), ragged([20_000, 5], torch.float16, 13)):
        run(other)
        again = run(kept_size)
        for got, want, returned in zip(again, kept, first):
            assert torch.equal(got, want)
            assert torch.equal(returned, want)
