"""Starting SGLang's HTTP server from the project's launcher (SGLang 0.5.23 internals).

Mirrors what ``python -m sglang.launch_server`` does (load plugins, parse, run, clean up the
process tree), with bad options reported in one line instead of SGLang's full usage text. With
sparsity enabled it also checks that the plugin applied, refuses the options the sparse layers
cannot serve (`option_support`) as SGLang parses and then resolves them, before any SGLang process
starts, adds the ``/kvsparse/stats`` route and answers a misplaced ``"kvsparse"`` key with a 400
(`validation.MisplacedSettingGuard`).
"""

from __future__ import annotations

import argparse
import os
import sys

from sglang.launch_server import run_server
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.srt.utils import kill_process_tree

from sglang_kvsparse.patches import plugin
from sglang_kvsparse.server.option_support import checked_values
from sglang_kvsparse.server.options import check_sglang_options
from sglang_kvsparse.server.serving_defaults import LaunchError


class _OptionError(Exception):
    pass


class _QuietParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _OptionError(message)


def _option_error(argv: list[str]) -> str | None:
    """SGLang's verdict on the options (unknown names, bad choices), else the sparse layers'
    (`option_support`: read from what SGLang's parser made of them, aliases included), or None."""
    parser = _QuietParser(prog="sglang", add_help=False)
    ServerArgs.add_cli_args(parser)
    try:
        parsed, unknown = parser.parse_known_args(argv)
    except _OptionError as exc:
        return str(exc)
    if unknown:
        return f"unrecognized arguments: {' '.join(unknown)} (see --help)"
    return _sparse_option_error(parsed)


def _sparse_option_error(server_args: object) -> str | None:
    """The sparse layers' one line on SGLang's parsed or resolved arguments, or None."""
    config = plugin.configured()
    if config is None:
        return None
    try:
        check_sglang_options(config, checked_values(server_args))
    except LaunchError as exc:
        return str(exc)
    return None


def serve(argv: list[str]) -> int:
    """Run SGLang's server with `argv` (already completed by the launcher) until it stops."""
    load_plugins()
    try:
        plugin.verify_loaded()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if plugin.configured() is not None:
        from sglang.srt.entrypoints import http_server

        from sglang_kvsparse.patches.observability import add_route
        from sglang_kvsparse.patches.validation import MisplacedSettingGuard

        add_route()
        http_server.app.add_middleware(MisplacedSettingGuard)
    if "-h" not in argv and "--help" not in argv:
        problem = _option_error(argv)
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    try:
        server_args = prepare_server_args(argv)
        server_args.resolve_once()  # as run_server would: what resolution derives is checked too
    except ValueError as exc:  # SGLang's own validation of an option's value
        print(f"error: {exc}", file=sys.stderr)
        return 2
    problem = _sparse_option_error(server_args)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0
