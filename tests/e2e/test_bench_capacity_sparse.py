"""More requests fit: at the KV bytes of stock SGLang's pool, the sparse server runs at least 2.5x
as many 2,000-token requests at once (bench/capacity.py, profile sparse-2k, run end to end).

The pool holds two dense requests. Each sparse one holds a fifth of a dense request's bytes, but at
budget 256 its prefill is guided, and for that forward its new tokens wait in one heap row per
sparse column (`SparseState.guide_rows`: about one dense request's sparse layers), charged at
admission. So four run while a fifth prefills: 5 against stock's 2.

The counts are read from each server's own scheduler log (`#running-req`), the bytes per request
from the sparse server's `/kvsparse/stats`. No timing is asserted. About three minutes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.e2e
@pytest.mark.extended
def test_sparse_server_runs_two_and_a_half_times_the_requests_of_stock(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "capacity.py"), "--profile", "sparse-2k", "--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    [report_file] = tmp_path.glob("capacity-sparse-2k-*.json")
    report = json.loads(report_file.read_text())
    systems = {system["name"]: system for system in report["systems"]}
    for system in systems.values():
        assert system["error"] is None
        assert [(run["workload"], run["completed"]) for run in system["runs"]] == [
            ("2000", run["sent"]) for run in system["runs"]
        ]
    stock, sparse = systems["stock"]["runs"][0], systems["budget-256"]["runs"][0]
    assert stock["peak_running"] >= 1
    assert sparse["peak_running"] >= 2.5 * stock["peak_running"], (sparse["peak_running"], stock["peak_running"])
    assert sparse["ratio_to_stock"] == sparse["peak_running"] / stock["peak_running"]
    assert sparse["kv_bytes_source"].startswith("measured")
    [part] = report["workloads"][0]["parts"]
    dense_bytes = (part["input_len"] + part["output_len"]) * report["kv_bytes_per_token"]
    assert sparse["kv_bytes_per_request"] < 0.25 * dense_bytes
    per_layer = sparse["kv_bytes_per_request_per_layer"]
    assert per_layer["sparse"] < per_layer["full"] / 5  # 272 entries of a 2,032-token sequence
