"""The sparse layers' state in the scheduler process (SGLang 0.5.23 model runner).

AFTER `ModelRunner.alloc_memory_pool`, `attach_state` builds the `SparseState` (per-group index
maps and per-layer K/V buffers) beside SGLang's pools and attaches it as the request-to-token
pool's aux cache, so SGLang's own allocation and release paths drive it. It is also the first
kvsparse code to run in the scheduler process, so it checks the guards and that every other
patch is in place, and raises: SGLang swallows plugin exceptions, and a half-applied plugin
would otherwise serve stock attention under a sparse configuration.

Step 1 of docs/sparse-backend-plan.md: the sparse pools are sized like the full pool (no equal-bytes
split yet) and SGLang's pool still has buffers for the sparse layers, which they never use.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from sglang.srt.runtime_context import get_server_args

from sglang_kvsparse.config import SparsityConfig
from sglang_kvsparse.sparse_state import SparseState

from . import attention

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.alloc_memory_pool"

#: The state of this scheduler process (TP=1: one runner), read by the stats hook.
STATE: SparseState | None = None


class KVSparseStartupError(RuntimeError):
    """A setting this build cannot serve with sparse layers; the message names the flag."""


def make_attach_state(config: SparsityConfig):
    """The AFTER hook for `TARGET`, bound to the effective configuration."""

    def attach_state(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
        global STATE
        check_guards(runner)
        model = runner.model_config
        resolved = config.resolve(model.num_hidden_layers, model.context_len)
        pool = runner.token_to_kv_pool
        k0 = pool.get_key_buffer(resolved.full_layers[0] if resolved.full_layers else 0)
        state = SparseState(
            resolved,
            slots_per_layer=runner.max_total_num_tokens,
            max_requests=runner.req_to_token_pool._alloc_size,
            num_kv_heads=k0.shape[1],
            head_dim=k0.shape[2],
            dtype=k0.dtype,
            dense_capacity=runner.token_to_kv_pool_allocator.size,
            page_size=runner.page_size,
            device=k0.device,
        )
        runner.req_to_token_pool.attach_aux_cache(state)
        STATE = state
        print(
            f"[sglang-kvsparse] sparse layers {list(resolved.sparse_layers)} "
            f"(full {list(resolved.full_layers)}): {state.maps[0].pool.num_slots if state.maps else 0} "
            f"slots per layer in {len(state.maps)} index-map group(s); {config.describe()}",
            file=sys.stderr,
            flush=True,
        )

    return attach_state


def check_guards(runner: Any) -> None:
    """Refuse, in one line naming the flag, what the sparse layers cannot serve yet."""
    args = get_server_args()
    problems = []
    if os.environ.get("SGLANG_RADIX_FORCE_MISS") not in ("1", "true", "True"):
        problems.append("SGLANG_RADIX_FORCE_MISS=1 must be set (prefix reuse is not supported yet)")
    if (getattr(args, "chunked_prefill_size", None) or -1) > 0 or getattr(args, "enable_mixed_chunk", False):
        problems.append("chunked prefill is not supported with layer-wise sparsity yet; use --chunked-prefill-size -1")
    if getattr(args, "tp_size", 1) != 1 or getattr(args, "dp_size", 1) != 1 or getattr(args, "pp_size", 1) != 1:
        problems.append("--tp-size/--dp-size/--pp-size must be 1 with layer-wise sparsity")
    if str(runner.device) != "cpu" and not getattr(args, "disable_overlap_schedule", False):
        problems.append("--disable-overlap-schedule is required with layer-wise sparsity on a GPU")
    if getattr(args, "speculative_algorithm", None):
        problems.append("speculative decoding is not supported with layer-wise sparsity")
    for option in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        name = getattr(args, option, None)
        if name is not None and name not in attention.WRAPPED_BACKENDS:
            problems.append(f"--{option.replace('_', '-')} {name}: sparse layers support {attention.WRAPPED_BACKENDS}")
    if not attention.installed():
        problems.append("the kvsparse attention backend is not installed in this process (plugin load failed?)")
    if problems:
        raise KVSparseStartupError("kvsparse: " + "; ".join(problems))
