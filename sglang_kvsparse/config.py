"""Sparsity configuration: schema, presets, parsing, validation and per-model resolution.

A `SparsityConfig` is model-independent and validated when constructed (every field and every
cross-field rule that does not need the model). `SparsityConfig.resolve(num_layers, context_len)`
checks it against a model and returns a `ResolvedSparsity`: per layer, full or sparse and the
budget. Every validation failure raises `SparsityConfigError` whose message is one line that
starts with the option the bad value came from (`--kvsparse-budget`, `--kvsparse-config budget`,
`--kvsparse-preset pyramidkv budget`, ...), so a user knows what to change.

Layering in `parse_config`: preset < JSON (`--kvsparse-config`) < short flags. The JSON schema and
examples are in docs/config.md; `SparsityConfig.to_dict()` produces that same schema, so its
output can be fed back as `--kvsparse-config`.

This module must not import SGLang: it is unit-tested in milliseconds.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Union

#: Scoring policies the project knows by name. Extend this when a policy is implemented.
KNOWN_POLICIES: frozenset[str] = frozenset({"snapkv", "streamingllm", "keynorm"})

#: Pooling applied to per-key scores before top-k selection.
POOL_KINDS: tuple[str, ...] = ("max", "avg")

#: Preset used when neither a preset, a JSON config nor a flag is given.
DEFAULT_PRESET = "default"

# Option labels used in error messages. Fields with a short flag are named by the flag when the
# value came from it; otherwise by where it came from (JSON or preset) plus the JSON key.
_CONFIG_OPTION = "--kvsparse-config"
_PRESET_OPTION = "--kvsparse-preset"
_FLAG_OF_FIELD: dict[str, str] = {
    "full_layers": "--kvsparse-full-layers",
    "budget": "--kvsparse-budget",
    "window": "--kvsparse-window",
}

LayerKind = Literal["full", "sparse"]


class SparsityConfigError(ValueError):
    """An invalid sparsity setting. The message is one line naming the option at fault."""


def _spec_tokens(spec: int | PyramidBudget) -> int:
    return spec.tokens if isinstance(spec, PyramidBudget) else spec


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _first_duplicate(values: Sequence[Any]) -> Any | None:
    seen = set()
    for value in values:
        if value in seen:
            return value
        seen.add(value)
    return None


@dataclass(frozen=True)
class PyramidBudget:
    """PyramidKV-style budgets: linearly decreasing over the sparse layers, average `tokens`.

    The always-kept entries P = sink + window are outside the pyramid (as in PyramidKV, whose
    pyramid covers the capacity minus the observation window). With S sparse layers in layer
    order i = 0..S-1, selectable part s = tokens - P and r = min_ratio:

        s_max = 2 * s / (1 + r)        s_min = r * s_max
        budget_i = P + round(s_max - (s_max - s_min) * i / (S - 1))     (S = 1: budget_0 = tokens)

    so the first sparse layer keeps the most, the last the fewest (never fewer than P), and the
    mean budget is `tokens` up to rounding. r = 1 is a uniform budget; PyramidKV's beta = 20
    corresponds to r = 1 / (2 * beta - 1) ~ 0.026.
    """

    tokens: int
    min_ratio: float

    def layer_budgets(self, num_sparse: int, protected: int) -> tuple[int, ...]:
        """Budgets of `num_sparse` sparse layers in layer order; `protected` = sink + window."""
        if num_sparse == 1:
            return (self.tokens,)
        s_max = 2 * (self.tokens - protected) / (1 + self.min_ratio)
        step = (s_max - self.min_ratio * s_max) / (num_sparse - 1)
        return tuple(protected + round(s_max - step * i) for i in range(num_sparse))


#: A budget spec: uniform tokens per sparse layer, a pyramid, or one budget per sparse layer
#: in layer order.
BudgetSpec = Union[int, PyramidBudget, tuple[int, ...]]


@dataclass(frozen=True)
class SparsityConfig:
    """Which layers stay full and how much the others keep. Validated on construction.

    Fields (JSON keys are the same names; see docs/config.md):
      enabled      False means the plugin changes nothing (preset `off`); other fields are ignored.
      full_layers  layer ids that keep every token (sorted, unique).
      budget       entries kept per sparse layer after prefill and after each eviction: an int,
                   a `PyramidBudget`, or a tuple with one int per sparse layer in layer order.
                   Includes the protected sink + window entries, so it must be >= sink + window.
      sink         first prompt tokens always kept (attention sinks).
      window       observation window alpha: the last prompt tokens, always kept; their queries
                   score the other keys at prefill.
      pool_kind    'max' or 'avg' pooling of scores along the key axis before selection.
      pool_kernel  odd pooling width (1 = no pooling).
      evict_page   decode eviction granularity in tokens: a sparse layer that holds
                   budget + evict_page entries evicts evict_page of them, back to budget.
      policy       scoring policy name, one of KNOWN_POLICIES.
    """

    enabled: bool = True
    full_layers: tuple[int, ...] = ()
    budget: BudgetSpec = 1024
    sink: int = 4
    window: int = 32
    pool_kind: str = "max"
    pool_kernel: int = 15
    evict_page: int = 16
    policy: str = "snapkv"
    # Where each field's value came from, for error messages: ((field, option label), ...).
    origins: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples (the config is hashable);
        # full layers are stored sorted.
        if isinstance(self.budget, list):
            object.__setattr__(self, "budget", tuple(self.budget))
        if isinstance(self.full_layers, (list, tuple)):
            layers = tuple(self.full_layers)
            if all(_is_int(layer) for layer in layers):
                layers = tuple(sorted(layers))
            object.__setattr__(self, "full_layers", layers)
        self._validate_fields()
        self._validate_budget_covers_protected()

    # -- validation ------------------------------------------------------------------------
    def option(self, name: str) -> str:
        """The option label for field `name` used in error messages."""
        label = dict(self.origins).get(name)
        if label is not None:
            return label
        return _FLAG_OF_FIELD.get(name, f"{_CONFIG_OPTION} {name}")

    def _fail(self, name: str, problem: str) -> SparsityConfigError:
        return SparsityConfigError(f"{self.option(name)}: {problem}")

    def _check_int(self, name: str, value: Any, minimum: int) -> None:
        if not _is_int(value):
            raise self._fail(name, f"expected an integer, got {value!r}")
        if value < minimum:
            raise self._fail(name, f"must be >= {minimum}, got {value}")

    def _validate_fields(self) -> None:
        if not isinstance(self.enabled, bool):
            raise self._fail("enabled", f"expected true or false, got {self.enabled!r}")
        if not isinstance(self.full_layers, tuple):
            raise self._fail("full_layers", f"expected a list of layer ids, got {self.full_layers!r}")
        for layer in self.full_layers:
            self._check_int("full_layers", layer, 0)
        dup = _first_duplicate(self.full_layers)
        if dup is not None:
            raise self._fail("full_layers", f"layer {dup} is listed twice")
        self._check_int("sink", self.sink, 0)
        self._check_int("window", self.window, 1)
        self._check_int("evict_page", self.evict_page, 1)
        self._check_int("pool_kernel", self.pool_kernel, 1)
        if self.pool_kernel % 2 == 0:
            raise self._fail("pool_kernel", f"must be odd, got {self.pool_kernel}")
        if self.pool_kind not in POOL_KINDS:
            raise self._fail("pool_kind", f"unknown pool kind {self.pool_kind!r} (known: {', '.join(POOL_KINDS)})")
        if self.policy not in KNOWN_POLICIES:
            known = ", ".join(sorted(KNOWN_POLICIES))
            raise self._fail("policy", f"unknown policy {self.policy!r} (known: {known})")
        self._validate_budget_shape()

    def _validate_budget_shape(self) -> None:
        budget = self.budget
        if isinstance(budget, PyramidBudget):
            self._check_int("budget", budget.tokens, 1)
            ratio = budget.min_ratio
            if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
                raise self._fail("budget", f"pyramid min_ratio must be a number in [0, 1], got {ratio!r}")
        elif isinstance(budget, tuple):
            if not budget:
                raise self._fail("budget", "the budget list is empty")
            for value in budget:
                self._check_int("budget", value, 1)
        else:
            self._check_int("budget", budget, 1)

    def _validate_budget_covers_protected(self) -> None:
        smallest = min(self.budget) if isinstance(self.budget, tuple) else _spec_tokens(self.budget)
        if smallest < self.protected:
            raise self._fail(
                "budget", f"{smallest} is smaller than sink + window ({self.sink} + {self.window})"
            )

    # -- derived ---------------------------------------------------------------------------
    @property
    def protected(self) -> int:
        """Entries every sparse layer keeps regardless of score: sink + window."""
        return self.sink + self.window

    def resolve(self, num_layers: int, context_len: int) -> ResolvedSparsity:
        """Check this config against a model and give each layer its kind and budget.

        A sparse layer's effective budget is min(budget, context_len): a budget at or above the
        context length is valid and keeps every token. Disabled configs resolve to all-full.
        Raises SparsityConfigError for a full layer outside the model or an explicit budget list
        whose length differs from the number of sparse layers.
        """
        if not _is_int(num_layers) or num_layers < 1:
            raise SparsityConfigError(f"model: num_layers must be a positive integer, got {num_layers!r}")
        if not _is_int(context_len) or context_len < 1:
            raise SparsityConfigError(f"model: context_len must be a positive integer, got {context_len!r}")
        if not self.enabled:
            return ResolvedSparsity(self, num_layers, context_len, ("full",) * num_layers, (None,) * num_layers)
        for layer in self.full_layers:
            if layer >= num_layers:
                raise self._fail(
                    "full_layers",
                    f"layer {layer} is outside the model ({num_layers} layers: 0..{num_layers - 1})",
                )
        full = set(self.full_layers)
        sparse = [layer for layer in range(num_layers) if layer not in full]
        raw = self._sparse_budgets(len(sparse))
        budgets: list[int | None] = [None] * num_layers
        for layer, value in zip(sparse, raw):
            budgets[layer] = min(value, context_len)
        kinds = tuple("full" if layer in full else "sparse" for layer in range(num_layers))
        return ResolvedSparsity(self, num_layers, context_len, kinds, tuple(budgets))

    def _sparse_budgets(self, num_sparse: int) -> tuple[int, ...]:
        if num_sparse == 0:
            return ()
        if isinstance(self.budget, PyramidBudget):
            return self.budget.layer_budgets(num_sparse, self.protected)
        if isinstance(self.budget, tuple):
            if len(self.budget) != num_sparse:
                raise self._fail(
                    "budget",
                    f"{len(self.budget)} budgets given for {num_sparse} sparse layers "
                    "(give one per sparse layer, in layer order)",
                )
            return self.budget
        return (self.budget,) * num_sparse

    # -- output ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The config in the JSON schema of docs/config.md (round-trips through parse_config)."""
        if isinstance(self.budget, PyramidBudget):
            budget: Any = {"kind": "pyramid", "tokens": self.budget.tokens, "min_ratio": self.budget.min_ratio}
        elif isinstance(self.budget, tuple):
            budget = list(self.budget)
        else:
            budget = self.budget
        return {
            "enabled": self.enabled,
            "full_layers": list(self.full_layers),
            "budget": budget,
            "sink": self.sink,
            "window": self.window,
            "pool_kind": self.pool_kind,
            "pool_kernel": self.pool_kernel,
            "evict_page": self.evict_page,
            "policy": self.policy,
        }

    def describe(self) -> str:
        """One human-readable line for the startup log."""
        if not self.enabled:
            return "kvsparse off (every layer keeps every token, as stock SGLang)"
        if isinstance(self.budget, PyramidBudget):
            budget = f"pyramid budget avg {self.budget.tokens} (min_ratio {self.budget.min_ratio:g})"
        elif isinstance(self.budget, tuple):
            budget = f"per-layer budgets {min(self.budget)}..{max(self.budget)}"
        else:
            budget = f"budget {self.budget}"
        full = ",".join(map(str, self.full_layers)) or "none"
        return (
            f"kvsparse {self.policy}: full layers {full}; {budget}; sink {self.sink}, "
            f"window {self.window}; {self.pool_kind}-pool {self.pool_kernel}; evict every {self.evict_page}"
        )


