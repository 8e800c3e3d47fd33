"""The ``--kvsparse-*`` options: parsing, validation against the model, hand-off to SGLang.

The launcher and the in-process engine both come through here. The validated configuration
reaches every SGLang process (the scheduler processes are spawned) through one environment
variable, read by the plugin (`sglang_kvsparse.patches.plugin`). When the variable is absent the
plugin does nothing, which is what makes plain ``python -m sglang.launch_server`` stock SGLang.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping

from sglang_kvsparse.config import PRESETS, SparsityConfig, SparsityConfigError, parse_config
from sglang_kvsparse.server.backends import backend_choices
from sglang_kvsparse.server.model_support import check_supported, model_shape, read_config
from sglang_kvsparse.server.option_support import option_problems
from sglang_kvsparse.server.serving_defaults import LaunchError, ModelShape

#: Environment variable carrying the effective sparsity configuration (JSON) to every process.
CONFIG_ENV = "SGLANG_KVSPARSE_CONFIG"

#: --mem-fraction-static for a sparse server on the CPU (see `sparse_sglang_defaults`).
CPU_SPARSE_MEM_FRACTION = 0.8

#: SGLang options a sparse server needs on a GPU: prefills run eagerly (SGLang's breakable prefill
#: graph captures its segments by running every layer's attention on a dummy batch of requests
#: the sparse state never admitted; `docs/experiments/2026-12-06-graph-policies.md`); decode
#: steps replay SGLang's full CUDA graphs (`patches/attention.py`, `decode_graph.py`).
GPU_SPARSE_OPTIONS: dict[str, object] = {"cuda_graph_backend_prefill": "disabled"}

#: Decode CUDA-graph backends the sparse layers serve; another given one is replaced by the first.
DECODE_GRAPH_BACKENDS: tuple[str, ...] = ("full", "disabled")

#: Preset used when no sparsity option is given (the launcher prints it at start-up): layers 0 and
#: 1 full, 1,024 entries in the others (config.PRESETS; docs/config.md says why).
LAUNCHER_DEFAULT_PRESET = "default"


def add_sparsity_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``--kvsparse-*`` options (documented in docs/config.md)."""
    group = parser.add_argument_group("layer-wise KV sparsity (sglang-kvsparse)")
    group.add_argument(
        "--kvsparse-config",
        metavar="JSON_OR_PATH",
        help="full sparsity configuration: inline JSON or a JSON file (schema: docs/config.md)",
    )
    group.add_argument(
        "--kvsparse-preset",
        choices=sorted(PRESETS),
        help=f"named recipe; 'off' is exactly stock SGLang (default: {LAUNCHER_DEFAULT_PRESET})",
    )
    group.add_argument("--kvsparse-full-layers", metavar="LIST", help="layers kept full, e.g. 0,1")
    group.add_argument("--kvsparse-budget", metavar="TOKENS", help="tokens kept per sparse layer")
    group.add_argument("--kvsparse-window", metavar="TOKENS", help="observation window (alpha)")
    group.add_argument(
        "--kvsparse-max-request-budget",
        metavar="TOKENS",
        help='largest budget one request may ask for (custom_params {"kvsparse": {"budget": N}})',
    )
    group.add_argument(
        "--kvsparse-request-settings",
        choices=("on", "off"),
        help="whether a request may give its own sparsity setting (default: on)",
    )
    group.add_argument(
        "--kvsparse-request-policies",
        metavar="LIST",
        help="policies a request may choose, e.g. snapkv,span, or none (default: all but h2o)",
    )


#: The sparsity options' names (as `argparse` and `sglang_kvsparse.Engine` spell them).
SPARSITY_OPTIONS = (
    "kvsparse_config",
    "kvsparse_preset",
    "kvsparse_full_layers",
    "kvsparse_budget",
    "kvsparse_window",
    "kvsparse_max_request_budget",
    "kvsparse_request_settings",
    "kvsparse_request_policies",
)


