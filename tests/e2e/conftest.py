"""Servers shared by all end-to-end tests: the project's launcher and stock SGLang, started once.

Both serve the embedded default model in float32 with the same KV pool, so any difference in
their greedy outputs is the project's doing. They start in parallel (about a minute on 2 cores).
"""

from __future__ import annotations

import pytest

from sglang_kvsparse.models import ensure_default_model
from sglang_kvsparse.serving_defaults import CPU_MAX_TOTAL_TOKENS, gpu_available

from .servers import PYTHON, Server, server_env

COMMON_ARGS = ["--dtype", "float32", "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS)]


@pytest.fixture(scope="session")
def model_path() -> str:
    return str(ensure_default_model())


@pytest.fixture(scope="session")
def servers(model_path, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("server-logs")
    stock_env = server_env()
    stock_args = ["--model-path", model_path, *COMMON_ARGS]
    if not gpu_available():
        stock_env["SGLANG_USE_CPU_ENGINE"] = "1"
        stock_args += ["--device", "cpu", "--attention-backend", "torch_native"]
    started = {
        "project": Server(
            "project",
            [PYTHON, "-m", "sglang_kvsparse.launch_server", *COMMON_ARGS],
            log_dir,
            server_env(),
        ),
        "stock": Server("stock", [PYTHON, "-m", "sglang.launch_server", *stock_args], log_dir, stock_env),
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        for server in started.values():
            server.stop()


@pytest.fixture(scope="session")
def project_server(servers) -> Server:
    return servers["project"]


@pytest.fixture(scope="session")
def stock_server(servers) -> Server:
    return servers["stock"]
