"""The selection probe runs on one RULER prompt at one budget and reports, for per-layer and
guided selection, the answer, the answer tokens every sparse layer kept per KV head and each
hidden fact's share kept (the asked one marked). Guided,
every sparse layer keeps the same set in every head (one guide for all); per-layer, the layers
differ. About a minute: Hugging Face transformers on the CPU, no server.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_kvsparse.config import PRESETS

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "ruler-multikey-2000-1"


@pytest.mark.extended
def test_the_probe_reports_kept_answer_tokens_per_layer_and_head(tmp_path: Path) -> None:
    run = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "selection_probe.py"), "--prompts", PROMPT, "--budgets", "128"]
        + ["--out-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    [report_file] = tmp_path.glob("selection-probe-*.json")
    report = json.loads(report_file.read_text())
    assert report["settings"]["guide_layers"] == list(range(10, 30))  # 0.33 of SmolLM2's 30 layers
    result = report["prompts"][PROMPT]
    assert set(result["runs"]) == {"per-layer-128", "guided-128"}
    sparse = [str(layer) for layer in range(30) if layer not in PRESETS["default"].full_layers]  # SmolLM2's 30
    guided = result["runs"]["guided-128"]["answer_tokens_kept"]
    per_layer = result["runs"]["per-layer-128"]["answer_tokens_kept"]
    assert list(guided) == sparse and list(per_layer) == sparse
    assert len({tuple(heads) for heads in guided.values()}) == 1 and len(set(guided[sparse[0]])) == 1
    assert len({tuple(heads) for heads in per_layer.values()}) > 1
    for run_result in result["runs"].values():
        assert run_result["output"]
        facts = run_result["facts_kept"]
        assert len(facts) == 4 and sum(fact["asked"] for fact in facts) == 1  # look-alikes, one asked
        assert all(0 <= fact["kept"] <= 1 for fact in facts)
        [asked] = [fact["kept"] for fact in facts if fact["asked"]]
        answer_kept = any(n for heads in run_result["answer_tokens_kept"].values() for n in heads)
        assert (asked > 0) == answer_kept  # the answer is inside the asked fact's sentence
    assert (tmp_path / report_file.name.replace(".json", ".md")).is_file()
