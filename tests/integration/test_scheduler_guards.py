"""The scheduler-side guard (`patches/memory.check_guards`, the first kvsparse code in a scheduler
process) refuses a model the sparse layers cannot serve even when the project's launcher was
bypassed (`sglang.Engine`, `sglang.launch_server` with the plugin's variable): an MLA model would
otherwise have an MHA heap sized from its latent cache."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from sglang_kvsparse.server.option_support import REFUSED

pytestmark = pytest.mark.integration

LLAMA = {"architectures": ["LlamaForCausalLM"], "num_attention_heads": 8, "num_hidden_layers": 4}
DEEPSEEK = {"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512, "q_lora_rank": 1536}
GEMMA2 = {"architectures": ["Gemma2ForCausalLM"], "attn_logit_softcapping": 50.0, "sliding_window": 4096}


def _model(config: dict) -> SimpleNamespace:
    return SimpleNamespace(hf_config=SimpleNamespace(to_dict=lambda: dict(config)))


@pytest.fixture
def server_args() -> SimpleNamespace:
    return SimpleNamespace(tp_size=1, dp_size=1, pp_size=1, speculative_algorithm=None, kv_cache_dtype="auto")


@pytest.fixture
def memory(monkeypatch, server_args):
    from sglang_kvsparse.patches import attention, memory

    monkeypatch.setattr(memory, "get_server_args", lambda: server_args)
    monkeypatch.setattr(attention, "installed", lambda: True)
    monkeypatch.setattr(memory, "unpatched", lambda: [])
    return memory


@pytest.mark.parametrize(
    ("config", "reason"),
    [(DEEPSEEK, "multi-head latent attention"), (GEMMA2, "attention logit soft-capping")],
)
def test_a_model_the_sparse_layers_cannot_serve_is_refused_in_the_scheduler(memory, config, reason):
    with pytest.raises(memory.KVSparseStartupError, match=reason):
        memory.check_guards(_model(config))


def test_a_plain_model_passes_the_scheduler_guard(memory):
    memory.check_guards(_model(LLAMA))


@pytest.mark.parametrize("refused", REFUSED, ids=lambda option: option.flag)
def test_an_sglang_option_the_sparse_layers_cannot_serve_is_refused_in_the_scheduler(memory, server_args, refused):
    """However the server was started (`sglang.Engine` takes no launcher), each refused option in
    use stops the scheduler with the table's line; at its unused value it passes."""
    setattr(server_args, refused.field, refused.unused[0] if refused.unused else False)
    memory.check_guards(_model(LLAMA))
    setattr(server_args, refused.field, "x" if refused.takes_value else True)
    with pytest.raises(memory.KVSparseStartupError, match=re.escape(refused.line(getattr(server_args, refused.field)))):
        memory.check_guards(_model(LLAMA))


def test_tensor_and_data_parallelism_pass_pipeline_parallelism_is_refused(memory, server_args):
    server_args.tp_size = server_args.dp_size = 2
    memory.check_guards(_model(LLAMA))
    server_args.pp_size = 2
    with pytest.raises(memory.KVSparseStartupError, match="--pp-size 2: pipeline parallelism"):
        memory.check_guards(_model(LLAMA))
