"""Bad launch input gets one clear line and exit status 2, never a traceback."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def _launch(*args: str, timeout: float = 180, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sglang_kvsparse.launch_server", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=None if env is None else {**os.environ, **env},
    )


def _assert_one_line_error(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, result.stderr[-2000:]
    assert expected in errors[0]


def test_missing_model_path():
    _assert_one_line_error(_launch("--model-path", "/no/such/model"), "no such model folder")


def test_port_in_use():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        _assert_one_line_error(_launch("--port", str(port)), f"--port {port}: already in use")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--kvsparse-full-layers", "40"], "--kvsparse-full-layers: layer 40 is outside the model"),
        (["--kvsparse-budget", "16"], "--kvsparse-budget: 16 is smaller than sink + window"),
        (["--kvsparse-config", '{"policy": "nope"}'], "unknown policy"),
        (["--kvsparse-preset", "off", "--kvsparse-budget", "512"], "has no effect while sparsity is off"),
        (["--kvsparse-request-policies", "span,lru"], "--kvsparse-request-policies: unknown policy 'lru'"),
    ],
)
def test_invalid_sparsity_option(args, expected):
    _assert_one_line_error(_launch(*args), expected)


#: Each launch imports SGLang (about 12 s on 2 cores): CI's tier launches one of each spelling (an
#: alias, a deprecated flag, a JSON setting), the extended tier every refused option (the unit tier
#: checks each option's rule, `tests/unit/test_option_support.py`).
EXTENDED = pytest.mark.extended


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--pipeline-parallel-size", "2"], "--pp-size 2: pipeline parallelism would split a column of sparse layers"),
        pytest.param(
            ["--tp-size", "2", "--attention-data-parallel-size", "2"],
            "--attn-dp-size 2: DP attention gives ranks",
            marks=EXTENDED,
        ),
        pytest.param(
            ["--dp-size", "2", "--enable-dp-attention"],
            "--enable-dp-attention: DP attention gives ranks",
            marks=EXTENDED,
        ),
        pytest.param(
            ["--tp-size", "2", "--dcp-size", "2"],
            "--dcp-size 2: decode context parallelism splits a request's",
            marks=EXTENDED,
        ),
        (["--enable-hicache"], "--enable-hierarchical-cache: copies the KV pool's rows to host memory"),
        pytest.param(
            ["--radix-cache-backend", "mine"],
            "--radix-cache-backend mine: replaces SGLang's radix tree",
            marks=EXTENDED,
        ),
        pytest.param(
            ["--enable-two-batch-overlap"],
            "--enable-two-batch-overlap: splits a batch into two micro-batches",
            marks=EXTENDED,
        ),
        (
            ["--cuda-graph-config", '{"prefill": {"backend": "breakable"}}'],
            "--cuda-graph-backend-prefill breakable (or in --cuda-graph-config): sparse layers run prefill graphs",
        ),
    ],
)
def test_an_sglang_option_the_sparse_layers_cannot_serve_is_refused_however_it_is_spelled(args, expected):
    """Read from what SGLang's parser and resolution make of the command line (aliases, deprecated
    flags, JSON settings alike), before any SGLang process starts."""
    _assert_one_line_error(_launch(*args), expected)


def test_the_metadata_glue_graph_is_refused():
    result = _launch(env={"SGLANG_ENABLE_METADATA_GLUE_GRAPH": "1"})
    _assert_one_line_error(result, "SGLANG_ENABLE_METADATA_GLUE_GRAPH=1: captures the attention backend's host")


def test_unknown_sglang_option():
    result = _launch("--no-such-option", "1", "--port", "0")
    _assert_one_line_error(result, "unrecognized arguments: --no-such-option 1")
    assert "usage:" not in result.stderr
