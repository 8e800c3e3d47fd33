"""The soak (`bench/soak.py`) at a small size against the shared "evicting" server (budget 256, a
KV pool small enough that SGLang retracts) with stock SGLang to compare: every request answered
or ended by its own client, the server healthy and back at rest, and no greedy request within the
budget differing from stock for a reason other than batch composition or a near-tie. The full
size (500 requests) is committed in `bench/results/soak-*.md`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.extended]

SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


def test_a_small_soak_loses_nothing_and_leaves_the_server_at_rest(evicting_server, stock_server, tmp_path):
    argv = ["--requests", "16", "--concurrency", "8", "--max-prompt-tokens", "1600", "--seed", "3"]
    argv += ["--url", evicting_server.url, "--stock-url", stock_server.url, "--out-dir", str(tmp_path)]
    run = subprocess.run([sys.executable, str(SOAK), *argv], capture_output=True, text=True, timeout=1200)
    reports = list(tmp_path.glob("soak-*.json"))
    assert len(reports) == 1, run.stderr[-3000:]
    report = json.loads(reports[0].read_text())
    soak = report["soak"]
    assert soak["not_sent"] == 0
    statuses = soak["outcomes"]["by_status"]
    assert "lost" not in statuses, soak["failures"]
    assert all(failure["message"] for failure in soak["failures"])  # an error says what it is
    assert statuses.get("ok", 0) >= soak["requests"] // 2
    assert soak["rest"]["idle_ok"] and soak["rest"]["flushed_ok"] and soak["rest"]["healthy"], soak["rest"]
    comparison = soak["comparison"]
    assert comparison["compared"] >= 3
    assert not [d for d in comparison["differences"] if d["cause"].startswith("differs alone")], comparison
    assert report["passed"] and run.returncode == 0
    assert "## Against stock SGLang" in reports[0].with_suffix(".md").read_text()
