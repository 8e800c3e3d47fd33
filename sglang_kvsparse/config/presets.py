"""The named recipes of `--kvsparse-preset` (docs/config.md; the default's measurements:
`docs/experiments/2026-12-04-default-knobs.md`)."""

from __future__ import annotations

from sglang_kvsparse.config.schema import PyramidBudget, SparsityConfig
from sglang_kvsparse.policies.span import SpanPolicy

PRESETS: dict[str, SparsityConfig] = {
    # Exactly stock SGLang.
    "off": SparsityConfig(enabled=False),
    # SnapKV: every layer compressed to the same budget.
    "snapkv": SparsityConfig(full_layers=(), budget=1024),
    # PyramidKV: every layer compressed, budgets decreasing with depth (beta ~ 20).
    "pyramidkv": SparsityConfig(full_layers=(), budget=PyramidBudget(tokens=1024, min_ratio=0.025)),
    # Layer 0 stays full: the heap keeps a row per token for SGLang's token id in any case, and a
    # full layer's K/V fills it (with no full layer it stores nothing); each further full layer
    # costs a whole sequence per request. The others keep 1024 entries, the low end of the
    # 1024-1536 windows of the reference results.
    # `span` with an observation window of 16 keeps many-token answers SnapKV cuts short; guided
    # from a third of the depth, every sparse layer keeps what the middle and late layers find
    # (the early ones' own windows never see a needle); from a budget of 0.15 of the prompt each
    # layer keeps by its own scores again, which with that room keeps more.
    "default": SparsityConfig(
        full_layers=(0,), budget=1024, window=16, policy=SpanPolicy(), guide_from=0.33, guide_below=0.15
    ),
}

#: Preset used when neither a preset, a JSON config nor a flag is given.
DEFAULT_PRESET = "default"
