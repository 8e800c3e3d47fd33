"""Kernels of the sparsity backend: Triton on CUDA, plain-torch references elsewhere.

Each family has ``name_triton``, ``name_torch`` (same arguments and outputs) and a dispatcher
``name`` that adds ``backend="auto"|"triton"|"torch"``. Importing this package imports Triton but
never SGLang. See docs/kernels.md for contracts and layouts.
"""

from .decode_attention import (
    SCORE_UPDATES,
    DecodeConfig,
    ScoreUpdate,
    decode_attention_with_scores,
    decode_attention_with_scores_torch,
    decode_attention_with_scores_triton,
)
from .evict import evict_rows, evict_rows_torch, evict_rows_triton
from .extend_attention import (
    ExtendConfig,
    extend_attention_with_stats,
    extend_attention_with_stats_torch,
    extend_attention_with_stats_triton,
)
from .first_scores import FIRST_SCORES, FirstScore, first_scores, minus_key_norm, position_hash
from .selection import peaks, pool_scores, select_kept, select_rows, spread_scores
from .window_scores import (
    WindowScoreConfig,
    window_scores,
    window_scores_torch,
    window_scores_triton,
)
from .write import write_entries, write_entries_torch, write_entries_triton

__all__ = [
    "FIRST_SCORES",
    "SCORE_UPDATES",
    "DecodeConfig",
    "ExtendConfig",
    "FirstScore",
    "ScoreUpdate",
    "WindowScoreConfig",
    "peaks",
    "decode_attention_with_scores",
    "decode_attention_with_scores_torch",
    "decode_attention_with_scores_triton",
    "evict_rows",
    "evict_rows_torch",
    "evict_rows_triton",
    "extend_attention_with_stats",
    "extend_attention_with_stats_torch",
    "extend_attention_with_stats_triton",
    "first_scores",
    "minus_key_norm",
    "position_hash",
    "pool_scores",
    "select_kept",
    "select_rows",
    "spread_scores",
    "write_entries",
    "write_entries_torch",
    "write_entries_triton",
    "window_scores",
    "window_scores_torch",
    "window_scores_triton",
]
