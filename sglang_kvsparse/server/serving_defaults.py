"""Defaults and pre-flight checks shared by the launcher and the in-process engine.

SGLang on a machine with no GPU needs a few choices made for it (the CPU engine, an attention
backend that runs there, a bounded KV pool); the launcher and `sglang_kvsparse.Engine` make the
same ones, state them, and check the inputs that otherwise fail deep inside SGLang with a wall of
traceback (a missing model folder, a port already taken). Nothing here imports SGLang.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

#: KV pool size chosen on a CPU when none is given: without it SGLang sizes the pool from the
#: machine's memory (15 GB and a minute of start-up for the default model).
CPU_MAX_TOTAL_TOKENS = 16384

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"


class LaunchError(RuntimeError):
    """A bad launch input, reported as one line without a traceback."""


@dataclass(frozen=True)
class ModelShape:
    """What sparsity validation needs from a model's config.json."""

    num_layers: int
    context_len: int
    num_kv_heads: int
    head_dim: int
    #: The layers whose attention reads only the last `sliding_window` keys (`model_support`).
    sliding_layers: tuple[int, ...] = ()
    sliding_window: int = 0


def gpu_available() -> bool:
    """True when torch sees a CUDA device (the only accelerator SGLang's default path targets)."""
    import torch

    return torch.cuda.is_available()


def cpu_defaults(given: set[str]) -> dict[str, object]:
    """SGLang options to add on a CPU-only machine, for those the user did not give.

    `given` holds option names in SGLang's ``ServerArgs`` field spelling (``max_total_tokens``).
    ``True`` marks a switch (a flag without a value). ``sleep_on_idle``: an idle scheduler
    otherwise polls in a busy loop and keeps a whole core, which on a small machine slows every
    other process (a second server, the benchmark client) by as much.
    """
    wanted: dict[str, object] = {
        "device": "cpu",
        "attention_backend": "torch_native",
        "max_total_tokens": CPU_MAX_TOTAL_TOKENS,
        "sleep_on_idle": True,
    }
    return {name: value for name, value in wanted.items() if name not in given}


def as_cli_flags(options: dict[str, object]) -> list[str]:
    """``{"max_total_tokens": 8, "sleep_on_idle": True}`` as ``--max-total-tokens 8 --sleep-on-idle``."""
    flags: list[str] = []
    for name, value in options.items():
        flag = f"--{name.replace('_', '-')}"
        flags += [flag] if value is True else [flag, str(value)]
    return flags


def enable_cpu_engine() -> None:
    """Switch SGLang's CPU path on; must happen before SGLang is first imported."""
    os.environ[CPU_ENGINE_ENV] = "1"


def check_model_path(model_path: str) -> None:
    """Fail early and in one line when a local model folder does not exist.

    A Hugging Face hub id (``org/name``, not present locally) is passed through: SGLang fetches it
    where the hub is reachable (with sparsity on, `model_support.read_config` reads its config).
    """
    path = Path(model_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise LaunchError(f"--model-path {model_path}: no config.json in that folder")
        return
    looks_like_hub_id = model_path.count("/") == 1 and not model_path.startswith((".", "/", "~"))
    if not looks_like_hub_id:
        raise LaunchError(f"--model-path {model_path}: no such model folder")


def check_port_free(host: str, port: int) -> None:
    """Fail early when the HTTP port is taken (SGLang would fail minutes later, in a subprocess)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            raise LaunchError(f"--port {port}: already in use on {host} ({exc.strerror})") from None
