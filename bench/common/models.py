"""Model folders for benchmarks and the dense KV size of their tokens.

Two kinds of model:
- the project's embedded default model (SmolLM2-135M), real weights, for CPU runs;
- a shipped ``config.json`` (``bench/models/<name>/``) served with ``--load-format dummy``: random
  weights of a large model's exact shape, which is all a throughput benchmark needs.

SGLang still loads a tokenizer with dummy weights, and no hub is reachable here, so a dummy folder
gets a generated placeholder tokenizer covering the model's whole vocabulary (``<t0>`` ...). Why
not the alternatives (checked on SGLang 0.5.23): ``--skip-tokenizer-init`` makes ``/generate``
stream ``output_ids`` without ``text``, and ``sglang.benchmark.serving`` only counts chunks with
non-empty ``text``, so TTFT and ITL would never be recorded; reusing the default model's tokenizer
(49,152 ids) for a 128,256-id model decodes every id above its vocabulary to ``''``, so random
dummy outputs would often produce empty chunks and shift the measured TTFT. Prompts are sent as
token ids (``--tokenize-prompt``), so the tokenizer never affects what the model computes.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvsparse_testbed.dummy_models import SHAPES, write_dummy_model
from sglang_kvsparse.models import ensure_default_model

BENCH_MODELS = Path(__file__).resolve().parent.parent / "models"

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
#: Bytes of one stored K/V value by `--kv-cache-dtype` (absent or "auto": the model's dtype's).
KV_DTYPE_BYTES = {"fp8_e4m3": 1, "fp8_e5m2": 1, "bf16": 2, "bfloat16": 2}

__all__ = [
    "SHAPES",
    "default_model",
    "kv_bytes_per_token",
    "kv_value_bytes",
    "prepare_dummy_model",
    "tokens_at_equal_bytes",
]


def default_model() -> Path:
    """The embedded default model's folder (converted on first use)."""
    return ensure_default_model(log=print)


def prepare_dummy_model(name: str, dest: Path, shape: str = "full") -> Path:
    """Write ``bench/models/<name>/config.json`` (with a `SHAPES` override) and a tokenizer into ``dest``.

    The tokenizer is generated rather than shipped: it carries no information (one placeholder
    per id), and generating it takes a tenth of a second.
    """
    config = json.loads((BENCH_MODELS / name / "config.json").read_text())
    return write_dummy_model(dest, {**config, **SHAPES[shape]})


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Dense KV bytes one token occupies across all layers: layers × KV heads × head dim × 2 × size."""
    config = json.loads((model_dir / "config.json").read_text())
    config = config.get("text_config", config)
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    kv_heads = config.get("num_key_value_heads", heads)
    return config["num_hidden_layers"] * kv_heads * head_dim * 2 * DTYPE_BYTES[dtype]


def kv_value_bytes(dtype: str, kv_dtype: str | None) -> int:
    """Bytes of one stored K/V value: the `--kv-cache-dtype`'s, or the model's `dtype`'s."""
    return KV_DTYPE_BYTES.get(kv_dtype or "auto", DTYPE_BYTES[dtype])


def tokens_at_equal_bytes(tokens: int | None, dtype: str, kv_dtype: str | None) -> int | None:
    """`--max-total-tokens` for a KV cache in `kv_dtype` that holds the bytes of `tokens` dense
    tokens in the model's `dtype` (None stays None: SGLang sizes the pool)."""
    if tokens is None:
        return None
    return tokens * DTYPE_BYTES[dtype] // kv_value_bytes(dtype, kv_dtype)
