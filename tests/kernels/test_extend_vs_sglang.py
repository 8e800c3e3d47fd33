"""Our extend attention against SGLang 0.5.23's own Triton ``extend_attention_fwd``.

SGLang's kernel takes the new tokens' K/V as separate ``k_extend``/``v_extend`` tensors and reads
only the cached prefix through ``kv_indptr``/``kv_indices``; ours reads everything through the pool.
Both run the same inputs split accordingly, under the interpreter on the CPU. Bounds (normwise
relative): output fp32 1e-5, fp16 5e-3; LSE 1e-5.
"""

import pytest
import torch

from sglang_kvsparse.kernels import extend_attention_with_stats
from sglang_kvsparse.kernels.testing import indptr_from_lens, make_ragged_batch, rel_error

extend_mod = pytest.importorskip(
    "sglang.kernels.ops.attention.extend_attention", reason="SGLang 0.5.23 is not importable"
)
pytestmark = [
    # SGLang's kernel takes log(0) on padding rows it never stores; the interpreter warns about it.
    pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"),
]

Q_LENS = [37, 150, 5, 83]
KV_LENS = [37, 290, 133, 83]


def sglang_extend(batch):
    """Split the batch into SGLang's (prefix through indices, new tokens as tensors) form."""
    prefix_idx, new_idx = [], []
    for b, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        slots = batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]
        prefix_idx.append(slots[: kv_len - q_len])
        new_idx.append(slots[kv_len - q_len :])
    new_slots = torch.cat(new_idx)
    o = torch.full_like(batch.q, float("nan"))
    lse = torch.full(batch.q.shape[:2], float("nan"), device=batch.q.device)
    extend_mod.extend_attention_fwd(
        batch.q,
        batch.k_buf[new_slots],
        batch.v_buf[new_slots],
        o,
        batch.k_buf,
        batch.v_buf,
        batch.qo_indptr,
        indptr_from_lens([k - q for q, k in zip(batch.q_lens, batch.kv_lens)], batch.q.device),
        torch.cat(prefix_idx),
        None,
        True,
        None,
        max(batch.q_lens),
        1.0,
        1.0,
        sm_scale=batch.sm_scale,
        lse_extend=lse,
    )
    return o, lse


@pytest.mark.parametrize("dtype, out_rel", [(torch.float32, 1e-5), (torch.float16, 5e-3)])
@pytest.mark.parametrize("group", [1, 4])
def test_extend_agrees_with_sglang(group, dtype, out_rel, device):
    batch = make_ragged_batch(Q_LENS, KV_LENS, 2, group, 64, dtype, device, seed=21)
    o_ref, lse_ref = sglang_extend(batch)
    o, lse = extend_attention_with_stats(
        batch.q,
        batch.k_buf,
        batch.v_buf,
        batch.qo_indptr,
        batch.kv_indptr,
        batch.kv_indices,
        batch.sm_scale,
        out=torch.full_like(batch.q, float("nan")),
        backend="triton",
    )
    assert rel_error(o, o_ref) <= out_rel
    assert rel_error(lse, lse_ref) <= 1e-5
