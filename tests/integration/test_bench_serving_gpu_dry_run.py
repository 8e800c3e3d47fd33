"""The GPU serving benchmark (profile gpu-novita) runs end to end in its CPU dry-run mode: the
Llama-3.1-8B config shrunk to 4 layers with dummy weights and a placeholder tokenizer, stock SGLang
and the first sparse variant (layers 0-2 full, budget 1,536; the dry run skips the others), each
started, measured at two concurrencies with SGLang's own client, stopped, and reported. So the script a lent GPU runs is
known to work before one is available.

No speed is asserted (the numbers are the benchmark's output, not a target); only that every
system produced rows with positive throughput in the JSON, the markdown and the plot, and that
no server process outlived the run. About two minutes: two server starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvsparse_testbed.server import processes_marked_under

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
def test_gpu_profile_dry_run_reports_every_system(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "serving.py"),
            "--profile",
            "gpu-novita",
            "--dry-run",
            "--out-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

    [report_file] = tmp_path.glob("gpu-novita-dry-run-*.json")
    report = json.loads(report_file.read_text())
    systems = {system["name"]: system for system in report["systems"]}
    assert set(systems) == {"stock", "project-b1536"}  # a dry run runs the first variant only
    for system in systems.values():
        assert system["error"] is None
        assert [run["concurrency"] for run in system["runs"]] == [1, 2]
        for row in system["runs"]:
            assert row["completed"] == row["num_prompts"]
            assert row["output_tok_s"] > 0 and row["total_tok_s"] > 0
            assert row["ttft_median_ms"] > 0
            assert row["peak_running"] >= 1
    assert {(r["system"], r["concurrency"]) for r in report["ratios"]} == {("project-b1536", c) for c in (1, 2)}

    markdown = report_file.with_suffix(".md").read_text()
    assert "| stock | 1 |" in markdown and "| project-b1536 | 2 |" in markdown
    assert report_file.with_suffix(".png").stat().st_size > 0

    # Every process of both servers carries a marker naming its log under tmp_path.
    assert processes_marked_under(tmp_path) == []