@dataclass(frozen=True)
class ResolvedSparsity:
    """A config checked against one model: per layer, its kind and effective budget.

    `budgets[layer]` is None for full layers and min(configured budget, context_len) for sparse
    ones. Built only by SparsityConfig.resolve.
    """

    config: SparsityConfig
    num_layers: int
    context_len: int
    kinds: tuple[LayerKind, ...]
    budgets: tuple[int | None, ...]

    @property
    def enabled(self) -> bool:
        """True when the plugin is on (it may still have no sparse layer: then it is dense)."""
        return self.config.enabled

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.kinds) if kind == "full")

    @property
    def sparse_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.kinds) if kind == "sparse")

    def is_sparse(self, layer: int) -> bool:
        return self.kinds[layer] == "sparse"

    def budget(self, layer: int) -> int:
        """Effective budget of a sparse layer; ValueError for a full layer."""
        value = self.budgets[layer]
        if value is None:
            raise ValueError(f"layer {layer} is a full layer and has no budget")
        return value

    def keeps_all(self, layer: int) -> bool:
        """True when the layer never drops a token: full, or budget >= context length."""
        value = self.budgets[layer]
        return value is None or value >= self.context_len

    def max_entries(self, layer: int) -> int:
        """Most entries one request can hold in the layer at any time.

        Full: the context length. Sparse: budget + evict_page (eviction runs when a layer reaches
        it), capped at the context length because a sequence never grows beyond it.
        """
        value = self.budgets[layer]
        if value is None:
            return self.context_len
        return min(value + self.config.evict_page, self.context_len)

    def layer_table(self) -> list[dict[str, Any]]:
        """Per-layer {layer, kind, budget} rows (budget None for full layers), e.g. for stats."""
        return [
            {"layer": i, "kind": kind, "budget": budget}
            for i, (kind, budget) in enumerate(zip(self.kinds, self.budgets))
        ]


