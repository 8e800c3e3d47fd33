"""SGLang's server options that touch the KV pool, the radix tree, admission or the attention
backend, each served with sparse layers or refused in one line (no SGLang imports).

Why a table: SGLang 0.5.23 has ~500 options, and one that changes the KV pool underneath the
sparse layers (a host copy of the pool, another layout, a second model's cache) would either fail
far from its cause (HiCache sized its host pool from the heap and asked for 22 GB) or serve wrong
outputs quietly. So every such option is listed here: `SERVED` with the test that shows it, or
`REFUSED` with the reason the launcher prints before SGLang starts (`refusals`, from the command
line) and the scheduler gives at start-up (`patches/memory.check_guards`, from SGLang's resolved
arguments: the way in for `sglang.Engine` and `sglang.launch_server` with the plugin's variable).
docs/config.md shows the same table. Parallel settings (`parallelism.py`) and attention backends
(`backends.py`) have their own modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RefusedOption:
    """An option the sparse layers cannot serve: `flag` (SGLang's spelling; `takes_value` unless
    it is a switch) is in use when its value is set (not None, False or empty) and not one of
    `unused` (a value option's default), and `why` is the one-line reason."""

    flag: str
    why: str
    takes_value: bool = False
    unused: tuple[Any, ...] = ()

    @property
    def field(self) -> str:
        """SGLang's `ServerArgs` field name."""
        return self.flag[2:].replace("-", "_")

    def in_use(self, value: Any) -> bool:
        return bool(value) and value not in self.unused

    def line(self, value: Any) -> str:
        shown = f"{self.flag} {value}" if self.takes_value else self.flag
        return f"{shown}: {self.why}"


_LAYOUT = "changes the KV pool's layout, which the sparse columns share (one heap)"
_HOST_COPY = (
    "copies the KV pool's rows to host memory or storage page by page; the sparse columns' rows, "
    "their tables and the prefix store have no such copy"
)

REFUSED: tuple[RefusedOption, ...] = (
    RefusedOption("--enable-hierarchical-cache", _HOST_COPY + " (HiCache)"),
    RefusedOption("--hicache-storage-backend", _HOST_COPY + " (HiCache storage)", takes_value=True),
    RefusedOption("--enable-lmcache", _HOST_COPY + " (LMCache)"),
    RefusedOption("--enable-flexkv", _HOST_COPY + " (FlexKV)"),
    RefusedOption("--disaggregation-decode-enable-offload-kvcache", _HOST_COPY),
    RefusedOption(
        "--disaggregation-mode",
        "prefill/decode disaggregation sends the KV pool's rows to another server; the sparse columns "
        "and their tables are not sent",
        takes_value=True,
        unused=("null",),
    ),
    RefusedOption(
        "--speculative-algorithm",
        "speculative decoding verifies several tokens per step; the sparse decode step stores and scores one",
        takes_value=True,
    ),
    RefusedOption(
        "--kv-cache-dtype",
        "the sparse layers keep K/V in the model's dtype, bf16 or FP8 (fp8_e4m3, fp8_e5m2); block-scaled "
        "formats keep per-block scales their kernels do not read",
        takes_value=True,
        unused=("auto", "fp8_e4m3", "fp8_e5m2", "bf16", "bfloat16"),
    ),
    RefusedOption("--enable-kv-cache-sharding", _LAYOUT),
    RefusedOption("--enable-page-major-kv-layout", _LAYOUT),
    RefusedOption("--enable-unified-memory", _LAYOUT),
    RefusedOption("--enable-prefill-cp", "context-parallel prefill splits a prompt's K/V over ranks"),
    RefusedOption("--prefill-only-disable-kv-cache", "sparse layers keep their entries in the KV cache"),
    RefusedOption(
        "--enable-memory-saver",
        "releases and re-creates the KV pool's memory; the heap's lanes and tables are not released",
    ),
    RefusedOption(
        "--enable-streaming-session",
        "sessions keep a request's rows across turns outside the radix tree; not tested with sparse layers",
    ),
    RefusedOption(
        "--enable-session-radix-cache",
        "sessions keep a request's rows across turns outside the radix tree; not tested with sparse layers",
    ),
    RefusedOption(
        "--enable-priority-scheduling",
        "preemption by priority retracts running requests from a path not tested with sparse layers",
    ),
    RefusedOption(
        "--enable-dynamic-chunking", "chunk sizes chosen per step are not tested with the window-safe chunk cut"
    ),
    RefusedOption(
        "--enable-torch-compile",
        "compiled decode graphs are not tested with the sparse layers' graph hooks (needs a GPU to test)",
    ),
    RefusedOption("--enable-lora", "LoRA adapters are not tested with sparse layers (no adapter here to test with)"),
    RefusedOption(
        "--lora-paths", "LoRA adapters are not tested with sparse layers (no adapter here to test with)", True
    ),
)

#: Options served with sparse layers, and the test that shows each (outputs equal to stock's at
#: budgets above every length, or the behaviour the option asks for).
SERVED: dict[str, str] = {
    "--chunked-prefill-size": "tests/e2e/test_chunked.py",
    "--enable-mixed-chunk": "tests/e2e/test_lossless.py",
    "--disable-radix-cache": "tests/e2e/test_chunked.py",
    "--max-total-tokens": "tests/e2e/test_eviction.py",
    "--mem-fraction-static": "tests/e2e/test_lossless.py",
    "--context-length": "tests/e2e/test_lossless.py",
    "--enable-custom-logit-processor": "tests/e2e/test_chunked.py",
    "--enable-cache-report": "tests/e2e/test_radix.py",
    "--page-size": "tests/e2e/test_server_options.py",
    "--max-running-requests": "tests/e2e/test_server_options.py",
    "--max-prefill-tokens": "tests/e2e/test_server_options.py",
    "--schedule-policy": "tests/e2e/test_server_options.py",
    "--schedule-conservativeness": "tests/e2e/test_server_options.py",
    "--radix-eviction-policy": "tests/e2e/test_server_options.py",
    "--tp-size": "tests/e2e/test_parallel_serving.py",
    "--dp-size": "tests/e2e/test_parallel_serving.py",
    "--cuda-graph-backend-decode": "tests/integration/test_decode_graph_hooks.py",
}


def refusals(values: Mapping[str, Any]) -> list[str]:
    """One line per refused option in use among `values` (`ServerArgs` field -> value; a field
    absent is not in use)."""
    return [option.line(values[option.field]) for option in REFUSED if option.in_use(values.get(option.field))]
