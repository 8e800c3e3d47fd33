"""Cross-layer selection at prefill: every sparse layer keeps what the guide layers rank best.

Why: a sparse layer's own scores say what *its* observation window reads, and early layers read
locally. On retrieval prompts their window attention never lands on the answer, so with
per-layer selection they drop it, and a model that cannot see an answer's tokens in its early
layers does not copy it whole, however well the later layers kept it. The middle and late
layers' windows do find it. So when the configuration names guide layers (`guide_from`), each
sparse layer's prefill selection waits for the forward's last sparse layer, and then every sparse
layer keeps the entries whose guide score is best: the policy's score, its largest over a layer's
KV heads, averaged over the guide layers. The kept
entries' stored scores are the guide's too, so decode evictions rank them in the same units.

Only while a request's budget is below a share of its prompt (`guide_below`, decided by the
plan: `ColumnPlan.guided`): with room, each layer's own selection is the better one, since it
keeps what it reads itself as well as the answer, a guided layer only what the late layers read
(`docs/experiments/2026-12-04-default-knobs.md`).

Cost: until the forward's last sparse layer has run, each sparse layer keeps a guided request's
new tokens' K/V in heap rows taken for that forward (`ColumnPlan.work_slots`; the batch's cached
prefixes are read again from the prefix store, which the forward pins): stock SGLang's bytes for
this forward's tokens, at most the chunked-prefill size, charged at admission with the request
(`admission.prefill_charge`) and given back once the forward has been issued.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

import torch

#: What a deferred layer runs once the guide is complete: keep its entries by these scores
#: ([total_kv] float32, aligned with the forward's sequence layout).
DeferredKeep = Callable[[torch.Tensor], None]


class PrefillGuide:
    """One prefill forward's guide: the guide layers' scores, and the layers waiting for them."""

    def __init__(self, guide_layers: Collection[int]) -> None:
        if not guide_layers:
            raise ValueError("a guide needs at least one guide layer")
        self.guide_layers = frozenset(guide_layers)
        self._total: torch.Tensor | None = None
        self._seen: set[int] = set()
        self._waiting: list[DeferredKeep] = []

    def guides(self, layer_id: int) -> bool:
        """Whether the layer's scores are part of the guide (so it scores even when it keeps all)."""
        return layer_id in self.guide_layers

    def add(self, layer_id: int, scores: torch.Tensor) -> None:
        """A guide layer's scores [total_kv, H_kv]: their best over its KV heads joins the guide."""
        if layer_id not in self.guide_layers or layer_id in self._seen:
            raise ValueError(f"layer {layer_id} is not a guide layer still to come")
        best = scores.float().amax(dim=1)
        self._total = best if self._total is None else self._total + best
        self._seen.add(layer_id)

    def defer(self, keep: DeferredKeep) -> None:
        """Run `keep` with the guide's scores when `finish` is called."""
        self._waiting.append(keep)

    def finish(self) -> None:
        """After the forward's last sparse layer: every deferred layer keeps by the guide."""
        if not self._waiting:
            return
        missing = sorted(self.guide_layers - self._seen)
        if missing or self._total is None:
            raise RuntimeError(f"kvsparse: the prefill guide is missing layers {missing}")
        scores = self._total / len(self._seen)
        for keep in self._waiting:
            keep(scores)
        self._waiting.clear()
