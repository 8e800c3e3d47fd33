"""SGLang's server options that touch the KV pool, the radix tree, admission, attention or
parallelism, each served with sparse layers or refused in one line (no SGLang imports).

Why a table: SGLang 0.5.23 has ~500 options, and one that changes the KV pool underneath the
sparse layers (a host copy of the pool, another layout, a second model's cache) would either fail
far from its cause (HiCache sized its host pool from the heap and asked for 22 GB) or serve wrong
outputs quietly. So every such option is listed: `SERVED` with the test that shows it, `REFUSED`
with the reason, and those whose work does not reach the sparse layers in
`independent_options.INDEPENDENT`. The refusals read SGLang's own arguments, never the command
line's spelling, so an alias (`--enable-hicache`), a deprecated flag that resolution turns into
another (`--enable-dp-attention`) and a JSON setting (`--cuda-graph-config`) are refused alike:
the launcher checks what SGLang's parser made of the command line and then the resolved arguments
before SGLang starts (`patches/server_entry.py`), `sglang_kvsparse.Engine` its keyword arguments,
and every scheduler the resolved arguments at start-up (`patches/memory.check_guards`: the way in
for `sglang.Engine` and `sglang.launch_server` with the plugin's variable). docs/config.md shows
the table. Attention backends (`backends.py`) have their own module.
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
_SPLIT_REQUEST = "splits a request's tokens or K/V over ranks; a sparse layer selects from all of a request's keys"
_OWN_REQUESTS = "gives ranks requests of their own under one scheduler's view; the sparse tables follow that one view"
_UNTESTED = "not tested with sparse layers"
_ONE_KERNEL = "runs the decode step as one kernel, past the attention backend the sparse layers wrap"

REFUSED: tuple[RefusedOption, ...] = (
    RefusedOption("--enable-hierarchical-cache", _HOST_COPY + " (HiCache)"),
    RefusedOption("--hicache-storage-backend", _HOST_COPY + " (HiCache storage)", takes_value=True),
    RefusedOption("--enable-lmcache", _HOST_COPY + " (LMCache)"),
    RefusedOption("--enable-flexkv", _HOST_COPY + " (FlexKV)"),
    RefusedOption("--enable-unified-cache-external-linker", _HOST_COPY + " (an external cache)"),
    RefusedOption("--disaggregation-decode-enable-offload-kvcache", _HOST_COPY),
    RefusedOption(
        "--enable-hisparse",
        "SGLang's hierarchical sparse attention keeps the KV in host memory and selects from it itself; "
        "one sparse attention per server",
    ),
    RefusedOption(
        "--radix-cache-backend",
        "replaces SGLang's radix tree, whose matches and evictions the prefix store follows",
        takes_value=True,
    ),
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
    RefusedOption(
        "--pp-size",
        "pipeline parallelism would split a column of sparse layers and its heap rows over processes; "
        "use --tp-size or --dp-size",
        takes_value=True,
        unused=(1,),
    ),
    RefusedOption("--attn-dp-size", "DP attention " + _OWN_REQUESTS, takes_value=True, unused=(1,)),
    RefusedOption("--enable-dp-attention", "DP attention " + _OWN_REQUESTS),
    RefusedOption("--dwdp-size", "DWDP " + _OWN_REQUESTS, takes_value=True, unused=(1,)),
    RefusedOption("--attn-cp-size", "attention context parallelism " + _SPLIT_REQUEST, takes_value=True, unused=(1,)),
    RefusedOption("--dcp-size", "decode context parallelism " + _SPLIT_REQUEST, takes_value=True, unused=(1,)),
    RefusedOption("--enable-prefill-cp", "context-parallel prefill " + _SPLIT_REQUEST),
    RefusedOption("--enable-attn-tp-input-scattered", "attention's input scattered over TP ranks: " + _UNTESTED),
    RefusedOption("--enable-layernorm-sp", "sequence-parallel activations around attention: " + _UNTESTED),
    RefusedOption("--disable-attn-tp-gather", "leaves the sequence gather to the model's attention: " + _UNTESTED),
    RefusedOption("--enable-kv-cache-sharding", _LAYOUT),
    RefusedOption("--enable-page-major-kv-layout", _LAYOUT),
    RefusedOption("--enable-unified-memory", _LAYOUT),
    RefusedOption("--prefill-only-disable-kv-cache", "sparse layers keep their entries in the KV cache"),
    RefusedOption(
        "--enable-memory-saver",
        "releases and re-creates the KV pool's memory; the heap's lanes and tables are not released",
    ),
    RefusedOption(
        "--enable-streaming-session",
        "sessions keep a request's rows across turns outside the radix tree; " + _UNTESTED,
    ),
    RefusedOption(
        "--enable-session-radix-cache",
        "sessions keep a request's rows across turns outside the radix tree; " + _UNTESTED,
    ),
    RefusedOption(
        "--enable-priority-scheduling",
        "preemption by priority retracts running requests from a path " + _UNTESTED,
    ),
    RefusedOption(
        "--enable-dynamic-chunking", "chunk sizes chosen per step are not tested with the window-safe chunk cut"
    ),
    RefusedOption(
        "--enable-two-batch-overlap",
        "splits a batch into two micro-batches; the sparse layers' plan covers the whole batch",
    ),
    RefusedOption(
        "--enable-deterministic-inference",
        "batch-invariant attention: the sparse kernels split a decode row by the batch's shape",
    ),
    RefusedOption("--enable-nvidia-megakernel", _ONE_KERNEL),
    RefusedOption("--enable-amd-monokernel", _ONE_KERNEL),
    RefusedOption(
        "--enable-torch-compile",
        "compiled decode graphs are not tested with the sparse layers' graph hooks (needs a GPU to test)",
    ),
    RefusedOption("--enable-lora", "LoRA adapters are " + _UNTESTED + " (no adapter here to test with)"),
    RefusedOption("--lora-paths", "LoRA adapters are " + _UNTESTED + " (no adapter here to test with)", True),
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
    "--disable-overlap-schedule": "tests/e2e/test_server_options.py",
    "--num-continuous-decode-steps": "tests/e2e/test_server_options.py",
    "--tp-size": "tests/e2e/test_parallel_serving.py",
    "--dp-size": "tests/e2e/test_parallel_serving.py",
    "--cuda-graph-backend-decode": "tests/integration/test_decode_graph_hooks.py",
    "--cuda-graph-backend-prefill": "tests/unit/test_options.py",
    "--cuda-graph-config": "tests/unit/test_option_support.py",
    "--disable-decode-cuda-graph": "tests/e2e/test_lossless.py",
    "--disable-cuda-graph": "tests/e2e/test_lossless.py",
    "--attention-backend": "tests/unit/test_options.py",
    "--prefill-attention-backend": "tests/unit/test_options.py",
    "--decode-attention-backend": "tests/unit/test_options.py",
}


#: Environment switches of SGLang's the sparse layers cannot serve, each with its reason.
REFUSED_ENVIRONMENT: dict[str, str] = {
    "SGLANG_ENABLE_METADATA_GLUE_GRAPH": "captures the attention backend's host planning into a graph and "
    "replays it frozen; the sparse layers plan each decode step on the host",
}

#: CUDA-graph backends a sparse server runs, per phase (unset: SGLang's default for the phase,
#: which the launcher sets for prefills on a GPU): decode graphs replay in full or not at all
#: (`forward/decode_graph.py`), prefills run eagerly (`options.GPU_SPARSE_OPTIONS` says why).
GRAPH_BACKENDS: dict[str, tuple[str, ...]] = {"decode": ("full", "disabled"), "prefill": ("disabled",)}


def refusals(values: Mapping[str, Any]) -> list[str]:
    """One line per refused option in use among `values` (`ServerArgs` field -> value; a field
    absent is not in use)."""
    return [option.line(values[option.field]) for option in REFUSED if option.in_use(values.get(option.field))]


def environment_refusals(environ: Mapping[str, str]) -> list[str]:
    """One line per refused environment switch set to a true value."""
    return [
        f"{name}={environ[name]}: {why}"
        for name, why in REFUSED_ENVIRONMENT.items()
        if environ.get(name, "").strip().lower() in ("1", "true", "yes", "y")
    ]


def graph_backend(values: Mapping[str, Any], phase: str) -> str | None:
    """A phase's CUDA-graph backend: `--cuda-graph-config`'s (a dict, resolved or as given: it wins
    over the per-phase flag), else `--cuda-graph-backend-<phase>`'s, else None (unset)."""
    config = values.get("cuda_graph_config") or {}
    return (config.get(phase) or {}).get("backend") or values.get(f"cuda_graph_backend_{phase}")