# ---- presets -------------------------------------------------------------------------------

PRESETS: dict[str, SparsityConfig] = {
    # Exactly stock SGLang.
    "off": SparsityConfig(enabled=False),
    # SnapKV: every layer compressed to the same budget.
    "snapkv": SparsityConfig(full_layers=(), budget=1024),
    # PyramidKV: every layer compressed, budgets decreasing with depth (beta ~ 20).
    "pyramidkv": SparsityConfig(full_layers=(), budget=PyramidBudget(tokens=1024, min_ratio=0.025)),
    # For the embedded SmolLM2-135M (30 layers, 8k context): the first two layers, whose attention
    # is broad and where compression costs most, stay full; the other 28 keep 1024 entries, the low
    # end of the 1024-1536 windows of the reference results. A 4k-token request then holds
    # (2 * 4096 + 28 * 1040) / (30 * 4096) ~ 30% of the dense KV bytes.
    "default": SparsityConfig(full_layers=(0, 1), budget=1024),
}


# ---- parsing -------------------------------------------------------------------------------

_JSON_KEYS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(SparsityConfig) if f.name != "origins")


def parse_config(
    json_or_path: str | None = None,
    *,
    preset: str | None = None,
    full_layers: str | Sequence[int] | None = None,
    budget: int | str | None = None,
    window: int | str | None = None,
) -> SparsityConfig:
    """Build the config from a preset, then `--kvsparse-config` JSON, then short flags.

    json_or_path: inline JSON (the stripped text starts with '{') or a path to a JSON file; None
    for none. preset: a PRESETS name; None means DEFAULT_PRESET. full_layers: "0,1" (the flag's
    text; "" for none) or a sequence of ints. budget: sets the average budget: it replaces a
    uniform or explicit-list budget by a uniform one and keeps a pyramid's shape (min_ratio).
    Flags given as None are not set. Unknown JSON keys, bad types and invalid values raise
    SparsityConfigError naming the option. A flag, or a JSON key in a JSON without `enabled`,
    that sets a knob while the result is disabled is an error, so `--kvsparse-preset off
    --kvsparse-budget 512` cannot silently do nothing.
    """
    preset_name = DEFAULT_PRESET if preset is None else preset
    if preset_name not in PRESETS:
        raise SparsityConfigError(
            f"{_PRESET_OPTION}: unknown preset {preset_name!r} (known: {', '.join(PRESETS)})"
        )
    base = PRESETS[preset_name]
    values: dict[str, Any] = {name: getattr(base, name) for name in _JSON_KEYS}
    origins = {name: f"{_PRESET_OPTION} {preset_name} {name}" for name in _JSON_KEYS}
    explicit: list[str] = []

    if json_or_path is not None:
        data = _load_json(json_or_path)
        for name, value in data.items():
            label = f"{_CONFIG_OPTION} {name}"
            values[name] = _json_value(name, value, label)
            origins[name] = label
            # A JSON that states `enabled` describes itself completely (e.g. to_dict() output).
            if "enabled" not in data:
                explicit.append(label)

    flags = {"full_layers": full_layers, "budget": budget, "window": window}
    for name, raw in flags.items():
        if raw is None:
            continue
        label = _FLAG_OF_FIELD[name]
        if name == "full_layers":
            values[name] = _parse_layer_list(raw, label)
        elif name == "budget":
            values[name] = _apply_budget_flag(values["budget"], _parse_flag_int(raw, label))
        else:
            values[name] = _parse_flag_int(raw, label)
        origins[name] = label
        explicit.append(label)

    if not values["enabled"] and explicit:
        raise SparsityConfigError(f"{explicit[0]}: has no effect while sparsity is off (preset 'off' or enabled: false)")
    return SparsityConfig(**values, origins=tuple(origins.items()))


