"""From the command line to one `SparsityConfig`: preset < `--kvsparse-config` JSON < short flags."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from typing import Any

from sglang_kvsparse.config.presets import DEFAULT_PRESET, PRESETS
from sglang_kvsparse.config.schema import (
    CONFIG_OPTION,
    FLAG_OF_FIELD,
    PRESET_OPTION,
    BudgetSpec,
    PyramidBudget,
    SparsityConfig,
    SparsityConfigError,
    is_int,
)
from sglang_kvsparse.policies import POLICIES, ScoringPolicy

JSON_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SparsityConfig) if f.name != "origins")

#: Keys that used to be top-level and are now a policy's knobs: a pointer beats "unknown key".
_POLICY_KNOBS = ("pool_kind", "pool_kernel")


def parse_config(
    json_or_path: str | None = None,
    *,
    preset: str | None = None,
    full_layers: str | Sequence[int] | None = None,
    budget: int | str | None = None,
    window: int | str | None = None,
    max_request_budget: int | str | None = None,
    request_settings: str | None = None,
    request_policies: str | None = None,
) -> SparsityConfig:
    """Build the config from a preset, then `--kvsparse-config` JSON, then short flags.

    json_or_path: inline JSON (the stripped text starts with '{') or a path to a JSON file; None
    for none. preset: a PRESETS name; None means DEFAULT_PRESET. full_layers: "0,1" (the flag's
    text; "" for none) or a sequence of ints. budget: sets the average budget: it replaces a
    uniform or explicit-list budget by a uniform one and keeps a pyramid's shape (min_ratio).
    request_settings: "on" or "off". request_policies: "snapkv,span" (the flag's text; "none"
    for none).
    Flags given as None are not set. Unknown JSON keys, bad types and invalid values raise
    SparsityConfigError naming the option. A flag, or a JSON key in a JSON without `enabled`,
    that sets a knob while the result is disabled is an error, so `--kvsparse-preset off
    --kvsparse-budget 512` cannot silently do nothing.
    """
    preset_name = DEFAULT_PRESET if preset is None else preset
    if preset_name not in PRESETS:
        raise SparsityConfigError(f"{PRESET_OPTION}: unknown preset {preset_name!r} (known: {', '.join(PRESETS)})")
    base = PRESETS[preset_name]
    values: dict[str, Any] = {name: getattr(base, name) for name in JSON_KEYS}
    origins = {name: f"{PRESET_OPTION} {preset_name} {name}" for name in JSON_KEYS}
    explicit: list[str] = []

    if json_or_path is not None:
        data = _load_json(json_or_path)
        for name, value in data.items():
            label = f"{CONFIG_OPTION} {name}"
            values[name] = _json_value(name, value, label)
            origins[name] = label
            # A JSON that states `enabled` describes itself completely (e.g. to_dict() output).
            if "enabled" not in data:
                explicit.append(label)

    flags = {
        "full_layers": full_layers,
        "budget": budget,
        "window": window,
        "max_request_budget": max_request_budget,
        "request_settings": request_settings,
        "request_policies": request_policies,
    }
    for name, raw in flags.items():
        if raw is None:
            continue
        label = FLAG_OF_FIELD[name]
        if name == "full_layers":
            values[name] = _parse_layer_list(raw, label)
        elif name == "budget":
            values[name] = _apply_budget_flag(values["budget"], _parse_flag_int(raw, label))
        elif name == "request_settings":
            values[name] = _parse_on_off(raw, label)
        elif name == "request_policies":
            values[name] = () if raw.strip() == "none" else tuple(part.strip() for part in raw.split(","))
        else:
            values[name] = _parse_flag_int(raw, label)
        origins[name] = label
        explicit.append(label)

    if not values["enabled"] and explicit:
        raise SparsityConfigError(
            f"{explicit[0]}: has no effect while sparsity is off (preset 'off' or enabled: false)"
        )
    return SparsityConfig(**values, origins=tuple(origins.items()))


def parse_policy(value: Any, label: str) -> ScoringPolicy:
    """A policy from its JSON form: a name (default knobs) or {"name": ..., knob: value, ...}."""
    spec = {"name": value} if isinstance(value, str) else value
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
        raise SparsityConfigError(f"{label}: expected a policy name or an object with a 'name', got {value!r}")
    options = {key: option for key, option in spec.items() if key != "name"}
    cls = POLICIES.get(spec["name"])
    if cls is None:
        raise SparsityConfigError(f"{label}: unknown policy {spec['name']!r} (known: {', '.join(sorted(POLICIES))})")
    try:
        return cls.from_options(options)
    except ValueError as exc:  # the policy's own message starts with the knob's name
        raise SparsityConfigError(f"{label}.{exc}") from None


def _load_json(json_or_path: str) -> dict[str, Any]:
    text = json_or_path.strip()
    if not text.startswith(("{", "[")):  # '[' only to report "expected a JSON object"
        if not os.path.isfile(json_or_path):
            raise SparsityConfigError(
                f"{CONFIG_OPTION}: no such file {json_or_path!r} (give a JSON file or inline JSON starting with '{{')"
            )
        with open(json_or_path, encoding="utf-8") as handle:
            text = handle.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SparsityConfigError(f"{CONFIG_OPTION}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SparsityConfigError(f"{CONFIG_OPTION}: expected a JSON object, got {type(data).__name__}")
    for key in data:
        if key in _POLICY_KNOBS:
            raise SparsityConfigError(
                f'{CONFIG_OPTION} {key}: a knob of the snapkv policy: {{"policy": {{"name": "snapkv", "{key}": ...}}}}'
            )
        if key not in JSON_KEYS:
            raise SparsityConfigError(f"{CONFIG_OPTION}: unknown key {key!r} (known: {', '.join(JSON_KEYS)})")
    return data


def _json_value(name: str, value: Any, label: str) -> Any:
    """Convert one JSON value to the field's Python form; SparsityConfig validates the rest."""
    if name == "full_layers":
        if not isinstance(value, list):
            raise SparsityConfigError(f"{label}: expected a list of layer ids, got {value!r}")
        return tuple(value)
    if name == "budget":
        return _json_budget(value, label)
    if name == "policy":
        return parse_policy(value, label)
    if name == "request_policies":
        if not isinstance(value, list):
            raise SparsityConfigError(f"{label}: expected a list of policy names, got {value!r}")
        return tuple(value)
    return value