def graph_refusals(values: Mapping[str, Any]) -> list[str]:
    """One line per phase whose CUDA-graph backend a sparse server does not run."""
    lines = []
    for phase, served in GRAPH_BACKENDS.items():
        backend = graph_backend(values, phase)
        if backend is not None and backend not in served:
            lines.append(
                f"--cuda-graph-backend-{phase} {backend} (or in --cuda-graph-config): sparse layers run "
                f"{phase} graphs {' or '.join(served)}"
            )
    return lines


#: The `ServerArgs` fields the refusals read.
CHECKED_FIELDS: tuple[str, ...] = (
    *(option.field for option in REFUSED),
    "cuda_graph_config",
    *(f"cuda_graph_backend_{phase}" for phase in GRAPH_BACKENDS),
)


def checked_values(server_args: Any) -> dict[str, Any]:
    """The fields the refusals read, from SGLang's arguments: resolved (`ServerArgs.resolved_dict`,
    where resolution has turned deprecated flags and JSON settings into fields), or as parsed."""
    resolved = getattr(server_args, "resolved_dict", None)
    values = resolved() if callable(resolved) else vars(server_args)
    return {field: values.get(field) for field in CHECKED_FIELDS}


def option_problems(values: Mapping[str, Any], environ: Mapping[str, str]) -> list[str]:
    """Every refusal for a server with these options (`ServerArgs` field -> value, given or
    resolved) in this environment: empty when the sparse layers can serve it."""
    return refusals(values) + graph_refusals(values) + environment_refusals(environ)
