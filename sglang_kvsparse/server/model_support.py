"""Which models the sparse layers can serve, decided from config.json before SGLang starts.

A sparse layer replaces its attention by plain causal softmax attention over the entries it
keeps, with one K and one V per token and KV head (`sparse_attention.py`). Whatever a model's
attention adds to that would be dropped without a word: a server that starts and answers, wrongly.
So a model whose config declares any of these is refused in one line naming the reason:
- chunked or hybrid layers (linear attention, state-space), and a sliding window without the
  `layer_types` that say which layers slide - the sparse layers attend over every kept key.
  Sliding-window layers named by `layer_types` (Gemma 3) are served as sliding layers, which keep
  and read their window (`SparsityConfig.resolve`); a window at least as long as the model's
  context is never reached and is served as full attention;
- attention logit soft-capping (Gemma 2) - the kernels do not cap logits;
- learned attention sinks (gpt-oss) - the kernels add no sink logit to a softmax
  (docs/experiments/2026-12-06-gpt-oss.md: what serving it would take);
- ALiBi position biases - the kernels add no bias;
- multi-head latent attention (DeepSeek's MLA: compressed KV, K and V of other sizes);
- cross-attention layers and encoder-decoder models - only self-attention over the request;
- image, video or audio input (a multimodal config) - its tokens' K/V are not tested with sparse
  layers, and some models attend over an image's tokens in both directions.
The final-logit soft-capping of the LM head is not attention and is left alone. No SGLang imports.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sglang_kvsparse.config import ResolvedSparsity, SparsityConfig
from sglang_kvsparse.server.serving_defaults import LaunchError, ModelShape

#: `layer_types` entries of plain full attention and of a sliding window (served as sliding
#: layers, or as full attention when the window is never reached: `sliding_window`); any other
#: kind is a layer the sparse layers do not serve.
FULL_ATTENTION_LAYER = "full_attention"
SLIDING_ATTENTION_LAYER = "sliding_attention"
#: Model types whose attention adds a learned sink logit per head (in its weights, not its config).
ATTENTION_SINK_MODEL_TYPES = frozenset({"gpt_oss"})
#: Config keys of a model that takes image, video or audio input beside text.
MULTIMODAL_KEYS = ("vision_config", "audio_config", "vision_tower", "mm_vision_tower", "visual", "speech_config")
#: Model types whose attention always adds ALiBi biases (their configs carry no flag for it).
ALIBI_MODEL_TYPES = frozenset({"bloom"})


def read_config(model_path: str) -> dict[str, Any]:
    """The model's config.json, from a local folder or, for a hub id, the hub (or its cache)."""
    local = Path(model_path).expanduser() / "config.json"
    try:
        if local.is_file():
            return json.loads(local.read_text())
        from huggingface_hub import hf_hub_download

        return json.loads(Path(hf_hub_download(model_path, "config.json")).read_text())
    except Exception as exc:  # any failure to read it is the same one-line answer
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise LaunchError(
            f"--model-path {model_path}: cannot read its config.json ({reason}); sparse layers need it "
            "to check the model (--kvsparse-preset off serves it without sparsity)"
        ) from None


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language model's part of a config (multimodal configs nest it)."""
    return config.get("text_config", config)


def model_shape(config: dict[str, Any]) -> ModelShape:
    """The layer count, context length and KV shape sparsity is validated against."""
    text = text_config(config)
    num_heads = text["num_attention_heads"]
    window = sliding_window(text)
    return ModelShape(
        num_layers=text["num_hidden_layers"],
        context_len=text.get("max_position_embeddings", 0),
        num_kv_heads=text.get("num_key_value_heads") or num_heads,
        head_dim=text.get("head_dim") or text["hidden_size"] // num_heads,
        sliding_layers=sliding_layers(text) if window else (),
        sliding_window=window,
    )


def sliding_layers(text: dict[str, Any]) -> tuple[int, ...]:
    """The layers `layer_types` names as sliding-window ones."""
    return tuple(i for i, kind in enumerate(text.get("layer_types") or ()) if kind == SLIDING_ATTENTION_LAYER)


def sliding_window(text: dict[str, Any]) -> int:
    """The window the model's attention applies, 0 for none: a declared window not in use (Qwen2's
    `use_sliding_window: false`) or at least as long as the model's context (Ministral-8B's 32,768
    of 32,768, Phi-3-mini-128k's 262,144 of 131,072) is never reached, so those layers attend over
    every key as full attention does."""
    if not text.get("use_sliding_window", True):
        return 0
    declared = [text.get(key) for key in ("sliding_window", "interleaved_sliding_window")]
    window = max((value for value in declared if isinstance(value, int) and not isinstance(value, bool)), default=0)
    context = text.get("max_position_embeddings") or 0
    return 0 if context and window >= context else window


def resolve_for_model(
    config: SparsityConfig, model_config: dict[str, Any], num_layers: int, context_len: int
) -> ResolvedSparsity:
    """`config` resolved for a model (its config.json as a dict; the layer count and context length
    the server runs it with), its sliding-window layers as sliding layers."""
    text = text_config(model_config)
    window = sliding_window(text)
    return config.resolve(num_layers, context_len, sliding_layers(text) if window else (), window)


def unsupported_features(config: dict[str, Any]) -> list[str]:
    """Why the sparse layers cannot serve this model (empty: they can)."""
    text = text_config(config)
    attn = text.get("attn_config") or {}  # MPT keeps its attention settings apart
    found = []
    window = sliding_window(text)
    served = {FULL_ATTENTION_LAYER, SLIDING_ATTENTION_LAYER}
    other_layers = sorted({kind for kind in text.get("layer_types") or () if kind not in served})
    if other_layers:
        found.append(f"layers of other kinds ({', '.join(other_layers)})")
    if window and not text.get("layer_types"):
        found.append("a sliding window without layer_types (which layers slide is not declared)")
    if text.get("model_type") in ATTENTION_SINK_MODEL_TYPES:
        found.append("learned attention sinks (a logit per head the sparse kernels do not add)")
    if text.get("attention_chunk_size"):
        found.append("chunked attention")
    if text.get("attn_logit_softcapping"):
        found.append("attention logit soft-capping")
    alibi_flag = text.get("alibi") or attn.get("alibi") or text.get("position_embedding_type") == "alibi"
    if alibi_flag or text.get("model_type") in ALIBI_MODEL_TYPES:
        found.append("ALiBi position biases")
    if text.get("kv_lora_rank") or text.get("q_lora_rank"):
        found.append("multi-head latent attention (MLA)")
    if text.get("cross_attention_layers"):
        found.append("cross-attention layers")
    if config.get("is_encoder_decoder") or text.get("is_encoder_decoder"):
        found.append("an encoder-decoder architecture")
    if any(key in text for key in ("ssm_state_size", "mamba_d_state", "linear_conv_kernel_dim")):
        found.append("state-space or linear-attention layers")
    multimodal = sorted(key for key in MULTIMODAL_KEYS if config.get(key))
    if multimodal:
        found.append(f"image, video or audio input ({', '.join(multimodal)})")
    return found


def check_supported(model_path: str, config: dict[str, Any]) -> None:
    """Refuse, in one line, a model the sparse layers would serve wrongly."""
    found = unsupported_features(config)
    if found:
        architecture = ", ".join(config.get("architectures") or [config.get("model_type", "this model")])
        raise LaunchError(
            f"--model-path {model_path}: sparse layers cannot serve {architecture}: {'; '.join(found)} "
            "(--kvsparse-preset off serves it as stock SGLang)"
        )
