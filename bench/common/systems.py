"""The two systems every benchmark compares, launched the same way but for sparsity.

Stock SGLang is ``python -m sglang.launch_server``; the project is
``python -m sglang_kvsparse.launch_server`` plus ``--kvsparse-*`` flags. Both get the same shared
arguments (model, dtype, KV pool, CPU flags), built here once, so no benchmark can let them drift
apart.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil

from common.models import default_model, prepare_dummy_model
from kvsparse_testbed.server import ServerProcess, free_port
from sglang_kvsparse.models import MODELS, ensure_model
from sglang_kvsparse.server.options import CONFIG_ENV
from sglang_kvsparse.server.parallelism import THREADS_BIND_ENV, binding_for_this_process
from sglang_kvsparse.server.serving_defaults import gpu_available

STOCK = "stock"
LAUNCHERS = {
    "stock": ("sglang.launch_server", "python -m sglang.launch_server"),
    "project": ("sglang_kvsparse.launch_server", "python -m sglang_kvsparse.launch_server"),
}


@dataclass(frozen=True)
class ServerSettings:
    """What both systems share. ``model``: ``"default"``, another embedded model's name
    (`sglang_kvsparse.models.MODELS`, real weights) or a folder name under bench/models (served
    with dummy weights). ``device``: ``"cpu"``, ``"gpu"`` or ``"auto"``."""

    model: str
    device: str
    dtype: str
    max_total_tokens: int | None
    mem_fraction_static: float | None
    decode_log_interval: int
    startup_timeout_s: float
    shape: str = "full"  # a dummy model's shape: common.models.SHAPES
    tp_size: int = 1  # both systems' --tp-size
    kv_cache_dtype: str | None = None  # --kv-cache-dtype (None: the model's dtype)
    chunked_prefill_size: int | None = None  # --chunked-prefill-size (None: SGLang's for the device)

    @property
    def on_gpu(self) -> bool:
        return self.device == "gpu" or (self.device == "auto" and gpu_available())


def prepare_model(settings: ServerSettings, work_dir: Path) -> tuple[Path, list[str]]:
    """The model folder and the load arguments it needs."""
    if settings.model == "default":
        return default_model(), []
    if settings.model in MODELS:
        return ensure_model(settings.model), []
    folder = prepare_dummy_model(settings.model, work_dir / "model", shape=settings.shape)
    return folder, ["--load-format", "dummy"]


def shared_server_args(settings: ServerSettings, model_dir: Path, load_args: list[str]) -> list[str]:
    """Arguments both systems get, so that they differ only in sparsity.

    ``--decode-log-interval`` sets how often the scheduler logs ``#running-req``; the peak of
    running requests is read from those lines.
    """
    args = [
        "--model-path",
        str(model_dir),
        *load_args,
        "--dtype",
        settings.dtype,
        "--decode-log-interval",
        str(settings.decode_log_interval),
    ]
    if settings.max_total_tokens is not None:
        args += ["--max-total-tokens", str(settings.max_total_tokens)]
    if settings.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(settings.mem_fraction_static)]
    if settings.tp_size != 1:
        args += ["--tp-size", str(settings.tp_size)]
    if settings.kv_cache_dtype is not None:
        args += ["--kv-cache-dtype", settings.kv_cache_dtype]
    if settings.chunked_prefill_size is not None:
        args += ["--chunked-prefill-size", str(settings.chunked_prefill_size)]

    if not settings.on_gpu:
        args += ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
    return args


def args_for_report(shared: list[str], model_dir: Path) -> list[str]:
    """Shared arguments with the model folder shown by name (its path is machine-specific)."""
    return [arg if arg != str(model_dir) else f"<{model_dir.name}>" for arg in shared]


def launcher_of(name: str, stock: bool | None = None) -> str:
    """The command a system runs, for reports (`stock`: stock SGLang; default: by the name)."""
    return LAUNCHERS["stock" if (name == STOCK if stock is None else stock) else "project"][1]


def server_for(
    name: str,
    flags: tuple[str, ...],
    shared: list[str],
    settings: ServerSettings,
    log_dir: Path,
    progress: Callable[[str], None],
    stock: bool | None = None,
) -> ServerProcess:
    """Stock SGLang (`stock`; default: ``name == STOCK``) or the project's launcher with ``flags``."""
    stock = name == STOCK if stock is None else stock
    port = free_port()
    # The plugin is installed for every SGLang process; without its variable it does nothing.
    env = {k: v for k, v in os.environ.items() if k != CONFIG_ENV}
    module = LAUNCHERS["stock" if stock else "project"][0]
    if stock and not settings.on_gpu:
        env["SGLANG_USE_CPU_ENGINE"] = "1"  # the project's launcher sets both itself
        if settings.tp_size > 1:
            env.setdefault(THREADS_BIND_ENV, binding_for_this_process(settings.tp_size))
    extra = [] if stock else list(flags)
    command = [sys.executable, "-m", module, *shared, "--host", "127.0.0.1", "--port", str(port), *extra]
    return ServerProcess(
        name=name,
        command=command,
        env=env,
        port=port,
        log_path=log_dir / f"server-{name}.log",
        startup_timeout_s=settings.startup_timeout_s,
        progress=progress,
    )


def machine() -> str:
    """The machine, in words, for reports."""
    cpu = f"{psutil.cpu_count()} CPU cores, {psutil.virtual_memory().total / 2**30:.0f} GiB"
    if gpu_available():
        import torch

        return f"{torch.cuda.get_device_name(0)}, {cpu}"
    return f"{platform.machine()} {cpu_model()}, {cpu}, no GPU"


def cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's model and widest vector extension: the test bed's float32 matrix kernels differ
    with them, so a greedy output that hinges on one rounding can differ between machines."""
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return platform.processor() or "CPU"
    fields = {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in lines if ":" in line)}
    flags = set(fields.get("flags", "").split())
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{fields.get('model name', 'CPU')} ({vector})"
