"""The fidelity benchmark runs end to end through the server on one retrieval prompt, one
RULER-style prompt and one essay passage: the full cache and one sparse variant (with the span
policy) are started, asked, scored and reported (JSON, markdown, PNG); kvpress's committed answers
join where a report in bench/results covers the prompts (none covers these). About two minutes:
two server starts.

Teacher forcing is checked where its answer is known: forced on its own greedy continuation, the
full cache predicts every token of it (agreement 1), and every forced token was decoded.
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
def test_fidelity_runs_one_prompt_through_two_servers(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "fidelity.py"),
            "--limit",
            "1",
            "--budgets",
            "256",
            "--variants",
            "span",
            "--lm-context-lens",
            "600",
            "--lm-passages",
            "1",
            "--lm-continuation",
            "32",
            "--all-prompts",  # the sparse server answers whatever the full caches do
            "--out-dir",
            str(tmp_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    [report_file] = tmp_path.glob("fidelity-*.json")
    report = json.loads(report_file.read_text())
    assert [s["name"] for s in report["systems"]] == ["full", "span-256"]
    assert report["ruler_prompt_ids"] == ["ruler-multikey-2000-0"]
    for system in report["systems"]:
        assert system["error"] is None
        for prompt_id in (report["prompt_ids"][0], "ruler-multikey-2000-0"):
            answer = system["answers"][prompt_id]
            assert answer["prompt_tokens"] > 2000 and answer["output"]
    if report["accuracy"]["solved_by_both_full_caches"]:  # the full caches' verdicts are data
        assert report["accuracy"]["rows"]["project span"]["256"]["evaluated"] == 1
    if report["ruler_accuracy"]["solved_by_both_full_caches"]:
        assert report["ruler_accuracy"]["rows"]["project span"]["256"]["evaluated"] == 1
    lm = {row["system"]: row for row in report["language_model"]["rows"]}
    assert lm["full"]["agreement_with_full"] == 1.0 and lm["full"]["tokens"] == 32
    assert lm["span-256"]["tokens"] == 32 and 0 <= lm["span-256"]["agreement_with_full"] <= 1
    assert lm["full"]["perplexity"] > 1 and lm["span-256"]["perplexity"] > 1
    markdown = report_file.with_suffix(".md").read_text()
    assert markdown.startswith("# Fidelity through the server") and "## Harder retrieval (RULER-style)" in markdown
    assert report_file.with_suffix(".png").stat().st_size > 0