def _json_budget(value: Any, label: str) -> BudgetSpec:
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, dict):
        if value.get("kind") != "pyramid":
            raise SparsityConfigError(f"{label}: unknown budget kind {value.get('kind')!r} (known: pyramid)")
        keys = set(value) - {"kind"}
        if keys != {"tokens", "min_ratio"}:
            raise SparsityConfigError(
                f"{label}: a pyramid budget needs exactly 'tokens' and 'min_ratio', got {sorted(keys)}"
            )
        return PyramidBudget(tokens=value["tokens"], min_ratio=value["min_ratio"])
    return value


def _parse_layer_list(raw: str | Sequence[int], label: str) -> tuple[int, ...]:
    """The flag's "0,1" text ("" = none) or a sequence, as a tuple; SparsityConfig validates it."""
    if not isinstance(raw, str):
        return tuple(raw)
    parts = [part.strip() for part in raw.split(",")] if raw.strip() else []
    try:
        return tuple(int(part) for part in parts)
    except ValueError:
        raise SparsityConfigError(f"{label}: expected comma-separated layer ids like 0,1, got {raw!r}") from None


def _parse_flag_int(raw: int | str, label: str) -> int:
    if is_int(raw):
        return raw  # type: ignore[return-value]
    try:
        return int(str(raw).strip())
    except ValueError:
        raise SparsityConfigError(f"{label}: expected an integer, got {raw!r}") from None


def _parse_on_off(raw: str, label: str) -> bool:
    if raw not in ("on", "off"):
        raise SparsityConfigError(f"{label}: expected on or off, got {raw!r}")
    return raw == "on"


def _apply_budget_flag(current: BudgetSpec, tokens: int) -> BudgetSpec:
    if isinstance(current, PyramidBudget):
        return PyramidBudget(tokens=tokens, min_ratio=current.min_ratio)
    return tokens
