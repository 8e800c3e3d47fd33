"""What the launcher and engine add or refuse for a sparse server (no SGLang, no model)."""

import json
import os

import pytest

from sglang_kvsparse.config import PRESETS, SparsityConfig
from sglang_kvsparse.server.backends import BACKEND_OPTIONS, WRAPPED_BACKENDS
from sglang_kvsparse.server.options import (
    CPU_SPARSE_MEM_FRACTION,
    GPU_SPARSE_OPTIONS,
    sparse_sglang_defaults,
    validate_for_model,
)
from sglang_kvsparse.server.serving_defaults import LaunchError, ModelShape

SHAPE = ModelShape(num_layers=30, context_len=8192, num_kv_heads=3, head_dim=64)
LOSSLESS = SparsityConfig(full_layers=(0, 1), budget=8192)


def test_every_preset_fits_the_model_and_bad_layers_are_refused_in_one_line():
    for config in (LOSSLESS, *PRESETS.values()):
        validate_for_model(config, SHAPE)
    with pytest.raises(LaunchError, match="layer 30 is outside the model"):
        validate_for_model(SparsityConfig(full_layers=(0, 30), budget=512), SHAPE)


def test_sparse_servers_keep_sglangs_chunking_and_overlap_and_get_a_memory_fraction_on_the_cpu():
    assert sparse_sglang_defaults(PRESETS["off"], {}, cpu=True) == ({}, [])
    assert sparse_sglang_defaults(LOSSLESS, {}, cpu=True) == ({"mem_fraction_static": CPU_SPARSE_MEM_FRACTION}, [])
    assert sparse_sglang_defaults(LOSSLESS, {"mem_fraction_static": 0.5}, cpu=True) == ({}, [])
    assert sparse_sglang_defaults(LOSSLESS, {}, cpu=False) == (GPU_SPARSE_OPTIONS, [])


@pytest.mark.parametrize("backend", ["fa3", "flashinfer", "triton", "torch_native", "trtllm_mha", "aiter"])
def test_on_a_gpu_sglangs_default_and_every_mha_backend_run_the_full_layers(backend):
    """No flag: SGLang picks its default (fa3 on Hopper, flashinfer on other NVIDIA GPUs), which
    the launcher leaves alone; a given MHA backend is kept as well."""
    for given in ({}, {"attention_backend": backend}, {"decode_attention_backend": backend}):
        options, notes = sparse_sglang_defaults(LOSSLESS, given, cpu=False)
        assert not set(BACKEND_OPTIONS) & set(options) and notes == []
    assert {"fa3", "flashinfer"} <= set(WRAPPED_BACKENDS)


@pytest.mark.parametrize(("cpu", "nearest"), [(False, "triton"), (True, "torch_native")])
def test_a_backend_that_cannot_run_beside_sparse_layers_is_replaced_in_one_line(cpu, nearest):
    given = {"attention_backend": "flashmla", "prefill_attention_backend": "fa3", "decode_attention_backend": "dsa"}
    options, notes = sparse_sglang_defaults(LOSSLESS, given, cpu=cpu)
    assert options["attention_backend"] == nearest and options["decode_attention_backend"] == nearest
    assert "prefill_attention_backend" not in options
    why = f"cannot run beside sparse layers (it is not an MHA/GQA backend): using {nearest}"
    assert notes == [f"--attention-backend flashmla {why}", f"--decode-attention-backend dsa {why}"]
    assert sparse_sglang_defaults(PRESETS["off"], given, cpu=cpu) == ({}, [])  # stock SGLang: untouched


@pytest.fixture
def gpu_launch(tmp_path, monkeypatch):
    """The launcher as on a CUDA machine (no GPU is touched: it only decides SGLang's argv)."""
    from sglang_kvsparse import launch_server
    from sglang_kvsparse.server import options

    config = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    config["max_position_embeddings"] = 4096
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setattr(launch_server, "gpu_available", lambda: True)
    monkeypatch.delenv(options.CONFIG_ENV, raising=False)
    yield lambda *args: launch_server.build_sglang_argv(["--model-path", str(tmp_path), "--port", "0", *args])
    monkeypatch.delenv(options.CONFIG_ENV, raising=False)


