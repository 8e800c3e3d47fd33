"""Sparsity config: presets, layering, validation messages, resolution, round trip."""

import json
import statistics

import pytest

from sglang_kvsparse.config import (
    DEFAULT_PRESET,
    PRESETS,
    PyramidBudget,
    SparsityConfig,
    SparsityConfigError,
    parse_config,
)
from sglang_kvsparse.policies import POLICIES, KeyNormPolicy, SnapKVPolicy, SpanPolicy, StreamingLLMPolicy

SMOL_LAYERS, SMOL_CONTEXT = 30, 8192


def error_of(**kwargs) -> str:
    with pytest.raises(SparsityConfigError) as info:
        parse_config(**kwargs).resolve(SMOL_LAYERS, SMOL_CONTEXT)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_no_flags_gives_default_preset():
    config = parse_config()
    assert config == PRESETS[DEFAULT_PRESET]
    assert config.enabled and config.full_layers == (0,) and config.budget == 1024
    assert "full layers 0;" in config.describe()


def test_off_resolves_all_full():
    resolved = parse_config(preset="off").resolve(SMOL_LAYERS, SMOL_CONTEXT)
    assert not resolved.enabled
    assert resolved.kinds == ("full",) * SMOL_LAYERS
    assert resolved.sparse_layers == ()
    assert "off" in PRESETS["off"].describe()


def test_default_resolution_on_smollm2():
    resolved = parse_config().resolve(SMOL_LAYERS, SMOL_CONTEXT)
    assert resolved.full_layers == (0,)
    assert resolved.sparse_layers == tuple(range(1, 30))
    assert resolved.budgets[:3] == (None, 1024, 1024)
    assert resolved.max_entries(5) == 1024 + 16
    assert resolved.max_entries(0) == SMOL_CONTEXT
    with pytest.raises(ValueError):
        resolved.budget(0)


def test_layering_preset_json_flags():
    config = parse_config('{"budget": 512, "window": 16, "sink": 8}', preset="snapkv", window=64, full_layers="3, 1")
    assert config.budget == 512  # JSON over preset
    assert config.sink == 8
    assert config.window == 64  # flag over JSON
    assert config.full_layers == (1, 3)  # sorted


def test_json_file(tmp_path):
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps({"full_layers": [0], "policy": "streamingllm"}))
    config = parse_config(str(path))
    assert config.full_layers == (0,) and config.policy == StreamingLLMPolicy()


def test_budget_flag_keeps_pyramid_shape_and_replaces_list():
    pyramid = parse_config(preset="pyramidkv", budget=512)
    assert pyramid.budget == PyramidBudget(512, PRESETS["pyramidkv"].budget.min_ratio)
    listed = parse_config('{"full_layers": [0], "budget": [100, 200]}', budget="300")
    assert listed.budget == 300


def test_pyramid_formula():
    config = SparsityConfig(budget=PyramidBudget(tokens=536, min_ratio=0.25), sink=4, window=32)
    budgets = config.resolve(num_layers=5, context_len=100_000).budgets
    # protected 36, selectable 500 -> s_max = 800, s_min = 200, step 150.
    assert budgets == (836, 686, 536, 386, 236)
    assert statistics.mean(budgets) == 536


def test_pyramid_properties_on_preset():
    budgets = PRESETS["pyramidkv"].resolve(SMOL_LAYERS, SMOL_CONTEXT).budgets
    assert list(budgets) == sorted(budgets, reverse=True)
    assert abs(statistics.mean(budgets) - 1024) < 1
    assert min(budgets) >= 36
    assert SparsityConfig(budget=PyramidBudget(500, 1.0)).resolve(4, 10_000).budgets == (500,) * 4
    assert SparsityConfig(budget=PyramidBudget(500, 0.1), full_layers=(0, 1, 2)).resolve(4, 10_000).budgets[3] == 500


def test_explicit_list_one_per_sparse_layer():
    config = parse_config('{"full_layers": [1], "budget": [100, 200, 300]}')
    resolved = config.resolve(num_layers=4, context_len=250)
    assert resolved.budgets == (100, None, 200, 250)  # clamped to the context length
    assert resolved.max_entries(2) == 216 and resolved.max_entries(3) == 250


