"""Dummy-weight model folders (SGLang's `--load-format dummy`): a config.json of a real
architecture, usually shrunk, and a placeholder tokenizer, so a server starts in seconds with no
weights and no hub. Benchmarks use them for large models' shapes, tests for shapes the default
model does not have (two KV heads for `--tp-size 2`, say).

SGLang still loads a tokenizer with dummy weights, and no hub is reachable here, so a folder gets
a generated placeholder tokenizer covering the model's whole vocabulary (``<t0>`` ...); prompts
are sent as token ids, so the tokenizer never affects what the model computes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

#: Config overrides of a dummy model's shapes. "dry-run": the same architecture, vocabulary and
#: rope settings, small enough to start and run on two cores in seconds. "kv": the model's exact
#: KV shape (layers, KV heads, head dim, context length) with a tiny hidden size, so memory
#: accounting, admission and capacity behave as at the real size while compute is negligible
#: ("kv-one-head": the same for a model with one KV head).
SHAPES: dict[str, dict[str, int]] = {
    "full": {},
    "dry-run": {
        "num_hidden_layers": 4,
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 64,
    },
    "kv": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8},
    # "kv" for a model of one KV head (Gemma 3 270M): one query head, so the attention's compute
    # shrinks with the rest while the KV shape stays exact.
    "kv-one-head": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 1},
}


def write_dummy_model(dest: Path, config: dict[str, Any]) -> Path:
    """Write `config` as ``dest/config.json`` with a placeholder tokenizer; returns `dest`."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    write_placeholder_tokenizer(dest, config)
    return dest


def write_placeholder_tokenizer(dest: Path, config: dict) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab_size = config["vocab_size"]
    tokenizer = Tokenizer(models.WordLevel({f"<t{i}>": i for i in range(vocab_size)}, unk_token="<t0>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.save(str(dest / "tokenizer.json"))
    eos = config.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    (dest / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": f"<t{config.get('bos_token_id', 0)}>",
                "eos_token": f"<t{eos if eos is not None else 0}>",
                "unk_token": "<t0>",
                "model_max_length": config.get("max_position_embeddings", 8192),
            },
            indent=2,
        )
    )
