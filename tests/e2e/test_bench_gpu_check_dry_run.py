"""The lent GPU's one script (`bench/gpu_check.py`) runs end to end in its CPU dry-run mode, so it
is known to work before a GPU is available: the decode step's cost counted on the simulated
device (no host sync), the fixed-buffer (graph-replay) decode against the eager one, the
bandwidth step at one tiny case, and the
serving step, which runs where SGLang imports (the Llama-3.1-8B config shrunk to 4 layers and 2
KV heads with dummy weights and a placeholder tokenizer; stock SGLang and the sparse variant
started, measured at two concurrencies with SGLang's own client, stopped, and reported). Its
kernel step is the kernel benchmark's dry run, which the kernel tier runs
(`tests/kernels/test_bench_kernels_cpu.py`).

No speed is asserted (the numbers are the benchmark's output, not a target); only that every
step passed, every system produced rows with positive throughput in the JSON, the markdown and
the plot, and that no server process outlived the run. About three minutes: two server starts.
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
@pytest.mark.extended
def test_gpu_check_dry_run_passes_every_step_and_reports_every_system(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "gpu_check.py"),
            "--dry-run",
            "--steps",
            "step-cost,graph,bandwidth,serving",
            "--out-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

    [check_file] = tmp_path.glob("gpu-check-*-dry-run.json")
    check = json.loads(check_file.read_text())
    assert check["device"] == "CPU (dry run)"
    assert list(check["steps"]) == ["step-cost", "graph", "bandwidth", "serving"]
    assert all(step["ok"] for step in check["steps"].values())
    per_layer = check["steps"]["step-cost"]["per_layer"]
    assert set(per_layer) == {"1", "8", "64"} and all(row["syncs_per_step"] == 0 for row in per_layer.values())
    graph = check["steps"]["graph"]  # bfloat16 outputs within two roundings of the largest
    assert graph["bound"] == 2 * 2**-7 and graph["max_difference_of_largest_output"] <= graph["bound"]
    assert "| graph | yes |" in check_file.with_suffix(".md").read_text()
    assert check["steps"]["bandwidth"]["copy_gb_s"] > 0 and len(check["steps"]["bandwidth"]["decode"]) == 1

    [report_file] = tmp_path.glob("gpu-check-serving-dry-run-*.json")
    report = json.loads(report_file.read_text())
    assert "--tp-size" not in " ".join(report["settings"]["server_args"])
    systems = {system["name"]: system for system in report["systems"]}
    assert set(systems) == {"stock", "project-b1024"}
    for system in systems.values():
        assert system["error"] is None
        assert [run["concurrency"] for run in system["runs"]] == [1, 2]
        for row in system["runs"]:
            assert row["completed"] == row["num_prompts"]
            assert row["output_tok_s"] > 0 and row["total_tok_s"] > 0
            assert row["ttft_median_ms"] > 0
            assert row["peak_running"] >= 1
    assert {(r["system"], r["concurrency"]) for r in report["ratios"]} == {("project-b1024", c) for c in (1, 2)}

    markdown = report_file.with_suffix(".md").read_text()
    assert "| stock | 1 |" in markdown and "| project-b1024 | 2 |" in markdown
    assert report_file.with_suffix(".png").stat().st_size > 0

    # Every process of both servers carries a marker naming its log under tmp_path.
    assert processes_marked_under(tmp_path) == []