def _load_json(json_or_path: str) -> dict[str, Any]:
    text = json_or_path.strip()
    if not text.startswith(("{", "[")):  # '[' only to report "expected a JSON object"
        if not os.path.isfile(json_or_path):
            raise SparsityConfigError(
                f"{_CONFIG_OPTION}: no such file {json_or_path!r} (give a JSON file or inline JSON starting with '{{')"
            )
        with open(json_or_path, encoding="utf-8") as handle:
            text = handle.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SparsityConfigError(f"{_CONFIG_OPTION}: invalid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise SparsityConfigError(f"{_CONFIG_OPTION}: expected a JSON object, got {type(data).__name__}")
    unknown = [key for key in data if key not in _JSON_KEYS]
    if unknown:
        raise SparsityConfigError(
            f"{_CONFIG_OPTION}: unknown key {unknown[0]!r} (known: {', '.join(_JSON_KEYS)})"
        )
    return data


def _json_value(name: str, value: Any, label: str) -> Any:
    """Convert one JSON value to the field's Python form; SparsityConfig validates the rest."""
    if name == "full_layers":
        if not isinstance(value, list):
            raise SparsityConfigError(f"{label}: expected a list of layer ids, got {value!r}")
        return tuple(value)
    if name == "budget":
        return _json_budget(value, label)
    return value


def _json_budget(value: Any, label: str) -> BudgetSpec:
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, dict):
        if value.get("kind") != "pyramid":
            raise SparsityConfigError(f"{label}: unknown budget kind {value.get('kind')!r} (known: pyramid)")
        keys = set(value) - {"kind"}
        if keys != {"tokens", "min_ratio"}:
            raise SparsityConfigError(f"{label}: a pyramid budget needs exactly 'tokens' and 'min_ratio', got {sorted(keys)}")
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
    if _is_int(raw):
        return raw  # type: ignore[return-value]
    try:
        return int(str(raw).strip())
    except ValueError:
        raise SparsityConfigError(f"{label}: expected an integer, got {raw!r}") from None


def _apply_budget_flag(current: BudgetSpec, tokens: int) -> BudgetSpec:
    if isinstance(current, PyramidBudget):
        return PyramidBudget(tokens=tokens, min_ratio=current.min_ratio)
    return tokens

