"""Models the sparse layers would serve wrongly are refused before SGLang starts, in one line
naming why; the models they serve pass. Configs are excerpts of the public config.json files
(only the keys that decide), plus the shape keys every config has."""

import json

import pytest

from sglang_kvsparse import launch_server
from sglang_kvsparse.config import SparsityConfig
from sglang_kvsparse.server import options
from sglang_kvsparse.server.model_support import (
    check_supported,
    model_shape,
    read_config,
    resolve_for_model,
    unsupported_features,
)
from sglang_kvsparse.server.serving_defaults import LaunchError

NO_LAYER_TYPES = "a sliding window without layer_types (which layers slide is not declared)"
SHAPE = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}

REFUSED = {
    "gemma-2 (sliding window, soft-capping)": (
        {"model_type": "gemma2", "sliding_window": 4096, "attn_logit_softcapping": 50.0},
        [NO_LAYER_TYPES, "attention logit soft-capping"],
    ),
    "mistral-7b-v0.1 (sliding window, no layer_types)": (
        {"model_type": "mistral", "sliding_window": 4096, "max_position_embeddings": 32768},
        [NO_LAYER_TYPES],
    ),
    "gpt-oss-20b (window layers, attention sinks)": (
        {
            "model_type": "gpt_oss",
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "sliding_window": 128,
            "max_position_embeddings": 131072,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
            "num_local_experts": 32,
        },
        ["learned attention sinks (a logit per head the sparse kernels do not add)"],
    ),
    "llama-4 (chunked attention)": ({"model_type": "llama4_text", "attention_chunk_size": 8192}, ["chunked attention"]),
    "qwen3-next (linear attention)": (
        {
            "model_type": "qwen3_next",
            "layer_types": ["linear_attention", "full_attention"],
            "linear_conv_kernel_dim": 4,
        },
        ["layers of other kinds (linear_attention)", "state-space or linear-attention layers"],
    ),
    "jamba (state-space layers)": (
        {"model_type": "jamba", "mamba_d_state": 16},
        ["state-space or linear-attention layers"],
    ),
    "deepseek-v3 (MLA)": (
        {"model_type": "deepseek_v3", "kv_lora_rank": 512, "q_lora_rank": 1536},
        ["multi-head latent attention (MLA)"],
    ),
    "mpt (ALiBi)": ({"model_type": "mpt", "attn_config": {"alibi": True}}, ["ALiBi position biases"]),
    "bloom (ALiBi)": ({"model_type": "bloom"}, ["ALiBi position biases"]),
    "mllama (cross-attention)": (
        {"model_type": "mllama", "text_config": {**SHAPE, "cross_attention_layers": [3, 8]}},
        ["cross-attention layers"],
    ),
    "qwen2.5-vl (images and video)": (
        {"model_type": "qwen2_5_vl", "vision_config": {"depth": 32, "hidden_size": 1280}},
        ["image, video or audio input (vision_config)"],
    ),
    "qwen2-audio (audio)": (
        {"model_type": "qwen2_audio", "audio_config": {"d_model": 1280}, "text_config": SHAPE},
        ["image, video or audio input (audio_config)"],
    ),
    "t5 (encoder-decoder)": ({"model_type": "t5", "is_encoder_decoder": True}, ["an encoder-decoder architecture"]),
}

SERVED = {
    "llama-3.1": {"model_type": "llama", "rope_scaling": {"rope_type": "llama3"}},
    "qwen2 (declared window not in use)": {"model_type": "qwen2", "sliding_window": 32768, "use_sliding_window": False},
    "mistral-nemo (no window)": {"model_type": "mistral", "sliding_window": None},
    "gemma-2-style final-logit soft-capping only": {"model_type": "x", "final_logit_softcapping": 30.0},
    "falcon without alibi": {"model_type": "falcon", "alibi": False},
    "ministral-8b-2410 (window of the whole context)": {
        "model_type": "mistral",
        "sliding_window": 32768,
        "max_position_embeddings": 32768,
    },
    "phi-3-mini-128k (window past the context)": {
        "model_type": "phi3",
        "sliding_window": 262144,
        "max_position_embeddings": 131072,
    },
    "gemma-3 (sliding and global layers)": {
        "model_type": "gemma3_text",
        "sliding_window": 1024,
        "max_position_embeddings": 131072,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
    },
    "window layers whose window is never reached": {
        "model_type": "x",
        "sliding_window": 8192,
        "max_position_embeddings": 8192,
        "layer_types": ["sliding_attention", "full_attention"],
    },
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_model_feature_the_sparse_layers_cannot_serve_is_refused_in_one_line(name):
    config, reasons = REFUSED[name]
    config = {**SHAPE, **config}
    assert unsupported_features(config) == reasons
    with pytest.raises(LaunchError) as refused:
        check_supported("some/model", config)
    message = str(refused.value)
    assert "\n" not in message and "sparse layers cannot serve" in message and "--kvsparse-preset off" in message
    assert all(reason in message for reason in reasons)


@pytest.mark.parametrize("name", sorted(SERVED))
def test_the_models_the_sparse_layers_serve_pass(name):
    assert unsupported_features({**SHAPE, **SERVED[name]}) == []


def test_a_hub_id_is_checked_through_the_hub_and_an_unreadable_config_is_one_line(tmp_path, monkeypatch):
    import huggingface_hub

    (tmp_path / "config.json").write_text(json.dumps({**SHAPE, "model_type": "gemma2", "sliding_window": 4096}))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name: str(tmp_path / name))
    assert read_config("google/gemma-2-9b")["model_type"] == "gemma2"

    def offline(repo, name):
        raise OSError("We couldn't connect to 'https://huggingface.co'\nsecond line")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(LaunchError, match=r"cannot read its config.json \(We couldn't connect .*\)") as refused:
        read_config("google/gemma-2-9b")
    assert "\n" not in str(refused.value)


def test_the_launcher_refuses_before_sglang_starts_and_stock_mode_does_not_check(tmp_path, monkeypatch):
    config = {**SHAPE, "architectures": ["Gemma2ForCausalLM"], "sliding_window": 4096, "max_position_embeddings": 8192}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.delenv(options.CONFIG_ENV, raising=False)
    monkeypatch.setattr(launch_server, "gpu_available", lambda: True)  # no CPU engine switch in this process
    argv = ["--model-path", str(tmp_path), "--port", "0"]
    with pytest.raises(LaunchError, match="sparse layers cannot serve Gemma2ForCausalLM: a sliding window without"):
        launch_server.build_sglang_argv(argv)
    assert launch_server.build_sglang_argv([*argv, "--kvsparse-preset", "off"])  # stock SGLang: served as is
    monkeypatch.delenv(options.CONFIG_ENV, raising=False)


def test_sliding_layers_come_from_layer_types_and_a_window_never_reached_is_none():
    gemma3 = {**SHAPE, **SERVED["gemma-3 (sliding and global layers)"]}
    shape = model_shape(gemma3)
    assert (shape.sliding_layers, shape.sliding_window) == ((0, 1, 2), 1024)
    resolved = resolve_for_model(SparsityConfig(full_layers=(0, 3), budget=64), gemma3, 4, 131072)
    assert resolved.kinds == ("sliding", "sliding", "sliding", "full")  # a listed sliding layer stays sliding
    assert resolved.budgets == (1028, 1028, 1028, None)  # window + sink
    never = {**SHAPE, **SERVED["window layers whose window is never reached"]}
    assert (model_shape(never).sliding_layers, model_shape(never).sliding_window) == ((), 0)
    assert resolve_for_model(SparsityConfig(budget=64), never, 4, 8192).kinds == ("sparse",) * 4
