"""``python -m sglang_kvsparse.launch_server``: SGLang's server with the kvsparse plugin.

Every ``sglang.launch_server`` argument passes through unchanged. On top of it:
- ``--kvsparse-*`` options (docs/config.md), validated against the model before SGLang starts,
  and a model the sparse layers would serve wrongly refused (`model_support.py`);
- no ``--model-path``: the embedded default model (SmolLM2-135M-Instruct) is served; an embedded
  model's short name (``--model-path gemma-3-270m``, `models.MODELS`) serves that one;
- no GPU: the CPU engine, the torch-native attention backend and a bounded KV pool are chosen,
  each one stated, and only where the user did not choose; with several ranks (`--tp-size`,
  `--dp-size`) each gets its share of the CPU cores (SGLang asks for one per rank);
- an SGLang option (`option_support.py`) the sparse layers cannot serve is refused before
  SGLang starts, from what SGLang's own parser and resolution make of the command line
  (`patches/server_entry.py`);
- bad input (missing model folder, port in use, invalid sparsity option) is one line, exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from sglang_kvsparse.config import SparsityConfigError
from sglang_kvsparse.models import ModelUnavailableError, ensure_default_model, resolve_model_path
from sglang_kvsparse.server.backends import BACKEND_OPTIONS
from sglang_kvsparse.server.options import (
    add_sparsity_arguments,
    check_model,
    export_to_processes,
    sparse_sglang_defaults,
    sparsity_from_args,
)
from sglang_kvsparse.server.parallelism import THREADS_BIND_ENV, binding_for_this_process
from sglang_kvsparse.server.serving_defaults import (
    LaunchError,
    as_cli_flags,
    check_model_path,
    check_port_free,
    cpu_defaults,
    enable_cpu_engine,
    gpu_available,
)

_PREFIX = "[sglang-kvsparse]"
_DEFAULT_HOST = "127.0.0.1"
_DEFAULT_PORT = 30000
_MODEL_OPTIONS = ("--model-path", "--model")


def _say(message: str) -> None:
    print(f"{_PREFIX} {message}", file=sys.stderr, flush=True)


def _own_parser() -> argparse.ArgumentParser:
    """The options this launcher reads itself; everything else is SGLang's."""
    parser = argparse.ArgumentParser(
        prog="python -m sglang_kvsparse.launch_server",
        description="SGLang server with layer-wise KV sparsity. Takes every sglang.launch_server option as well.",
        allow_abbrev=False,
        add_help=False,
    )
    add_sparsity_arguments(parser)
    # Read (not consumed) so that defaults and pre-flight checks see them.
    parser.add_argument("--model-path", "--model", dest="model_path")
    parser.add_argument("--host", default=_DEFAULT_HOST)
    parser.add_argument("--port", type=int, default=_DEFAULT_PORT)
    parser.add_argument("--mem-fraction-static", type=float)
    parser.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    parser.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    parser.add_argument("--pp-size", "--pipeline-parallel-size", dest="pp_size", type=int, default=1)
    parser.add_argument("--cuda-graph-backend-decode", dest="cuda_graph_backend_decode")
    for option in BACKEND_OPTIONS:
        parser.add_argument("--" + option.replace("_", "-"), dest=option)
    return parser


def _given_options(argv: list[str]) -> set[str]:
    """SGLang option names present on the command line, in ServerArgs field spelling."""
    names = set()
    for arg in argv:
        if arg.startswith("--"):
            names.add(arg[2:].split("=", 1)[0].replace("-", "_"))
    return names


def build_sglang_argv(argv: list[str]) -> list[str]:
    """Validate the launch and return SGLang's argv (defaults added, ``--kvsparse-*`` removed).

    Side effects, needed before SGLang is imported: the CPU engine switch and the sparsity
    configuration are put into the environment that every SGLang process inherits.
    """
    parser = _own_parser()
    own, _ = parser.parse_known_args(argv)
    sglang_argv = _strip_sparsity_options(argv, parser)

    if own.model_path is None:
        model_path = str(ensure_default_model(log=_say))
        sglang_argv = ["--model-path", model_path, *sglang_argv]
        _say(f"no --model-path: serving the embedded default model {model_path}")
    else:
        model_path = resolve_model_path(own.model_path, log=_say)
        if model_path != own.model_path:
            sglang_argv = _with_model_path(sglang_argv, model_path)
            _say(f"--model-path {own.model_path}: the embedded model {model_path}")
        check_model_path(model_path)

    check_port_free(own.host, own.port)

    try:
        config = sparsity_from_args(own)
    except SparsityConfigError as exc:
        raise LaunchError(str(exc)) from None
    check_model(config, model_path)
    export_to_processes(config)
    _say(f"sparsity: {config.describe()}")
    given = {
        name: getattr(own, name) for name in ("mem_fraction_static", "cuda_graph_backend_decode", *BACKEND_OPTIONS)
    }
    needed, notes = sparse_sglang_defaults(config, given, cpu=not gpu_available())
    sglang_argv += as_cli_flags(needed)
    for note in notes:
        _say(note)
    if config.enabled:
        added = " ".join(as_cli_flags(needed))
        _say(f"sparse layers: added {added or 'nothing'}")

    if not gpu_available():
        enable_cpu_engine()
        chosen = cpu_defaults(_given_options(sglang_argv))
        sglang_argv += as_cli_flags(chosen)
        if chosen:
            _say(f"no GPU found: running on the CPU with {' '.join(as_cli_flags(chosen))}")
        ranks = own.tp_size * own.dp_size * own.pp_size  # SGLang's world size: one process each
        if ranks > 1 and THREADS_BIND_ENV not in os.environ:
            try:
                os.environ[THREADS_BIND_ENV] = binding_for_this_process(ranks)
            except ValueError as exc:
                raise LaunchError(f"{ranks} ranks on the CPU: {exc}") from None
            _say(f"{ranks} ranks on the CPU: {THREADS_BIND_ENV}={os.environ[THREADS_BIND_ENV]} (cores per rank)")
    return sglang_argv


def _with_model_path(argv: list[str], model_path: str) -> list[str]:
    """`argv` with the value of its model option (`--model-path X`, `--model X`, `--model-path=X`)
    replaced by `model_path`."""
    out: list[str] = []
    for arg in argv:
        name = arg.split("=", 1)[0]
        if out and out[-1] in _MODEL_OPTIONS and "=" not in out[-1]:
            out.append(model_path)
        elif name in _MODEL_OPTIONS and "=" in arg:
            out.append(f"{name}={model_path}")
        else:
            out.append(arg)
    return out


def _strip_sparsity_options(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """Remove ``--kvsparse-*`` options (and their values) so SGLang never sees them."""
    takes_value = {
        option for action in parser._actions if action.dest.startswith("kvsparse_") for option in action.option_strings
    }
    kept: list[str] = []
    skip_next = False
    for arg in argv:
        if skip_next:
            skip_next = False
            continue
        name = arg.split("=", 1)[0]
        if name in takes_value:
            skip_next = "=" not in arg
            continue
        kept.append(arg)
    return kept


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "-h" in argv or "--help" in argv:
        _own_parser().print_help()
        print("\nSGLang's own options follow.\n")
    else:
        try:
            argv = build_sglang_argv(argv)
        except (LaunchError, ModelUnavailableError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2

    # SGLang is imported only now: the CPU engine switch must be set before its first import.
    from sglang_kvsparse.patches.server_entry import serve

    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
