"""A configuration checked against one model: per layer, its kind and effective budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from sglang_kvsparse.config.schema import SparsityConfig

LayerKind = Literal["full", "sparse", "sliding"]


@dataclass(frozen=True)
class ResolvedSparsity:
    """`budgets[layer]` is None for full layers, min(configured budget, context_len) for sparse
    ones and min(sliding_window + sink, context_len) for sliding ones: a layer of the model whose
    attention reads only its last `sliding_window` keys keeps those (and the sinks every selection
    keeps), ranked by recency whatever the policy, so it loses nothing. `request_cap`: the
    largest budget one request may ask for (the config's `max_request_budget`, else the largest
    sparse budget; within the context; 0 with no sparse layer). `guide_layers`: the sparse layers
    whose scores choose every sparse layer's prefill entries (empty: each layer by its own;
    `sglang_kvsparse/forward/guide.py`). Built only by `SparsityConfig.resolve`."""

    config: SparsityConfig
    num_layers: int
    context_len: int
    kinds: tuple[LayerKind, ...]
    budgets: tuple[int | None, ...]
    request_cap: int = 0
    guide_layers: tuple[int, ...] = ()
    sliding_window: int = 0

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

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, kind in enumerate(self.kinds) if kind == "sliding")

    @property
    def heap_layers(self) -> tuple[int, ...]:
        """The layers whose entries live in the heap's columns: sparse and sliding."""
        return tuple(i for i, kind in enumerate(self.kinds) if kind != "full")

    def budget(self, layer: int) -> int:
        """Effective budget of a sparse or sliding layer; ValueError for a full layer."""
        value = self.budgets[layer]
        if value is None:
            raise ValueError(f"layer {layer} is a full layer and has no budget")
        return value

    def guided(self, budgets: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor | None:
        """Which requests (host [B], by their budgets in one group and whole sequence lengths) a
        selecting prefill keeps by the guide: with guide layers, those longer than their budget
        and, with `guide_below`, whose budget is below that share of their sequence; None without
        guide layers."""
        if not self.guide_layers:
            return None
        over = seq_lens > budgets
        share = self.config.guide_below
        return over if share is None else over & (budgets < share * seq_lens)

    def max_entries(self, layer: int) -> int:
        """Most entries one request can hold in the layer at any time.

        Full: the context length. Sparse and sliding: budget + evict_page (eviction runs when a
        layer reaches it), capped at the context length because a sequence never grows beyond it.
        """
        value = self.budgets[layer]
        if value is None:
            return self.context_len
        return min(value + self.config.evict_page, self.context_len)
