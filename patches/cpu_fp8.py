"""An FP8 KV cache on the CPU engine: SGLang's plain FP8 pool, read by `torch_native` (SGLang 0.5.23).

Stock SGLang on a CPU refuses `--kv-cache-dtype fp8_e5m2` ("not supported on CPU") and serves
`fp8_e4m3` only through its Intel AMX backend and a CPU build of sgl-kernel (per-token scales,
`cpu_fp8_e4m3`). Without AMX, this shim lets both formats take the path every GPU backend
starts from: SGLang's MHA pool stores each K/V as the FP8 value (uint8 storage, an FP8 view on
read), and `torch_native` dequantizes what it reads (`.to(query dtype)`), so attention runs over
exactly the quantized-then-dequantized K/V. That is the reference the sparse layers' FP8 path is
compared with on this machine (`tests/integration/test_cpu_fp8.py` checks it against plain torch
attention over quantized-then-dequantized K/V); on a GPU, stock SGLang's own FP8 is.

How: the two SGLang modules that refuse (`mem_cache.kv_cache_dtype`, which raises for e5m2, and
`mem_cache.kv_cache_configurator`, which asks for AMX and builds the CPU quant method for e4m3)
ask the platform `is_cpu()` only for those FP8 checks; each gets a view of the platform that
answers False there and delegates everything else. Applied by `sglang_kvsparse.server.cpu_shims`
when either module is imported, with the CPU engine requested and no AMX on the machine: for
stock and sparse servers alike, as the other CPU shims. Checkpoint scales (`k_scale`) are not
applied by `torch_native`; the CPU test bed's models have none.
"""

from __future__ import annotations

import types
from typing import Any

PATCHED = "__kvsparse_cpu_fp8__"
#: The modules whose `current_platform.is_cpu()` checks guard FP8 only.
MODULES = ("sglang.srt.mem_cache.kv_cache_dtype", "sglang.srt.mem_cache.kv_cache_configurator")


class _NotCpuForFp8:
    """The platform, but `is_cpu()` False: the FP8 checks of `MODULES` take the GPU path."""

    def __init__(self, platform: Any) -> None:
        self._platform = platform

    def is_cpu(self) -> bool:
        return False

    def __getattr__(self, name: str) -> Any:
        return getattr(self._platform, name)


def plain_fp8_pool(module: types.ModuleType) -> None:
    """Give `module` (one of `MODULES`) the platform view, unless the machine has AMX (where
    stock's own CPU FP8 path serves) or it is done already."""
    from sglang.srt.utils import cpu_has_amx_support

    platform = module.current_platform
    if getattr(module, PATCHED, False) or cpu_has_amx_support():
        return
    module.current_platform = _NotCpuForFp8(platform)
    setattr(module, PATCHED, True)
