"""A prefill of the sparse layers as a GPU pays for it (`bench/prefill_cost.py`, on the simulated
device): the counted prefill is real (each request keeps what its budget allows), every launch and
sync is attributed to a place in the product, and no sparse layer waits for the device, whether a
layer keeps by its own scores or by the guide, one prompt or several."""

import dataclasses
import importlib
import sys
from pathlib import Path

import pytest

from sglang_kvsparse.policies import SpanPolicy

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))  # bench/ is a folder of scripts that import their siblings as `common.*`
try:
    prefill_cost = importlib.import_module("prefill_cost")
    step_cost = importlib.import_module("step_cost")
finally:
    sys.path.remove(str(BENCH))


@pytest.mark.parametrize("case", prefill_cost.SMALL_CASES, ids=lambda case: case.label)
def test_a_prefill_keeps_each_requests_budget_and_its_layers_wait_for_nothing(case):
    config = prefill_cost.SMALL_CONFIG
    row = prefill_cost.measure(case, step_cost.SMALL_SHAPE, config)
    assert row["syncs"]["layers"] == 0, row["sync_sources"]
    assert row["kept"] == [[min(prompt, config.budget)] for prompt in case.prompts]
    for key, sources in (("launches", "launch_sources"), ("syncs", "sync_sources")):
        for section in prefill_cost.SECTIONS:
            assert sum(row[sources].get(section, {}).values()) == row[key][section], (key, section)
    assert row["launches"]["layers"] > 0 and row["host_ops"]["layers"] >= row["launches"]["layers"]
    assert "outside the product" not in str(row["launch_sources"])


def test_spans_launches_do_not_grow_with_its_follow():
    """`span`'s peaks and spread are sliding maxima over the requests laid out as rows: a follow
    five times longer costs the sparse layers no more launches (each doubling of it cost a few)."""
    case = prefill_cost.SMALL_CASES[1]
    launches = [
        prefill_cost.measure(case, step_cost.SMALL_SHAPE, dataclasses.replace(prefill_cost.SMALL_CONFIG, policy=policy))
        for policy in (SpanPolicy(long_follow=8), SpanPolicy(long_follow=40))
    ]
    assert launches[0]["kept"] == launches[1]["kept"]
    assert launches[0]["launches"]["layers"] == launches[1]["launches"]["layers"]


def test_the_report_shows_every_case():
    small = step_cost.SMALL_SHAPE, prefill_cost.SMALL_CONFIG
    rows = [prefill_cost.measure(case, *small) for case in prefill_cost.SMALL_CASES]
    report = {
        "date": "2026-12-07",
        "device": "simulated",
        "provenance": {"commit": "0" * 40, "dirty": False, "command": ["bench/prefill_cost.py", "--small"]},
        "settings": {"shape": "small", "sparse_layers": 4, "budget": 40},
        "cases": rows,
    }
    text = prefill_cost.markdown(report)
    assert all(f"| {case.label} |" in text for case in prefill_cost.SMALL_CASES)
