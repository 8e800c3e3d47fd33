"""The CPU's FP8 reference (`patches/cpu_fp8.py`): with the CPU engine, SGLang 0.5.23 resolves both
FP8 formats to a plain FP8 KV cache (where it refuses without the shim), and its `torch_native`
attention over such a cache is plain attention over the quantized-then-dequantized K/V.

Each check runs in a fresh interpreter with `SGLANG_USE_CPU_ENGINE=1`, as a server's processes
start (the shim acts when SGLang's KV-cache modules are imported)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration

CHECK = """
import torch
from types import SimpleNamespace
from sglang.srt.platforms import current_platform
from sglang.srt.mem_cache import kv_cache_dtype
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

assert current_platform.is_cpu()
for flag, want in (("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
    _, got = kv_cache_dtype.configure_kv_cache_dtype(
        server_args_kv_cache_dtype=flag, model=None, model_dtype=torch.float32, is_draft_worker=False,
        is_dflash=False, speculative_draft_attention_backend=None,
    )
    assert got == want, (flag, got)

    gen = torch.Generator().manual_seed(0)
    heads, kv_heads, dim, slots = 6, 2, 64, 50
    k_cache = (torch.randn(slots, kv_heads, dim, generator=gen) * 3).to(want)
    v_cache = (torch.randn(slots, kv_heads, dim, generator=gen) * 3).to(want)
    req_to_token = torch.randperm(slots, generator=gen)[:40].view(2, 20)
    seq_lens = torch.tensor([20, 13])
    query = torch.randn(2, heads, dim, generator=gen)
    out = TorchNativeAttnBackend._run_sdpa_forward_decode(
        SimpleNamespace(), query, torch.empty_like(query), k_cache, v_cache, req_to_token,
        torch.tensor([0, 1]), seq_lens, scaling=0.125, enable_gqa=True,
    )
    for b in range(2):
        keys = k_cache[req_to_token[b, : seq_lens[b]]].double()  # the FP8 values, dequantized
        values = v_cache[req_to_token[b, : seq_lens[b]]].double()
        q = query[b].double().view(kv_heads, heads // kv_heads, dim)
        probs = torch.softmax(torch.einsum("hgd,lhd->hgl", q, keys) * 0.125, -1)
        want_out = torch.einsum("hgl,lhd->hgd", probs, values).reshape(heads, dim)
        assert torch.allclose(out[b].double(), want_out, atol=1e-5), (flag, b)
print("ok")
"""


def test_the_cpu_fp8_reference_is_attention_over_quantized_kv():
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def test_without_the_cpu_engine_sglang_is_as_shipped():
    """The shim acts only with the CPU engine requested: elsewhere SGLang's modules are untouched."""
    code = (
        "from sglang.srt.mem_cache import kv_cache_dtype, kv_cache_configurator\n"
        "from sglang_kvsparse.patches.cpu_fp8 import PATCHED\n"
        "print([getattr(m, PATCHED, False) for m in (kv_cache_dtype, kv_cache_configurator)])\n"
    )
    env = {key: value for key, value in os.environ.items() if key != "SGLANG_USE_CPU_ENGINE"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.stdout.strip().endswith("[False, False]"), done.stderr[-2000:]