def sparsity_from_args(args: argparse.Namespace) -> SparsityConfig:
    """Build the configuration from parsed options (preset < JSON < short flags)."""
    nothing_given = all(getattr(args, name) is None for name in SPARSITY_OPTIONS)
    preset = LAUNCHER_DEFAULT_PRESET if nothing_given else args.kvsparse_preset
    return parse_config(
        args.kvsparse_config,
        preset=preset,
        full_layers=args.kvsparse_full_layers,
        budget=args.kvsparse_budget,
        window=args.kvsparse_window,
        max_request_budget=args.kvsparse_max_request_budget,
        request_settings=args.kvsparse_request_settings,
        request_policies=args.kvsparse_request_policies,
    )


def validate_for_model(config: SparsityConfig, shape: ModelShape) -> None:
    """Check the configuration against the model: layer indices inside it, budgets that fit."""
    try:
        config.resolve(shape.num_layers, shape.context_len, shape.sliding_layers, shape.sliding_window)
    except SparsityConfigError as exc:
        raise LaunchError(str(exc)) from None


def check_model(config: SparsityConfig, model_path: str) -> None:
    """With sparsity on: the model's config is read (a local folder or a hub id), the model is
    one the sparse layers can serve (`model_support`), and the configuration fits it."""
    if not config.enabled:
        return
    model_config = read_config(model_path)
    check_supported(model_path, model_config)
    validate_for_model(config, model_shape(model_config))


def check_sglang_options(config: SparsityConfig, values: Mapping[str, object]) -> None:
    """With sparsity on, refuse the SGLang options (`values`: `ServerArgs` field -> value) and
    environment switches the sparse layers cannot serve (`option_support`), in one line."""
    problems = option_problems(values, os.environ) if config.enabled else []
    if problems:
        raise LaunchError("kvsparse: " + "; ".join(problems))


def export_to_processes(config: SparsityConfig) -> None:
    """Hand the configuration to every SGLang process, or clear it when sparsity is off."""
    if config.enabled:
        os.environ[CONFIG_ENV] = json.dumps(config.to_dict())
    else:
        os.environ.pop(CONFIG_ENV, None)


def sparse_sglang_defaults(
    config: SparsityConfig, given: dict[str, object], *, cpu: bool
) -> tuple[dict[str, object], list[str]]:
    """(SGLang options a sparse server needs, given the ones the user set (field spelling); one
    line per choice made over the user's).

    Chunked prefill stays SGLang's to choose (sparse layers keep a chunked prompt's earlier chunks
    in the prefix store until its last), and so does the attention backend: the full layers run
    whichever MHA/GQA backend SGLang picks, an unset one included; a given one that cannot run
    beside the sparse layers is replaced by the nearest that can (`backends.backend_choices`).
    Overlap scheduling stays on where SGLang has it on: a step's allocation only changes the host
    tables, and everything that moves K/V (eviction, compaction, stores) is queued by the forward
    from the plan it builds, so the next step's allocation never races it. On the CPU, where
    --max-total-tokens bounds the KV pool anyway, a fixed --mem-fraction-static is given rather
    than SGLang's derivation, which reserves activations for a whole unchunked prompt when
    chunking is off. On a GPU, decode steps replay SGLang's full CUDA graphs, prefills run
    eagerly (`GPU_SPARSE_OPTIONS`); a breakable decode graph (which needs hooks the sparse layers
    do not implement) is replaced by a full one, in one line.
    """
    if not config.enabled:
        return {}, []
    chosen: dict[str, object] = {}
    if cpu and given.get("mem_fraction_static") is None:
        chosen["mem_fraction_static"] = CPU_SPARSE_MEM_FRACTION
    notes: list[str] = []
    if not cpu:
        chosen.update(GPU_SPARSE_OPTIONS)
        decode_graph = given.get("cuda_graph_backend_decode")
        if decode_graph is not None and decode_graph not in DECODE_GRAPH_BACKENDS:
            chosen["cuda_graph_backend_decode"] = DECODE_GRAPH_BACKENDS[0]
            notes.append(
                f"--cuda-graph-backend-decode {decode_graph} is not served with sparse layers: "
                f"using {DECODE_GRAPH_BACKENDS[0]}"
            )
    backends, backend_notes = backend_choices(given, cpu=cpu)
    chosen.update(backends)
    return chosen, notes + backend_notes
