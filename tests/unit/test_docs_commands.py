"""The commands and examples of the README and docs/config.md are ones the project takes: every
`make` target exists, every `--kvsparse-*` command line parses into a configuration (a file it
names is the page's JSON example), every JSON example is a configuration, and every request body
is JSON whose `custom_params` the server would accept. (The README's two opening commands run in
CI itself: `.ci/run` is `make test`; `make demo` is the demo script's.)"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from pathlib import Path

import pytest

from sglang_kvsparse.config import parse_config
from sglang_kvsparse.config.request_sparsity import parse_request
from sglang_kvsparse.server.options import add_sparsity_arguments, sparsity_from_args

ROOT = Path(__file__).resolve().parents[2]
PAGES = ("README.md", "docs/config.md")


def blocks(page: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", (ROOT / page).read_text(), re.S)


def commands(page: str) -> list[str]:
    """The page's shell commands, continuation lines joined, comments dropped."""
    text = "\n".join(blocks(page, "bash")).replace("\\\n", " ")
    return [line.split("  #")[0].strip() for line in text.splitlines() if line.strip()]


def test_every_make_target_exists():
    makefile = (ROOT / "Makefile").read_text()
    targets = [c.split()[1] for page in PAGES for c in commands(page) if c.startswith("make ")]
    assert targets
    for target in targets:
        assert re.search(rf"^{target}:", makefile, re.M), target


@pytest.mark.parametrize("page", PAGES)
def test_every_sparsity_command_line_parses(page, tmp_path):
    (tmp_path / "sparsity.json").write_text(blocks("docs/config.md", "json")[0])
    parser = argparse.ArgumentParser()
    add_sparsity_arguments(parser)
    lines = [c for c in commands(page) if "--kvsparse-" in c and "[" not in c]
    for line in lines:
        words = [w for w in shlex.split(line) if not w.startswith("#")]
        own = [w for i, w in enumerate(words) if w.startswith("--kvsparse-") or words[i - 1].startswith("--kvsparse-")]
        args, _ = parser.parse_known_args(own)
        if args.kvsparse_config == "sparsity.json":
            args.kvsparse_config = str(tmp_path / "sparsity.json")
        if line.endswith("1000000"):  # the page's example of a budget a request may not exceed
            continue
        sparsity_from_args(args)


def test_every_json_example_is_a_configuration():
    examples = blocks("docs/config.md", "json")
    assert examples
    for example in examples:
        parse_config(example)


@pytest.mark.parametrize("page", PAGES)
def test_every_request_body_is_one_the_server_takes(page):
    resolved = parse_config(None).resolve(30, 8192)
    bodies = [body for block in blocks(page, "bash") for body in re.findall(r" -d '(.*?)'", block, re.S)]
    assert bodies
    for body in bodies:
        request = json.loads(body)
        params = request.get("sampling_params", request).get("custom_params")
        parse_request(params, resolved)
