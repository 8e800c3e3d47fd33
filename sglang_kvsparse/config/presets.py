"""The named recipes of `--kvsparse-preset` (docs/config.md says why each looks as it does)."""

from __future__ import annotations

from sglang_kvsparse.config.schema import PyramidBudget, SparsityConfig

PRESETS: dict[str, SparsityConfig] = {
    # Exactly stock SGLang.
    "off": SparsityConfig(enabled=False),
    # SnapKV: every layer compressed to the same budget.
    "snapkv": SparsityConfig(full_layers=(), budget=1024),
    # PyramidKV: every layer compressed, budgets decreasing with depth (beta ~ 20).
    "pyramidkv": SparsityConfig(full_layers=(), budget=PyramidBudget(tokens=1024, min_ratio=0.025)),
    # The first two layers, whose attention is broad and where compression costs most, stay full;
    # the others keep 1024 entries, the low end of the 1024-1536 windows of the reference results.
    # With two full layers the sparse ones pair up on the heap's two lanes (docs/config.md).
    "default": SparsityConfig(full_layers=(0, 1), budget=1024),
}

#: Preset used when neither a preset, a JSON config nor a flag is given.
DEFAULT_PRESET = "default"
