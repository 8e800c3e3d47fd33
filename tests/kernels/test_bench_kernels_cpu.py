"""bench/kernels.py in its CPU mode: small checks under the interpreter, reports written."""

import json
import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def test_bench_dry_run_on_cpu(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, str(BENCH), "--dry-run", "--out-dir", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "timings here mean nothing" in proc.stdout
    (json_file,) = tmp_path.glob("kernels-*-cpu-interpreter.json")
    report = json.loads(json_file.read_text())
    assert report["gpu"] == "cpu-interpreter" and report["timings_meaningful"] is False
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    assert report["prefill"] and report["decode"] and report["evict"]
    assert json_file.with_suffix(".md").read_text().startswith("# Kernel benchmark: cpu-interpreter")


def test_bandwidth_bench_small_on_cpu(tmp_path):
    """bench/bandwidth.py's code path (the GPU check's bandwidth step) at one tiny case of each."""
    env = dict(os.environ, TRITON_INTERPRET="1", OPENBLAS_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    out = tmp_path / "bandwidth.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH.with_name("bandwidth.py")), "--small", "--json", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["copy_bandwidth"] > 0 and report["device"] == "cpu"
    (decode,) = report["decode"]
    assert decode["bytes"] > 0 and decode["ms"] > 0 and decode["sdpa_ms"] and decode["splits"] == 1
    (evict,) = report["evict"]
    assert 0 < evict["moved_entries"] <= evict["columns"] * evict["requests"] * evict["budget"] * evict["kv_heads"]
