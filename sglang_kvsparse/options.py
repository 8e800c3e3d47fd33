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

from sglang_kvsparse.config import PRESETS, SparsityConfig, SparsityConfigError, parse_config
from sglang_kvsparse.serving_defaults import LaunchError, ModelShape

#: Environment variable carrying the effective sparsity configuration (JSON) to every process.
CONFIG_ENV = "SGLANG_KVSPARSE_CONFIG"

#: Preset used when no sparsity option is given. It stays "off" until the sparse attention
#: backend is part of the build; the launcher prints it at start-up.
LAUNCHER_DEFAULT_PRESET = "off"


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


def sparsity_from_args(args: argparse.Namespace) -> SparsityConfig:
    """Build the configuration from parsed options (preset < JSON < short flags)."""
    nothing_given = all(
        getattr(args, name) is None
        for name in ("kvsparse_config", "kvsparse_preset", "kvsparse_full_layers",
                     "kvsparse_budget", "kvsparse_window")
    )
    preset = LAUNCHER_DEFAULT_PRESET if nothing_given else args.kvsparse_preset
    return parse_config(
        args.kvsparse_config,
        preset=preset,
        full_layers=args.kvsparse_full_layers,
        budget=args.kvsparse_budget,
        window=args.kvsparse_window,
    )


def validate_for_model(config: SparsityConfig, shape: ModelShape | None) -> None:
    """Check the configuration against the model (layer indices, budgets) and that it can run."""
    try:
        if shape is not None:
            config.resolve(shape.num_layers, shape.context_len)
    except SparsityConfigError as exc:
        raise LaunchError(str(exc)) from None
    if config.enabled:
        raise LaunchError(
            "layer-wise sparsity is configured, but this build has no sparse attention backend "
            "yet; only --kvsparse-preset off can be served for now"
        )


def export_to_processes(config: SparsityConfig) -> None:
    """Hand the configuration to every SGLang process, or clear it when sparsity is off."""
    if config.enabled:
        os.environ[CONFIG_ENV] = json.dumps(config.to_dict())
    else:
        os.environ.pop(CONFIG_ENV, None)
