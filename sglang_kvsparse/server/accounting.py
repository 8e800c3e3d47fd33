"""KV-cache bytes: what a request holds in the heap, beside what stock SGLang would hold.

Units: `bytes_per_token` is the K+V bytes of one token in one layer (`kv_bytes_per_token`). A heap
row is `lanes` of those (`HeapLayout`, `row_bytes`). Stock SGLang holds every token in every layer;
the heap holds a request's SGLang ids (one row per token) and, in each sparse column, at most
budget + one eviction page of entries, plus score rows if it evicts (`HeapLayout.rows_held`).
Comparisons with stock are always at equal bytes: the heap gets the KV bytes stock would use.

This module must not import SGLang.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sglang_kvsparse.state.layout import HeapLayout, round_up

#: Sequence lengths shown in the start-up footprint table (those above the context length drop).
FOOTPRINT_LENGTHS: tuple[int, ...] = (512, 1024, 4096, 16384, 32768, 131072)


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V bytes of one token in one layer: 2 * num_kv_heads * head_dim * dtype_bytes."""
    return 2 * num_kv_heads * head_dim * dtype_bytes


def row_bytes(layout: HeapLayout, bytes_per_token: int) -> int:
    """Bytes of one heap row: K/V in every lane."""
    return layout.lanes * bytes_per_token


def dense_kv_bytes(seq_len: int, num_layers: int, bytes_per_token: int, page_size: int = 1) -> int:
    """Bytes stock SGLang holds for a request of `seq_len` tokens: every token in every layer."""
    return round_up(seq_len, page_size) * num_layers * bytes_per_token


@dataclass(frozen=True)
class FootprintRow:
    """Bytes one request of `seq_len` tokens holds in the heap and in stock SGLang."""

    seq_len: int
    kv_bytes: int
    dense_bytes: int

    @property
    def ratio(self) -> float:
        return self.kv_bytes / self.dense_bytes


def footprint_table(
    layout: HeapLayout, bytes_per_token: int, context_len: int, lengths: Sequence[int] = FOOTPRINT_LENGTHS
) -> list[FootprintRow]:
    """Per-request bytes at each length up to the context length (the context length itself is
    added when some lengths were beyond it)."""
    shown = [n for n in lengths if n <= context_len]
    if len(shown) < len(lengths) and context_len not in shown:
        shown.append(context_len)
    unit = row_bytes(layout, bytes_per_token)
    page = layout.page_size
    return [
        FootprintRow(n, layout.rows_held(n) * unit, dense_kv_bytes(n, layout.num_layers, bytes_per_token, page))
        for n in shown
    ]


def format_footprint_table(lines: Sequence[FootprintRow]) -> str:
    """Start-up log text, one line per length: bytes, and requests per stock request at equal bytes."""
    return "\n".join(
        f"{line.seq_len} tokens: {human_bytes(line.kv_bytes)} vs {human_bytes(line.dense_bytes)} dense "
        f"({line.ratio:.1%}; {1 / line.ratio:.2f}x the requests)"
        for line in lines
    )


def human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