def test_budget_at_or_above_context_keeps_everything():
    resolved = parse_config(budget=1_000_000).resolve(SMOL_LAYERS, SMOL_CONTEXT)
    assert all(resolved.max_entries(layer) == SMOL_CONTEXT for layer in range(SMOL_LAYERS))
    assert resolved.max_entries(10) == SMOL_CONTEXT


def test_all_layers_full_is_allowed():
    resolved = parse_config(full_layers=",".join(map(str, range(4)))).resolve(4, 128)
    assert resolved.enabled and resolved.sparse_layers == ()


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"full_layers": "0,40"}, "--kvsparse-full-layers: layer 40 is outside the model (30 layers: 0..29)"),
        ({"budget": 16}, "--kvsparse-budget: 16 is smaller than sink + window (4 + 16)"),
        ({"json_or_path": '{"budget": 16}'}, "--kvsparse-config budget: 16 is smaller than sink + window (4 + 16)"),
        ({"json_or_path": '{"policy": "foo"}'}, "--kvsparse-config policy: unknown policy 'foo' (known: "),
        (
            {"json_or_path": '{"policy": {"name": "snapkv", "pool_kernel": 4}}'},
            "--kvsparse-config policy.pool_kernel: must be odd, got 4",
        ),
        (
            {"json_or_path": '{"policy": {"name": "snapkv", "pool_kind": "min"}}'},
            "--kvsparse-config policy.pool_kind: unknown pool kind 'min'",
        ),
        (
            {"json_or_path": '{"policy": {"name": "keynorm", "pool_kernel": 3}}'},
            "--kvsparse-config policy.pool_kernel: unknown knob of policy 'keynorm'",
        ),
        (
            {"json_or_path": '{"policy": {"pool_kernel": 3}}'},
            "--kvsparse-config policy: expected a policy name or an object",
        ),
        ({"json_or_path": '{"pool_kernel": 4}'}, "--kvsparse-config pool_kernel: a knob of the snapkv policy"),
        ({"json_or_path": '{"sink": -1}'}, "--kvsparse-config sink: must be >= 0, got -1"),
        ({"window": "-3"}, "--kvsparse-window: must be >= 1, got -3"),
        ({"window": "x"}, "--kvsparse-window: expected an integer, got 'x'"),
        ({"json_or_path": '{"evict_page": 2.5}'}, "--kvsparse-config evict_page: expected an integer, got 2.5"),
        ({"json_or_path": '{"window": true}'}, "--kvsparse-config window: expected an integer, got True"),
        ({"full_layers": "1,1"}, "--kvsparse-full-layers: layer 1 is listed twice"),
        ({"full_layers": "-1"}, "--kvsparse-full-layers: must be >= 0, got -1"),
        ({"full_layers": "0;1"}, "--kvsparse-full-layers: expected comma-separated layer ids"),
        ({"json_or_path": '{"full_layers": 3}'}, "--kvsparse-config full_layers: expected a list of layer ids"),
        ({"json_or_path": '{"budgets": 3}'}, "--kvsparse-config: unknown key 'budgets' (known: "),
        ({"json_or_path": "[1]"}, "--kvsparse-config: expected a JSON object"),
        ({"json_or_path": "{oops"}, "--kvsparse-config: invalid JSON"),
        ({"json_or_path": "/no/such.json"}, "--kvsparse-config: no such file"),
        ({"json_or_path": '{"budget": [64, 64]}'}, "--kvsparse-config budget: 2 budgets given for 29 sparse layers"),
        ({"json_or_path": '{"budget": []}'}, "--kvsparse-config budget: the budget list is empty"),
        ({"json_or_path": '{"budget": {"kind": "cone"}}'}, "--kvsparse-config budget: unknown budget kind 'cone'"),
        (
            {"json_or_path": '{"budget": {"kind": "pyramid", "tokens": 512}}'},
            "--kvsparse-config budget: a pyramid budget needs exactly 'tokens' and 'min_ratio'",
        ),
        (
            {"json_or_path": '{"budget": {"kind": "pyramid", "tokens": 512, "min_ratio": 2}}'},
            "--kvsparse-config budget: pyramid min_ratio must be a number in [0, 1], got 2",
        ),
        ({"preset": "pyramidkv", "budget": 30}, "--kvsparse-budget: 30 is smaller than sink + window"),
        ({"preset": "h2o"}, "--kvsparse-preset: unknown preset 'h2o' (known: "),
        ({"preset": "off", "budget": 512}, "--kvsparse-budget: has no effect while sparsity is off"),
        ({"preset": "off", "json_or_path": '{"window": 8}'}, "--kvsparse-config window: has no effect"),
    ],
)
def test_errors_name_the_option(kwargs, expected):
    assert error_of(**kwargs).startswith(expected)


