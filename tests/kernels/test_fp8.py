"""Every kernel on FP8 K/V buffers (both formats SGLang names), against its torch reference and
against plain float64 attention over the dequantized values: scales other than 1, values from the
subnormals to near each format's largest, ragged rows that are not powers of two long.

The kernels read FP8 and dequantize in registers (keys times `k_scale`, values times `v_scale`);
writes quantize (divide by the scale in float32, round to nearest even, as SGLang's pool writes);
an eviction moves FP8 bytes as they are.
"""

from __future__ import annotations

import pytest
import torch

from sglang_kvsparse.kernels import (
    decode_attention_with_scores,
    evict_rows,
    extend_attention_with_stats,
    minus_key_norm,
    window_scores,
    write_entries,
)
from sglang_kvsparse.kernels.common import FP8_DTYPES, quantize
from sglang_kvsparse.kernels.testing import as_table, decode_queries, kv_lens_of, make_ragged_batch, rel_error

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
#: Output tolerance by the query's dtype (probabilities are rounded to it before P@V).
OUT_REL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}
KV_LENS = [37, 100, 1, 261]
Q_LENS = [5, 100, 1, 19]


def fp8_buffers(shape: tuple[int, ...], fmt: torch.dtype, scale: float, seed: int) -> torch.Tensor:
    """A buffer whose stored values (before the scale) reach from the format's subnormals to 0.9
    of its largest finite value, of both signs."""
    gen = torch.Generator().manual_seed(seed)
    largest = torch.finfo(fmt).max
    magnitude = 10 ** (torch.rand(shape, generator=gen) * 7 - 7)  # 1e-7 .. 1 of 0.9 x largest
    sign = torch.where(torch.rand(shape, generator=gen) < 0.5, -1.0, 1.0)
    return quantize(sign * magnitude * 0.9 * largest * scale, fmt, scale)


def dense_attention(q, k, v, qo, kv, sm_scale, group):
    """float64 causal attention per request over dequantized keys and values; ([T, H_q, D], lse)."""
    outs, lses = [], []
    for b in range(len(qo) - 1):
        qb = q[qo[b] : qo[b + 1]].double().unflatten(1, (k.shape[1], group))  # [T, H, G, D]
        kb, vb = k[kv[b] : kv[b + 1]], v[kv[b] : kv[b + 1]]  # [L, H, D]
        logits = torch.einsum("thgd,lhd->thgl", qb, kb) * sm_scale
        t, length = qb.shape[0], kb.shape[0]
        pos = length - t + torch.arange(t)
        logits = logits.masked_fill((torch.arange(length)[None, :] > pos[:, None])[:, None, None, :], float("-inf"))
        lses.append(torch.logsumexp(logits, -1).flatten(1))
        outs.append(torch.einsum("thgl,lhd->thgd", torch.softmax(logits, -1), vb).flatten(1, 2))
    return torch.cat(outs), torch.cat(lses)


def batch_of(fmt, scale, q_dtype, group=4, head_dim=64, q_lens=None, seed=0):
    batch = make_ragged_batch(q_lens or [0] * len(KV_LENS), KV_LENS, 2, group, head_dim, q_dtype, "cpu", seed=seed)
    k = fp8_buffers(batch.k_buf.shape, fmt, scale[0], seed + 1)
    v = fp8_buffers(batch.v_buf.shape, fmt, scale[1], seed + 2)
    return batch, k, v