def test_the_gpu_launch_keeps_decode_graphs_and_runs_prefills_eagerly(gpu_launch, capsys):
    argv = gpu_launch()
    assert "--cuda-graph-backend-decode" not in argv  # SGLang's own choice: full graphs
    assert argv[argv.index("--cuda-graph-backend-prefill") + 1] == "disabled"
    argv = gpu_launch("--cuda-graph-backend-decode", "full")
    assert argv[len(argv) - 1 - argv[::-1].index("--cuda-graph-backend-decode") + 1] == "full"
    argv = gpu_launch("--cuda-graph-backend-decode", "breakable")
    assert argv[len(argv) - 1 - argv[::-1].index("--cuda-graph-backend-decode") + 1] == "full"
    assert "--cuda-graph-backend-decode breakable is not served with sparse layers: using full" in (
        capsys.readouterr().err
    )


def test_the_gpu_launch_leaves_sglangs_backend_choice_alone(gpu_launch, capsys):
    argv = gpu_launch("--kvsparse-budget", "512")
    assert "--attention-backend" not in argv and "--device" not in argv  # SGLang picks fa3/flashinfer
    argv = gpu_launch("--attention-backend", "fa3")
    assert argv.count("--attention-backend") == 1 and argv[argv.index("--attention-backend") + 1] == "fa3"
    assert "cannot run beside sparse layers" not in capsys.readouterr().err


def test_the_gpu_launch_replaces_a_backend_that_cannot_serve_sparse_layers(gpu_launch, capsys):
    argv = gpu_launch("--attention-backend", "flashmla")
    last = len(argv) - 1 - argv[::-1].index("--attention-backend")  # argparse keeps the last
    assert argv[last + 1] == "triton"
    said = [line for line in capsys.readouterr().err.splitlines() if "flashmla" in line]
    assert said == [
        "[sglang-kvsparse] --attention-backend flashmla cannot run beside sparse layers "
        "(it is not an MHA/GQA backend): using triton"
    ]


@pytest.fixture
def cpu_launch(tmp_path, monkeypatch):
    """The launcher as on a machine with four cores and no GPU (it only decides SGLang's argv and
    the environment SGLang's processes inherit)."""
    from sglang_kvsparse import launch_server
    from sglang_kvsparse.server import options, parallelism, serving_defaults

    config = {"num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 256}
    (tmp_path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    monkeypatch.setattr(launch_server, "gpu_available", lambda: False)
    monkeypatch.setattr(launch_server.os, "sched_getaffinity", lambda pid: {3, 1, 0, 2})
    for name in (options.CONFIG_ENV, parallelism.THREADS_BIND_ENV, serving_defaults.CPU_ENGINE_ENV):
        monkeypatch.delenv(name, raising=False)
    yield lambda *args: launch_server.build_sglang_argv(["--model-path", str(tmp_path), "--port", "0", *args])
    for name in (options.CONFIG_ENV, parallelism.THREADS_BIND_ENV, serving_defaults.CPU_ENGINE_ENV):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("args", "binding"), [(["--tp-size", "2"], "0,1|2,3"), (["--dp-size", "2"], "0,1|2,3")])
def test_each_cpu_rank_gets_its_share_of_the_cores(cpu_launch, capsys, args, binding):
    argv = cpu_launch(*args)
    assert argv[argv.index(args[0]) + 1] == "2"  # SGLang still gets the option
    assert os.environ["SGLANG_CPU_OMP_THREADS_BIND"] == binding
    assert f"2 ranks on the CPU: SGLANG_CPU_OMP_THREADS_BIND={binding}" in capsys.readouterr().err


def test_a_given_core_binding_and_a_single_rank_are_left_alone(cpu_launch, monkeypatch):
    cpu_launch()
    assert "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", "0|3")
    cpu_launch("--tp-size", "2")
    assert os.environ["SGLANG_CPU_OMP_THREADS_BIND"] == "0|3"
