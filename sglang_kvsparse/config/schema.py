"""`SparsityConfig`: which layers stay full and how much the others keep; validated on construction.

Model-independent: every field and every cross-field rule that does not need the model is checked
here; `resolve` checks the rest against one model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from sglang_kvsparse.config.resolved import ResolvedSparsity
from sglang_kvsparse.policies import POLICIES, ScoringPolicy, SnapKVPolicy

# Option labels used in error messages. Fields with a short flag are named by the flag when the
# value came from it; otherwise by where it came from (JSON or preset) plus the JSON key.
CONFIG_OPTION = "--kvsparse-config"
PRESET_OPTION = "--kvsparse-preset"
FLAG_OF_FIELD: dict[str, str] = {
    "full_layers": "--kvsparse-full-layers",
    "budget": "--kvsparse-budget",
    "window": "--kvsparse-window",
    "max_request_budget": "--kvsparse-max-request-budget",
    "request_settings": "--kvsparse-request-settings",
    "request_policies": "--kvsparse-request-policies",
}

#: The policies a request may choose by default: all but `h2o`, whose prefill scores with every
#: query of the prompt (a second attention pass, and on the CPU a [queries, keys] matrix per
#: head), so one request's choice costs every request in its batch.
REQUEST_POLICIES: tuple[str, ...] = tuple(sorted(name for name in POLICIES if name != "h2o"))


class SparsityConfigError(ValueError):
    """An invalid sparsity setting. The message is one line naming the option at fault."""


def is_int(value: Any) -> bool:
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
BudgetSpec = int | PyramidBudget | tuple[int, ...]


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
      evict_page   decode eviction granularity in tokens: a sparse layer that holds
                   budget + evict_page entries evicts evict_page of them, back to budget.
      policy       the scoring policy with its own knobs (`sglang_kvsparse.policies.POLICIES`).
      max_request_budget
                   the largest budget one request may ask for (`custom_params` {"kvsparse":
                   {"budget": N}}, or {"enabled": false} for a request no longer than it); None:
                   the largest sparse budget, so requests may only ask for less. It sizes the
                   sparse layers' row tables (`request_sparsity.py`, docs/config.md).
      guide_from   None: each sparse layer keeps the prompt entries its own scores rank best.
                   A fraction of the model's depth in [0, 1): every sparse layer keeps those the
                   guide layers rank best together, the sparse layers from layer
                   round(guide_from * num_layers) to the last (`sglang_kvsparse/forward/guide.py`).
      guide_below  with guide_from, a share of the prompt in (0, 1]: a layer whose budget for a
                   request is at least this share of its prompt keeps that request's entries by
                   its own scores; None: the guide chooses at every budget. No effect without
                   guide_from.
      request_settings
                   whether a request may give its own setting (`custom_params`); False refuses
                   one with a 400.
      request_policies
                   the policies a request may choose by name (empty: none).
      max_distinct_settings
                   the most distinct own settings among the requests a scheduler runs at once:
                   each costs a batch a scoring pass at prefill and an eviction per step, so a
                   request with one more waits until one of them finishes.
    """

    enabled: bool = True
    full_layers: tuple[int, ...] = ()
    budget: BudgetSpec = 1024
    sink: int = 4
    window: int = 32
    evict_page: int = 16
    policy: ScoringPolicy = SnapKVPolicy()
    max_request_budget: int | None = None
    guide_from: float | None = None
    guide_below: float | None = None
    request_settings: bool = True
    request_policies: tuple[str, ...] = REQUEST_POLICIES
    max_distinct_settings: int = 4
    # Where each field's value came from, for error messages: ((field, option label), ...).
    origins: tuple[tuple[str, str], ...] = field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples (the config is hashable);
        # full layers are stored sorted.
        if isinstance(self.budget, list):
            object.__setattr__(self, "budget", tuple(self.budget))
        if isinstance(self.request_policies, list):
            object.__setattr__(self, "request_policies", tuple(self.request_policies))
        if isinstance(self.full_layers, (list, tuple)):
            layers = tuple(self.full_layers)
            if all(is_int(layer) for layer in layers):
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
        return FLAG_OF_FIELD.get(name, f"{CONFIG_OPTION} {name}")

    def _fail(self, name: str, problem: str) -> SparsityConfigError:
        return SparsityConfigError(f"{self.option(name)}: {problem}")

    def _check_int(self, name: str, value: Any, minimum: int) -> None:
        if not is_int(value):
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
        if not isinstance(self.policy, ScoringPolicy):
            raise self._fail("policy", f"expected a scoring policy, got {self.policy!r}")
        if self.max_request_budget is not None:
            self._check_int("max_request_budget", self.max_request_budget, 1)
        guide = self.guide_from
        if guide is not None and (isinstance(guide, bool) or not isinstance(guide, (int, float)) or not 0 <= guide < 1):
            raise self._fail("guide_from", f"expected null or a fraction of the depth in [0, 1), got {guide!r}")
        share = self.guide_below
        if share is not None and (isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share <= 1):
            raise self._fail("guide_below", f"expected null or a share of the prompt in (0, 1], got {share!r}")
        self._validate_budget_shape()
        self._validate_requests()

    def _validate_requests(self) -> None:
        if not isinstance(self.request_settings, bool):
            raise self._fail("request_settings", f"expected true or false, got {self.request_settings!r}")
        if not isinstance(self.request_policies, tuple):
            raise self._fail("request_policies", f"expected a list of policy names, got {self.request_policies!r}")
        for name in self.request_policies:
            if name not in POLICIES:
                raise self._fail("request_policies", f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})")
        dup = _first_duplicate(self.request_policies)
        if dup is not None:
            raise self._fail("request_policies", f"policy {dup!r} is listed twice")
        self._check_int("max_distinct_settings", self.max_distinct_settings, 1)

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
            raise self._fail("budget", f"{smallest} is smaller than sink + window ({self.sink} + {self.window})")

    # -- derived ---------------------------------------------------------------------------
    @property
    def protected(self) -> int:
        """Entries every sparse layer keeps regardless of score: sink + window."""
        return self.sink + self.window

    def resolve(
        self, num_layers: int, context_len: int, sliding_layers: Sequence[int] = (), sliding_window: int = 0
    ) -> ResolvedSparsity:
        """Check this config against a model and give each layer its kind and budget.

        A sparse layer's effective budget is min(budget, context_len): a budget at or above the
        context length is valid and keeps every token. The model's `sliding_layers`, whose
        attention reads only the last `sliding_window` keys, are sliding layers whether or not
        `full_layers` names them (keeping more than the window keeps what is never read again);
        such a listed layer stands for the next layer that reads the whole context and is not
        full yet, which is full instead (the default's first layer is Gemma 3's first global).
        Disabled configs resolve to all-full. Raises SparsityConfigError for a full layer outside
        the model or an explicit budget list whose length differs from the number of sparse layers.
        """
        if not is_int(num_layers) or num_layers < 1:
            raise SparsityConfigError(f"model: num_layers must be a positive integer, got {num_layers!r}")
        if not is_int(context_len) or context_len < 1:
            raise SparsityConfigError(f"model: context_len must be a positive integer, got {context_len!r}")
        sliding = set(sliding_layers)
        if sliding and not (is_int(sliding_window) and 0 < sliding_window):
            raise SparsityConfigError(f"model: sliding_window must be a positive integer, got {sliding_window!r}")
        if any(not is_int(layer) or not 0 <= layer < num_layers for layer in sliding):
            raise SparsityConfigError(f"model: sliding layers {sorted(sliding)} outside its {num_layers} layers")
        if not self.enabled:
            return ResolvedSparsity(self, num_layers, context_len, ("full",) * num_layers, (None,) * num_layers)
        for layer in self.full_layers:
            if layer >= num_layers:
                raise self._fail(
                    "full_layers", f"layer {layer} is outside the model ({num_layers} layers: 0..{num_layers - 1})"
                )
        full = set(self.full_layers) - sliding
        for listed in sorted(set(self.full_layers) & sliding):
            later = [layer for layer in range(listed + 1, num_layers) if layer not in sliding | full]
            full.update(later[:1])
        sparse = [layer for layer in range(num_layers) if layer not in full and layer not in sliding]
        budgets: list[int | None] = [None] * num_layers
        for layer, value in zip(sparse, self._sparse_budgets(len(sparse))):
            budgets[layer] = min(value, context_len)
        for layer in sliding:
            budgets[layer] = min(sliding_window + self.sink, context_len)
        kinds = tuple(
            "sliding" if layer in sliding else "full" if layer in full else "sparse" for layer in range(num_layers)
        )
        largest = max((budgets[layer] for layer in sparse), default=0)
        if self.max_request_budget is not None and self.max_request_budget < largest:
            raise self._fail(
                "max_request_budget", f"{self.max_request_budget} is below the largest sparse budget ({largest})"
            )
        request_cap = min(self.max_request_budget or largest, context_len)
        guide_layers = self._guide_layers(sparse, num_layers)
        return ResolvedSparsity(
            self,
            num_layers,
            context_len,
            kinds,
            tuple(budgets),
            request_cap,
            guide_layers,
            sliding_window if sliding else 0,
        )

    def _guide_layers(self, sparse: list[int], num_layers: int) -> tuple[int, ...]:
        """The sparse layers whose scores guide every sparse layer's prefill selection (none
        without sparse layers: there is nothing to guide)."""
        if self.guide_from is None or not sparse:
            return ()
        first = round(self.guide_from * num_layers)
        layers = tuple(layer for layer in sparse if layer >= first)
        if not layers:
            raise self._fail(
                "guide_from",
                f"{self.guide_from:g} of {num_layers} layers starts at layer {first}: no sparse layer there",
            )
        return layers

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
            "evict_page": self.evict_page,
            "policy": {"name": self.policy.name, **self.policy.options()},
            "max_request_budget": self.max_request_budget,
            "guide_from": self.guide_from,
            "guide_below": self.guide_below,
            "request_settings": self.request_settings,
            "request_policies": list(self.request_policies),
            "max_distinct_settings": self.max_distinct_settings,
        }

    def describe(self) -> str:
        """One human-readable line for the start-up log."""
        if not self.enabled:
            return "kvsparse off (every layer keeps every token, as stock SGLang)"
        if isinstance(self.budget, PyramidBudget):
            budget = f"pyramid budget avg {self.budget.tokens} (min_ratio {self.budget.min_ratio:g})"
        elif isinstance(self.budget, tuple):
            budget = f"per-layer budgets {min(self.budget)}..{max(self.budget)}"
        else:
            budget = f"budget {self.budget}"
        full = ",".join(map(str, self.full_layers)) or "none"
        requests = "" if self.max_request_budget is None else f"; requests may ask up to {self.max_request_budget}"
        if not self.request_settings:
            requests += "; no per-request settings"
        guide = "" if self.guide_from is None else f"; prefill guided from {self.guide_from:g} of the depth"
        if guide and self.guide_below is not None:
            guide += f" while the budget is below {self.guide_below:g} of the prompt"
        return (
            f"kvsparse {self.policy.describe()}: full layers {full}; {budget}; sink {self.sink}, "
            f"window {self.window}; evict every {self.evict_page}{guide}{requests}"
        )


def _spec_tokens(spec: int | PyramidBudget) -> int:
    return spec.tokens if isinstance(spec, PyramidBudget) else spec
