"""The long-output guard: prompts of the frozen long-output suite (`kvsparse_testbed.long_outputs`)
asked again of the "uncached" server (the default preset) for 1,024 new tokens at a request budget,
against what `bench/long_outputs.py` recorded for the default at that budget (`REPORT`): the task
score may not fall by more than `SLACK`, and the output may not loop where the recorded full
cache's output does not. Decode-time eviction runs about a thousand times per request here; a
change that evicts the wrong entries shows as a broken count or a loop. The numbers come from the
report, not from this file; the slack covers greedy outputs in other batches (float32 sums in
another order), which the report's second full-cache run measures."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from kvsparse_testbed.long_outputs import LONG_OUTPUT_SUITE, LOOP_EXCESS, loop_excess

pytestmark = [pytest.mark.e2e, pytest.mark.extended]

REPORT = Path(__file__).resolve().parents[2] / "bench" / "results" / "long-outputs-2026-12-06.json"
#: Prompt id -> the request budget it is asked at.
GUARD = {
    "long-s21-count-1024": 128,
    "long-s22-count-1024": 128,
    "long-s23-count-1024": 256,
}
SLACK = 0.1


def test_the_default_still_counts_without_loops_at_small_budgets(uncached_server, model_path):
    from transformers import AutoTokenizer

    recorded = json.loads(REPORT.read_text())
    assert recorded["suite"]["sha256"] == LONG_OUTPUT_SUITE.sha256
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = {p.prompt_id: p for p in LONG_OUTPUT_SUITE.prompts([1024])}

    def ask(prompt_id: str) -> dict:
        prompt, budget = prompts[prompt_id], GUARD[prompt_id]
        sampling = {
            "max_new_tokens": prompt.output_len,
            "temperature": 0,
            "ignore_eos": True,
            "custom_params": {"kvsparse": {"budget": budget}},
        }
        body = {"input_ids": tokenizer(prompt.text)["input_ids"], "sampling_params": sampling}
        response = requests.post(f"{uncached_server.url}/generate", json=body, timeout=1800)
        response.raise_for_status()
        return response.json()

    with ThreadPoolExecutor(len(GUARD)) as pool:
        outputs = dict(zip(GUARD, pool.map(ask, GUARD)))
    for prompt_id, got in outputs.items():
        budget, answers = GUARD[prompt_id], recorded["answers"][prompt_id]
        floor = answers[f"default@{budget}"]["score"] - SLACK
        assert prompts[prompt_id].score(got["text"]) >= floor, (prompt_id, budget, got["text"][:400])
        assert loop_excess(got["output_ids"], answers["full"]["output_ids"]) < LOOP_EXCESS, (prompt_id, budget)
