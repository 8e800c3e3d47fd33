"""Sparsity configuration, one job per module (this package never imports SGLang):

- `schema`: `SparsityConfig` (fields, validation, JSON form, resolution against a model);
- `resolved`: `ResolvedSparsity`, a config checked against one model, per layer;
- `presets`: the named recipes (`--kvsparse-preset`);
- `parsing`: preset < `--kvsparse-config` JSON < short flags, into one `SparsityConfig`.

Every validation failure raises `SparsityConfigError` whose message is one line that starts with
the option the bad value came from (`--kvsparse-budget`, `--kvsparse-config budget`,
`--kvsparse-preset pyramidkv budget`, ...), so a user knows what to change. docs/config.md has
the JSON schema.
"""

from sglang_kvsparse.config.parsing import parse_config
from sglang_kvsparse.config.presets import DEFAULT_PRESET, PRESETS
from sglang_kvsparse.config.resolved import ResolvedSparsity
from sglang_kvsparse.config.schema import BudgetSpec, PyramidBudget, SparsityConfig, SparsityConfigError

__all__ = [
    "DEFAULT_PRESET",
    "PRESETS",
    "BudgetSpec",
    "PyramidBudget",
    "ResolvedSparsity",
    "SparsityConfig",
    "SparsityConfigError",
    "parse_config",
]
