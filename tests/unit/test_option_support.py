"""The table of SGLang options with sparse layers (`option_support.py`, `independent_options.py`):
each refused one in use gives its one line, at its default none does, each served one names a test
that exists, CUDA-graph backends are read from `--cuda-graph-config` before the per-phase flags,
and the metadata glue graph's switch is refused. That every option of SGLang's groups has a row:
tests/integration/test_option_groups.py."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from sglang_kvsparse.server.independent_options import INDEPENDENT
from sglang_kvsparse.server.option_support import (
    REFUSED,
    SERVED,
    checked_values,
    environment_refusals,
    graph_refusals,
    option_problems,
    refusals,
)

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


def test_no_option_is_in_two_parts_of_the_table_and_each_served_one_names_a_test():
    refused = {option.flag for option in REFUSED}
    assert len(refused) == len(REFUSED)
    assert not refused & set(SERVED) and not refused & set(INDEPENDENT) and not set(SERVED) & set(INDEPENDENT)
    for flag, test in SERVED.items():
        assert (ROOT / test).is_file(), (flag, test)


def test_the_user_guide_lists_every_option_of_the_table():
    guide = (ROOT / "docs" / "config.md").read_text()
    for flag in [option.flag for option in REFUSED] + list(SERVED):
        assert f"`{flag}" in guide, flag


def test_graph_backends_are_read_from_the_json_setting_before_the_per_phase_flags():
    assert graph_refusals({}) == []
    assert graph_refusals({"cuda_graph_backend_decode": "full", "cuda_graph_backend_prefill": "disabled"}) == []
    (line,) = graph_refusals({"cuda_graph_backend_prefill": "breakable"})
    assert line.startswith("--cuda-graph-backend-prefill breakable (or in --cuda-graph-config): ")
    json_wins = {"cuda_graph_config": {"decode": {"backend": "breakable"}}, "cuda_graph_backend_decode": "full"}
    (line,) = graph_refusals(json_wins)
    assert line.startswith("--cuda-graph-backend-decode breakable")
    resolved = {"cuda_graph_config": {"decode": {"backend": "full"}, "prefill": {"backend": "disabled"}}}
    assert graph_refusals(resolved) == []


def test_the_metadata_glue_graph_switch_is_refused_only_when_on():
    assert environment_refusals({}) == environment_refusals({"SGLANG_ENABLE_METADATA_GLUE_GRAPH": "0"}) == []
    for on in ("1", "true", "YES"):
        (line,) = environment_refusals({"SGLANG_ENABLE_METADATA_GLUE_GRAPH": on})
        assert line.startswith(f"SGLANG_ENABLE_METADATA_GLUE_GRAPH={on}: captures the attention backend's host")


def test_checked_values_come_from_the_resolved_record_when_there_is_one():
    class Resolved:
        attn_dp_size = 1  # the raw field; resolution moved --enable-dp-attention's width here

        def resolved_dict(self) -> dict:
            return {"attn_dp_size": 2, "tp_size": 2}

    values = checked_values(Resolved())
    assert values["attn_dp_size"] == 2 and "tp_size" not in values
    parsed = SimpleNamespace(attn_dp_size=1, enable_hierarchical_cache=True)
    assert checked_values(parsed)["enable_hierarchical_cache"] is True
    (line,) = option_problems(checked_values(Resolved()), {})
    assert line.startswith("--attn-dp-size 2: DP attention")
