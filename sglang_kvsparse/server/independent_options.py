"""SGLang's options that leave the sparse layers alone, each with the reason (no SGLang imports).

The option table of a sparse server has three parts: `option_support.SERVED` (served, with the
test that shows it), `option_support.REFUSED` (refused in one line) and `INDEPENDENT` here:
options whose work does not reach the sparse layers (a process setup, an MLP's parallelism, a
kernel of the linear layers) or that act only beside a refused option. Every option of
`OPTION_GROUPS`, SGLang 0.5.23's groups that touch the KV pool, the radix tree, attention,
admission or parallelism, is in exactly one part (tests/integration/test_option_groups.py reads
SGLang's own groups), so an option added by a new SGLang fails that test until it is placed.
"""

from __future__ import annotations


def _only_with(flag: str) -> str:
    return f"acts only with {flag} (refused)"


_PROCESSES = "where and how the ranks' processes meet; no KV"
_MLP = "parallelism of the MLP or MoE layers; attention and the KV cache are untouched"
_MLA = "DeepSeek's MLA or sparse-attention (DSA) models only, which the sparse layers refuse"
_WINDOW_LAYERS = "models with sliding-window layers only, which the sparse layers refuse"
_MAMBA = "state-space (Mamba) layers only, which the sparse layers refuse"
_WHEN = "when waiting requests are scheduled; each batch is admitted and charged as any other"
_GEMM = "kernels of the linear layers"
_PREFILL_GRAPH = "prefill CUDA graphs, off with sparse layers (--cuda-graph-backend-prefill disabled)"
_GRAPH_SIZES = "which batch sizes get a decode CUDA graph; the graph runner sizes the sparse layers' buffers"
_DIAGNOSTICS = "diagnostics or memory housekeeping of CUDA graphs"
_INNER_BACKEND = "a setting of the backend that runs the full layers; the sparse kernels have their own"

