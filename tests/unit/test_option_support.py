"""The table of SGLang options with sparse layers (`option_support.py`): each refused one in use
gives its one line, at its default none does, and each served one names a test that exists."""

from __future__ import annotations

from pathlib import Path

import pytest

from sglang_kvsparse.server.option_support import REFUSED, SERVED, refusals

ROOT = Path(__file__).resolve().parents[2]


def test_hierarchical_cache_is_refused_in_one_line_naming_it():
    assert refusals({"enable_hierarchical_cache": True}) == [
        "--enable-hierarchical-cache: copies the KV pool's rows to host memory or storage page by page; the "
        "sparse columns' rows, their tables and the prefix store have no such copy (HiCache)"
    ]


@pytest.mark.parametrize("refused", REFUSED, ids=lambda option: option.flag)
def test_each_refused_option_is_refused_only_in_use(refused):
    for unused in (None, False, *refused.unused):
        assert refusals({refused.field: unused}) == []
    value = "eagle" if refused.takes_value else True
    (line,) = refusals({refused.field: value})
    assert line.startswith(f"{refused.flag} eagle: " if refused.takes_value else f"{refused.flag}: ")


def test_fp8_and_bf16_kv_caches_are_served_and_block_scaled_ones_refused():
    for served in ("auto", "fp8_e4m3", "fp8_e5m2", "bf16", "bfloat16"):
        assert refusals({"kv_cache_dtype": served}) == [], served
    for refused in ("mxfp8", "nvfp4", "fp4_e2m1"):
        (line,) = refusals({"kv_cache_dtype": refused})
        assert line.startswith(f"--kv-cache-dtype {refused}: ") and "block-scaled" in line


def test_defaults_and_unrelated_options_are_not_refused():
    assert refusals({"kv_cache_dtype": "auto", "disaggregation_mode": "null", "tp_size": 2, "page_size": 16}) == []


def test_no_option_is_both_served_and_refused_and_each_served_one_names_a_test():
    assert not {option.flag for option in REFUSED} & set(SERVED)
    for flag, test in SERVED.items():
        assert (ROOT / test).is_file(), (flag, test)


def test_the_user_guide_lists_every_option_of_the_table():
    guide = (ROOT / "docs" / "config.md").read_text()
    for flag in [option.flag for option in REFUSED] + list(SERVED):
        assert f"`{flag}" in guide, flag