def test_preset_error_names_preset():
    # The preset's guide_from, left by a JSON that keeps only layer 0 sparse, names the preset.
    config = parse_config('{"full_layers": [1, 2, 3]}', preset="default")
    message = str(pytest.raises(SparsityConfigError, config.resolve, 4, 100).value)
    assert message == "--kvsparse-preset default guide_from: 0.33 of 4 layers starts at layer 1: no sparse layer there"


def test_bad_model_shape():
    with pytest.raises(SparsityConfigError):
        PRESETS["snapkv"].resolve(0, 100)
    with pytest.raises(SparsityConfigError):
        PRESETS["snapkv"].resolve(4, 0)


def test_direct_construction_is_validated_and_normalized():
    with pytest.raises(ValueError, match="pool_kernel: must be odd"):
        SnapKVPolicy(pool_kernel=4)
    with pytest.raises(ValueError, match="pool_kernel: expected an integer from 1 to 127, got 20001"):
        SnapKVPolicy(pool_kernel=20001)
    with pytest.raises(ValueError, match="long_follow: expected an integer from 0 to 256, got 1000000000000000000000"):
        SpanPolicy(long_follow=10**21)
    with pytest.raises(TypeError, match="reach"):  # removed: no measurement earned it
        SnapKVPolicy(reach=16)
    with pytest.raises(TypeError, match="sentence_from"):  # removed: sentences at every budget did as well
        SpanPolicy(sentence_from=0.07)
    with pytest.raises(ValueError, match="long_follow: expected an integer from 0 to 256"):
        SpanPolicy(long_follow=-2)
    with pytest.raises(ValueError, match=r"sentence: expected a number in \[0, 1\]"):
        SpanPolicy(sentence=1.5)
    with pytest.raises(SparsityConfigError, match="policy: expected a scoring policy"):
        SparsityConfig(policy="snapkv")
    config = SparsityConfig(full_layers=[3, 0], budget=[64, 128])
    assert config.full_layers == (0, 3) and config.budget == (64, 128)
    hash(config)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_to_dict_round_trips(name):
    config = PRESETS[name]
    data = config.to_dict()
    assert parse_config(json.dumps(data)) == config
    json.dumps(data)  # JSON-serializable


def test_round_trip_of_pyramid_and_list():
    for config in (
        SparsityConfig(budget=PyramidBudget(700, 0.5), policy=SnapKVPolicy(pool_kind="avg", pool_kernel=5)),
        SparsityConfig(full_layers=(0,), budget=(64, 128, 256), policy=KeyNormPolicy()),
    ):
        assert parse_config(json.dumps(config.to_dict())) == config


def test_known_policies_and_describe():
    assert {"snapkv", "streamingllm", "keynorm"} <= set(POLICIES)
    assert parse_config('{"policy": "streamingllm"}').policy == StreamingLLMPolicy()
    assert "snapkv (pool_kind max, pool_kernel 15)" in PRESETS["snapkv"].describe()
    assert "span (long_follow 40, sentence 0.5)" in PRESETS["default"].describe()
    assert "pyramid" in PRESETS["pyramidkv"].describe()
    assert "64..256" in SparsityConfig(full_layers=(0,), budget=(64, 256)).describe()