SCALES = [(1.0, 1.0), (0.37, 2.5)]


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("scales", SCALES, ids=["scale 1", "scales 0.37, 2.5"])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
def test_decode_reads_fp8_and_dequantizes_with_the_scales(fmt, scales, q_dtype):
    batch, k, v = batch_of(fmt, scales, q_dtype)
    q = decode_queries(batch) * 0.01  # logits within a few units: the softmax is not one-hot
    table, lens = as_table(batch), kv_lens_of(batch)
    results = []
    for backend in ("triton", "torch"):
        scores = torch.zeros(k.shape[0], k.shape[1])
        o = decode_attention_with_scores(
            q, k, v, lens, table, scores, batch.sm_scale, backend=backend, k_scale=scales[0], v_scale=scales[1]
        )
        results.append((o, scores))
    (o, scores), (o_ref, scores_ref) = results
    assert rel_error(o, o_ref) <= OUT_REL[q_dtype] and rel_error(scores, scores_ref) <= 1e-4
    # the reference against float64 attention over the dequantized K/V
    kd, vd = k.double() * scales[0], v.double() * scales[1]
    starts = batch.kv_indptr.tolist()
    for b, n in enumerate(batch.kv_lens):
        slots = batch.kv_indices[starts[b] : starts[b] + n]
        qb = q[b].double().unflatten(0, (2, 4))
        probs = torch.softmax(torch.einsum("hgd,lhd->hgl", qb, kd[slots]) * batch.sm_scale, -1)
        want = torch.einsum("hgl,lhd->hgd", probs, vd[slots]).flatten(0, 1)
        assert rel_error(o_ref[b], want) <= OUT_REL[q_dtype]
        assert torch.allclose(scores_ref[slots].double(), probs.sum(1).T, atol=1e-5)


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("scales", SCALES, ids=["scale 1", "scales 0.37, 2.5"])
def test_prefill_and_window_scores_read_fp8(fmt, scales):
    batch, k, v = batch_of(fmt, scales, torch.float32, q_lens=Q_LENS, seed=3)
    q = batch.q * 0.01
    outs = {}
    for backend in ("triton", "torch"):
        o, lse = extend_attention_with_stats(
            q,
            k,
            v,
            batch.qo_indptr,
            batch.kv_indptr,
            batch.kv_indices,
            batch.sm_scale,
            backend=backend,
            k_scale=scales[0],
            v_scale=scales[1],
        )
        s = window_scores(
            q,
            k,
            lse,
            batch.qo_indptr,
            batch.kv_indptr,
            batch.kv_indices,
            8,
            batch.sm_scale,
            backend=backend,
            k_scale=scales[0],
        )
        outs[backend] = (o, lse, s)
    # scores are exp(logit - lse) with each backend's own lse: its float32 rounding grows with the
    # logits' size (e5m2's large values), hence the decode test's looser bound on scores
    for mine, theirs, bound in zip(outs["triton"], outs["torch"], (1e-5, 1e-5, 1e-4)):
        assert rel_error(mine, theirs) <= bound
    idx = batch.kv_indices
    want_o, want_lse = dense_attention(
        q,
        k[idx].double() * scales[0],
        v[idx].double() * scales[1],
        batch.qo_indptr.tolist(),
        batch.kv_indptr.tolist(),
        batch.sm_scale,
        4,
    )
    assert rel_error(outs["torch"][0], want_o) <= 1e-4 and rel_error(outs["torch"][1], want_lse) <= 1e-5


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=FORMATS.keys())
@pytest.mark.parametrize("scales", SCALES, ids=["scale 1", "scales 0.37, 2.5"])
@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
def test_writes_quantize_as_the_pool_does_and_evictions_move_fp8_bytes(fmt, scales, src_dtype):
    largest = torch.finfo(fmt).max
    gen = torch.Generator().manual_seed(4)
    slots = torch.randperm(40, generator=gen)[:13]
    new = [
        (torch.rand(13, 2, 64, generator=gen) * 2 - 1) * 0.9 * largest * scale * 10 ** -torch.randint(0, 6, (13, 2, 1))
        for scale in scales
    ]
    new = [x.to(src_dtype) for x in new]
    bufs = {}
    for backend in ("triton", "torch"):
        k_buf, v_buf = torch.zeros(40, 2, 64, dtype=fmt), torch.zeros(40, 2, 64, dtype=fmt)
        score_buf = torch.zeros(40, 2)
        write_entries(
            k_buf,
            v_buf,
            score_buf,
            slots,
            slots,
            *new,
            slots,
            first_score="minus_key_norm",
            backend=backend,
            k_scale=scales[0],
            v_scale=scales[1],
        )
        bufs[backend] = (k_buf, v_buf)
        # A key's first score is the real key's, not the stored one's.
        torch.testing.assert_close(score_buf[slots], minus_key_norm(new[0]), rtol=1e-5, atol=0)
    for mine, theirs in zip(bufs["triton"], bufs["torch"]):
        assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8))  # bit for bit
    k_buf, v_buf = bufs["torch"]
    assert torch.equal(k_buf[slots].view(torch.uint8), quantize(new[0], fmt, scales[0]).view(torch.uint8))
    dequant = k_buf[slots].float() * scales[0]
    assert torch.allclose(dequant, new[0].float(), rtol=0.13, atol=torch.finfo(fmt).smallest_normal * scales[0])

    # An eviction keeps FP8 entries exactly: 2 rows of 12 entries down to 8.
    table = torch.arange(24).view(1, 2, 12)
    ranked = torch.rand(2, 12, 2, generator=gen)
    moved = {}
    for backend in ("triton", "torch"):
        k, v, s = k_buf.clone(), v_buf.clone(), torch.rand(40, 2, generator=torch.Generator().manual_seed(5))
        evict_rows(k, v, s, ranked, table, table, 8, 1, 2, backend=backend)
        moved[backend] = (k.view(torch.uint8), v.view(torch.uint8), s)
    for mine, theirs in zip(moved["triton"], moved["torch"]):
        assert torch.equal(mine, theirs)


def test_quantize_divides_in_float32_and_rounds_to_nearest_even():
    x = torch.tensor([1.0, 0.3, -17.0, 1e-3], dtype=torch.bfloat16)
    for fmt in FP8_DTYPES:
        assert torch.equal(quantize(x, fmt).view(torch.uint8), x.to(fmt).view(torch.uint8))
        assert torch.equal(quantize(x, fmt, 0.5).view(torch.uint8), (x.float() / 0.5).to(fmt).view(torch.uint8))
