"""One request's own sparsity setting, from SGLang's `custom_params` (no SGLang imports).

A request asks through the `custom_params` field SGLang carries from `/generate`'s
`sampling_params` and from the OpenAI endpoints (`extra_body={"custom_params": ...}`) to the
scheduler:

* ``{"kvsparse": {"budget": N}}``: every sparse layer keeps N entries for this request, in place of
  the server's budgets (sink + window <= N <= the server's `max_request_budget`);
* ``{"kvsparse": {"policy": "h2o"}}`` (with knobs: ``{"policy": "span", "policy.long_follow": 32}``):
  this request's keys are scored, kept and evicted by that policy, in its own units, whatever the
  server's policy is; with or without a budget;
* ``{"kvsparse": {"enabled": false}}``: the request keeps every token in every layer, as in stock
  SGLang; its prompt plus max_new_tokens must be at most `max_request_budget`, so that its sparse
  rows hold it whole (they are sized by it).

SGLang declares `custom_params` a dict of scalars, lists of scalars or dicts of scalars (what its
msgpack IPC carries without pickling), so a policy's knobs are keys ``"policy.<knob>"`` beside
``"policy"``. The setting may also be one JSON string (``{"kvsparse": "{\"budget\": 64}"}``), and
the configuration's nested form (``"policy": {"name": "span", "long_follow": 32}``) is read too:
the HTTP process writes every accepted setting back in the flat form (`to_params`) before the
request leaves it, so what reaches a scheduler is always within SGLang's type.

The server bounds what a request may ask: its own budget up to `max_request_budget`, a policy
among `request_policies` with knobs in their ranges (the policies' own checks), per-request
settings at all only with `request_settings`, and at most `max_distinct_settings` of them running
at once (`one_setting_too_many`: a request with one more waits). The HTTP process refuses a bad
setting before the request is queued (`check_request`: a 400 naming the field and the limit);
admission charges each request the rows its own setting holds, and the sparse
layers keep, compress and evict each request to its own budget by its own policy
(`SparseState.expect`, `plans.PolicyGroup`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from sglang_kvsparse.config import ResolvedSparsity
from sglang_kvsparse.config.parsing import parse_policy
from sglang_kvsparse.config.schema import is_int
from sglang_kvsparse.policies import ScoringPolicy

#: The key of `custom_params` this project reads.
REQUEST_KEY = "kvsparse"
#: How errors name the field.
FIELD = f"custom_params.{REQUEST_KEY}"
#: What a request may set.
KNOWN_KEYS = ("budget", "policy", "enabled")
#: The prefix of a policy knob's key in the flat form.
KNOB_PREFIX = "policy."


@dataclass(frozen=True)
class RequestSparsity:
    """A request's setting: the server's (`budget` and `policy` None, on), its own budget and/or
    policy, or off."""

    budget: int | None = None
    policy: ScoringPolicy | None = None
    enabled: bool = True

    @property
    def label(self) -> str:
        """How `/kvsparse/stats` counts it: "server", "off", or its own parts, e.g. "budget 64,
        policy h2o"."""
        if not self.enabled:
            return "off"
        parts = [] if self.budget is None else [f"budget {self.budget}"]
        parts += [] if self.policy is None else [f"policy {self.policy.describe()}"]
        return ", ".join(parts) or "server"

    def to_params(self) -> dict[str, bool | int | float | str]:
        """The setting in the flat form, within SGLang's `custom_params` type (`parse_request`
        reads it back to an equal setting)."""
        if not self.enabled:
            return {"enabled": False}
        params: dict[str, bool | int | float | str] = {} if self.budget is None else {"budget": self.budget}
        if self.policy is not None:
            params["policy"] = self.policy.name
            params.update({KNOB_PREFIX + knob: value for knob, value in self.policy.options().items()})
        return params

    def applied(self, resolved: ResolvedSparsity) -> dict[str, Any]:
        """What a response reports was applied to the request: its setting's label, the budget
        every sparse layer kept for it (the server's distinct budgets when they differ by layer)
        and the policy that scored it; off keeps everything."""
        if not self.enabled:
            return {"setting": self.label, "budget": None, "policy": None}
        budgets = sorted({resolved.budget(layer) for layer in resolved.sparse_layers})
        budget = self.budget if self.budget is not None else (budgets[0] if len(budgets) == 1 else budgets)
        policy = self.policy or resolved.config.policy
        return {"setting": self.label, "budget": budget, "policy": policy.describe()}

    def own_budget(self, resolved: ResolvedSparsity) -> int:
        """The budget it keeps in every group: 0 for the server's budgets; off keeps
        `request_cap` entries, at least its whole length (`check_request`)."""
        if not self.enabled:
            return resolved.request_cap
        return self.budget or 0

    def grouping(self, resolved: ResolvedSparsity) -> tuple[int, ScoringPolicy | None]:
        """What the sparse layers group requests by (own budget, own policy): each distinct one
        in a batch is a scoring pass at prefill and an eviction per step while decoding."""
        return self.own_budget(resolved), self.policy