#: Options whose work does not reach the sparse layers, each with the reason: a sparse server
#: takes them as stock SGLang does.
INDEPENDENT: dict[str, str] = {
    "--radix-eviction-policy-config": "parameters of --radix-eviction-policy (served): which node goes first",
    **{
        flag: _only_with("--enable-hierarchical-cache")
        for flag in (
            "--hicache-host-memory-mode",
            "--hicache-ratio",
            "--hicache-size",
            "--hicache-host-memory-fraction",
            "--hicache-write-policy",
            "--hicache-io-backend",
            "--hicache-mem-layout",
            "--hicache-storage-prefetch-policy",
            "--hicache-storage-backend-extra-config",
            "--hicache-storage-prefetch-retry-poll-interval",
            "--hicache-storage-prefetch-retry-max-attempts",
        )
    },
    "--unified-cache-external-linker-backend": _only_with("--enable-unified-cache-external-linker"),
    "--unified-cache-external-linker-config": _only_with("--enable-unified-cache-external-linker"),
    "--enable-linker-mla-dedup": _only_with("--enable-unified-cache-external-linker"),
    "--hisparse-config": _only_with("--enable-hisparse"),
    "--lmcache-config-file": _only_with("--enable-lmcache"),
    "--flexkv-config-file": _only_with("--enable-flexkv"),
    **dict.fromkeys(
        ("--nccl-port", "--dist-timeout", "--dist-init-addr", "--gated-launch-port", "--nnodes", "--node-rank"),
        _PROCESSES,
    ),
    "--enable-p2p-check": _PROCESSES,
    "--pp-max-micro-batch-size": _only_with("--pp-size"),
    "--pp-async-batch-depth": _only_with("--pp-size"),
    "--load-balance-method": "how requests are spread over --dp-size replicas, each a whole sparse server",
    "--dcp-comm-backend": _only_with("--dcp-size"),
    "--dcp-replicate-q-proj": _only_with("--dcp-size"),
    "--cp-strategy": _only_with("--enable-prefill-cp"),
    "--enable-cp-tp-group-sharing": _only_with("--attn-cp-size"),
    "--enable-cp-decode-attn-tp": _only_with("--attn-cp-size"),
    "--enable-dsa-cache-layer-split": _MLA,
    "--enable-dp-attention-local-control-broadcast": _only_with("--attn-dp-size"),
    "--enable-dp-lm-head": _only_with("--attn-dp-size"),
    "--enable-tp-lm-head-all-to-all": "the LM head's communication, after every attention layer",
    **dict.fromkeys(
        (
            "--moe-dp-size",
            "--enable-shared-experts-attn-tp",
            "--shared-experts-tp-size",
            "--enable-dense-mlp-attn-tp",
            "--enable-megamoe-for-layernorm-sp",
            "--ep-size",
            "--moe-dense-tp-size",
            "--ep-join-rank-offset",
            "--elastic-ep-initial-size",
            "--max-ep-size",
        ),
        _MLP,
    ),
    "--max-queued-requests": "bounds the queue of waiting requests; the sparse charges apply to what leaves it",
    **dict.fromkeys(
        (
            "--prefill-decode-interval",
            "--prefill-decode-interval-min-bs",
            "--prefill-max-requests",
            "--enable-prefill-delayer",
            "--prefill-delayer-max-delay-passes",
            "--prefill-delayer-token-usage-low-watermark",
            "--prefill-delayer-forward-passes-buckets",
            "--prefill-delayer-wait-seconds-buckets",
            "--prefill-delayer-queue-min-ratio",
            "--prefill-delayer-max-delay-ms",
            "--min-free-slots-delay",
            "--scheduler-recv-interval",
        ),
        _WHEN,
    ),
    **dict.fromkeys(
        (
            "--disable-priority-preemption",
            "--default-priority-value",
            "--abort-on-priority-when-disabled",
            "--schedule-low-priority-values-first",
            "--priority-scheduling-preemption-threshold",
        ),
        _only_with("--enable-priority-scheduling"),
    ),
    "--retraction-policy": "which running request SGLang retracts first; each retraction gives its rows back "
    "through the same hook (tests/e2e/test_eviction.py forces retractions)",
    "--c128-page-size": _MLA,
    "--disable-chunked-prefix-cache": _MLA,
    **dict.fromkeys(("--swa-full-tokens-ratio", "--swa-prefix-tails", "--disable-hybrid-swa-memory"), _WINDOW_LAYERS),
    "--max-mamba-cache-size": _MAMBA,
    "--mamba-full-memory-ratio": _MAMBA,
    **dict.fromkeys(
        (
            "--cuda-graph-max-bs-prefill",
            "--cuda-graph-max-seq-len-prefill",
            "--cuda-graph-bs-prefill",
            "--cuda-graph-prefill-max-context",
            "--disable-prefill-cuda-graph",
        ),
        _PREFILL_GRAPH,
    ),
    "--cuda-graph-max-bs-decode": _GRAPH_SIZES,
    "--cuda-graph-bs-decode": _GRAPH_SIZES,
    "--disable-cuda-graph-padding": "a batch of a size without a graph decodes eagerly, as on the CPU",
    **dict.fromkeys(("--enable-profile-cuda-graph", "--enable-cudagraph-gc", "--debug-cuda-graph"), _DIAGNOSTICS),
    "--enable-torch-compile-debug-mode": _only_with("--enable-torch-compile"),
    "--torch-compile-max-bs": _only_with("--enable-torch-compile"),
    "--enable-lean-attention": _INNER_BACKEND,
    "--prefill-kv-cache-dequant-dtype": _INNER_BACKEND,
    "--triton-attention-reduce-in-fp32": _INNER_BACKEND,
    "--triton-attention-num-kv-splits": _INNER_BACKEND,
    "--triton-attention-split-tile-size": _INNER_BACKEND,
    "--disable-flashinfer-autotune": "tuning of FlashInfer's kernels (full layers, linear layers)",
    "--flashinfer-autotune-skip-ops": "tuning of FlashInfer's kernels (full layers, linear layers)",
    "--sampling-backend": "sampling, after the logits",
    "--grammar-backend": "constrained decoding, after the logits",
    **dict.fromkeys(("--fp8-gemm-runner-backend", "--fp4-gemm-runner-backend", "--bf16-gemm-backend"), _GEMM),
    **dict.fromkeys(
        (
            "--dsa-prefill-backend",
            "--dsv4-prefill-backend",
            "--dsa-triton-union",
            "--dsa-decode-backend",
            "--dsv4-attn-backend",
            "--dsa-paged-mqa-logits-backend",
            "--dsa-topk-backend",
            "--flashinfer-mla-disable-ragged",
            "--enable-deepseek-v4-fp4-indexer",
            "--enable-dsa-fused-indexer",
        ),
        _MLA,
    ),
    "--enable-fused-qk-norm-rope": "fuses the QK norm and RoPE, which act before K reaches the cache",
    "--enable-precise-embedding-interpolation": "multimodal position embeddings (multimodal models are refused)",
    "--enable-single-batch-overlap": "overlaps the MoE layers' communication with computation",
    "--tbo-token-distribution-threshold": _only_with("--enable-two-batch-overlap"),
    "--rl-on-policy-target": "matches a trainer's numerics in the linear layers and sampling",
}

#: SGLang 0.5.23's option groups (`ServerArgs` namespaces) that touch the KV pool, the radix tree,
#: attention, admission or parallelism: each of their options is in one part of the
#: table.
OPTION_GROUPS: tuple[str, ...] = (
    "memory",
    "parallel",
    "schedule",
    "exec.graph",
    "exec.kernel",
    "exec.overlap",
    "exec.deterministic",
)
