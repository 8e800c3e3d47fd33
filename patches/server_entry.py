"""Starting SGLang's HTTP server from the project's launcher (SGLang 0.5.23 internals).

Mirrors what ``python -m sglang.launch_server`` does (load plugins, parse, run, clean up the
process tree), with bad options reported in one line instead of SGLang's full usage text. With
sparsity enabled it also checks that the plugin applied and adds the ``/kvsparse/stats`` route.
"""

from __future__ import annotations

import argparse
import os
import sys

from sglang.launch_server import run_server
from sglang.srt.plugins import load_plugins
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang.srt.utils import kill_process_tree


class _OptionError(Exception):
    pass


class _QuietParser(argparse.ArgumentParser):
    def error(self, message: str):
        raise _OptionError(message)


def _option_error(argv: list[str]) -> str | None:
    """SGLang's verdict on the options (unknown names, bad choices), or None when they parse."""
    parser = _QuietParser(prog="sglang", add_help=False)
    ServerArgs.add_cli_args(parser)
    try:
        _, unknown = parser.parse_known_args(argv)
    except _OptionError as exc:
        return str(exc)
    if unknown:
        return f"unrecognized arguments: {' '.join(unknown)} (see --help)"
    return None


def serve(argv: list[str]) -> int:
    """Run SGLang's server with `argv` (already completed by the launcher) until it stops."""
    load_plugins()
    from sglang_kvsparse.patches import plugin

    try:
        plugin.verify_loaded()
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if plugin.configured() is not None:
        from sglang_kvsparse.patches.observability import add_route

        add_route()
    if "-h" not in argv and "--help" not in argv:
        problem = _option_error(argv)
        if problem is not None:
            print(f"error: {problem}", file=sys.stderr)
            return 2
    try:
        server_args = prepare_server_args(argv)
    except ValueError as exc:  # SGLang's own validation of an option's value
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0