SERVER_SETTING = RequestSparsity()
#: The server's setting as `grouping` gives it.
SERVER_GROUPING: tuple[int, ScoringPolicy | None] = (0, None)


def one_setting_too_many(
    setting: RequestSparsity, running: set[tuple[int, ScoringPolicy | None]], resolved: ResolvedSparsity
) -> bool:
    """Whether a request with `setting` would make the running requests' distinct own settings
    (`running`, the server's excluded) more than `max_distinct_settings`: it waits."""
    mine = setting.grouping(resolved)
    return mine != SERVER_GROUPING and mine not in running and len(running) >= resolved.config.max_distinct_settings


def parse_request(custom_params: Any, resolved: ResolvedSparsity) -> RequestSparsity:
    """The setting in a request's `custom_params` (the server's when it has none); ValueError
    naming the field for a malformed one or a budget the server cannot give."""
    if not isinstance(custom_params, dict) or custom_params.get(REQUEST_KEY) is None:
        return SERVER_SETTING
    config = resolved.config
    if not config.request_settings:
        raise ValueError(f"{FIELD}: per-request settings are off on this server (--kvsparse-request-settings off)")
    value = _as_object(custom_params[REQUEST_KEY])
    for key in value:
        if key not in KNOWN_KEYS:
            raise ValueError(f"{FIELD}: unknown key {key!r} (known: {', '.join(KNOWN_KEYS)})")
    enabled = value.get("enabled", True)
    if not isinstance(enabled, bool):
        raise ValueError(f"{FIELD}.enabled: expected true or false, got {enabled!r}")
    budget, policy = value.get("budget"), value.get("policy")
    if not enabled and (budget is not None or policy is not None):
        raise ValueError(f"{FIELD}: enabled: false keeps every token; give it without budget or policy")
    if policy is not None:
        policy = parse_policy(policy, f"{FIELD}.policy")
        if policy.name not in config.request_policies:
            choices = ", ".join(config.request_policies) or "none"
            raise ValueError(
                f"{FIELD}.policy: {policy.name!r} is not one a request may choose on this server (allowed: "
                f"{choices}; --kvsparse-request-policies)"
            )
    if budget is None:
        return RequestSparsity(policy=policy, enabled=enabled)
    if not is_int(budget):
        raise ValueError(f"{FIELD}.budget: expected an integer, got {budget!r}")
    if budget < config.protected:
        raise ValueError(
            f"{FIELD}.budget: {budget} is smaller than the server's sink + window ({config.sink} + {config.window})"
        )
    if budget > resolved.request_cap:
        raise ValueError(
            f"{FIELD}.budget: {budget} is above this server's max_request_budget ({resolved.request_cap}; "
            "start it with a larger --kvsparse-max-request-budget)"
        )
    return RequestSparsity(budget=budget, policy=policy)


def _as_object(value: Any) -> dict[str, Any]:
    """The setting as one object: given as one (flat or nested) or as a JSON string of one; a
    policy's "policy.<knob>" keys folded into its nested form."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass  # reported below as not an object
    if not isinstance(value, dict):
        example = '{"budget": 256}'
        raise ValueError(f"{FIELD}: expected an object such as {example} (or a JSON string of one), got {value!r}")
    setting = {key: item for key, item in value.items() if not key.startswith(KNOB_PREFIX)}
    knobs = {key[len(KNOB_PREFIX) :]: item for key, item in value.items() if key.startswith(KNOB_PREFIX)}
    if knobs:
        if not isinstance(setting.get("policy"), str):
            raise ValueError(f'{FIELD}: "{KNOB_PREFIX}<knob>" keys need "policy" given as a name beside them')
        setting["policy"] = {"name": setting["policy"], **knobs}
    return setting


def check_request(
    custom_params: Any, prompt_len: int, max_new_tokens: int | None, resolved: ResolvedSparsity
) -> RequestSparsity:
    """`parse_request`, and for a request that turns sparsity off, that its whole length fits
    the rows it is given (ValueError naming the field otherwise)."""
    setting = parse_request(custom_params, resolved)
    if setting.enabled:
        return setting
    if max_new_tokens is None:
        raise ValueError(f"{FIELD}.enabled: false needs max_new_tokens (max_tokens) to bound the request's length")
    longest = prompt_len + max_new_tokens
    if longest > resolved.request_cap:
        raise ValueError(
            f"{FIELD}.enabled: false keeps at most {resolved.request_cap} tokens on this server (its "
            f"max_request_budget); this request may reach {longest} (prompt {prompt_len} + max_new_tokens "
            f"{max_new_tokens}): lower max_tokens or start the server with a larger --kvsparse-max-request-budget"
        )
    return setting
