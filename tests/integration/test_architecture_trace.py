"""The request trace in docs/architecture.md names code that exists, so the page cannot go stale
silently: every SGLang caller (relative to `sglang.srt`) and every hook and project function
(relative to `sglang_kvsparse`) written as a dotted name in its table resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sglang_kvsparse.patches.hooks import resolve

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def trace_rows() -> list[list[str]]:
    text = DOC.read_text()
    table = text[text.index("| step | SGLang caller |") :].split("\n\n")[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]


def dotted(cell: str) -> list[str]:
    return [name for name in re.findall(r"`([^`]+)`", cell) if re.fullmatch(r"[A-Za-z_][\w.]*\.[\w.]+", name)]


def test_the_trace_covers_a_requests_life():
    steps = [row[0] for row in trace_rows()]
    for step in (
        "admission",
        "prefix match",
        "forward metadata",
        "prefill and compression",
        "decode",
        "finish, abort, retraction",
    ):
        assert step in steps, step


def test_every_name_in_the_trace_resolves():
    checked = 0
    for step, caller, hook, function, _data in trace_rows():
        for name in dotted(caller):
            assert resolve(f"sglang.srt.{name}") is not None, (step, name)
            checked += 1
        for name in dotted(hook) + dotted(function):
            assert resolve(f"sglang_kvsparse.{name}") is not None, (step, name)
            checked += 1
    assert checked > 30


def test_a_stale_name_would_fail():
    with pytest.raises((AttributeError, ModuleNotFoundError)):
        resolve("sglang_kvsparse.state.sparse_state.SparseState.plan_decode")
