"""What a forward changed in the sparse state before it is planned (`SparseState.begin_extend` /
`begin_decode`), as plain records of host tensors, and the ragged-index helpers both sides use.
No SGLang imports."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.policies import ScoringPolicy


@dataclass(frozen=True)
class ExtendStep:
    """A prefill forward's requests and what it took (all host tensors).

    `partial` [B]: the chunks before their prompt's last (they keep no entries and store their
    tokens). With the prefix store: `prefix_rows` [num_columns, n_prefix] the matched prefixes'
    store rows, `store_rows` [num_columns, n] the rows the new tokens at `store_positions` [n]
    (among the batch's new tokens) are stored in. `work_rows` (per sparse column, [n]) the heap
    rows the new tokens at `work_positions` of the requests some group keeps by the guide wait in
    until it has chosen (back once the forward has been issued)."""

    req_indices: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    partial: torch.Tensor
    prefix_rows: torch.Tensor | None = None
    store_rows: torch.Tensor | None = None
    store_positions: torch.Tensor | None = None
    work_rows: tuple[torch.Tensor, ...] = ()
    work_positions: torch.Tensor | None = None

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.prefix_lens + self.extend_lens


@dataclass(frozen=True)
class EvictingRequests:
    """The requests of one group that evict this decode step keeping `budget` by `policy` (None:
    the server's), with their entries before the cut (`olds`, each [max_entries, columns])."""

    group: int
    budget: int
    policy: ScoringPolicy | None
    req_indices: list[int]
    olds: list[torch.Tensor]


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """start..start+length-1 for each pair, concatenated."""
    if lengths.numel() == 0:
        return torch.empty(0, dtype=torch.int64)
    offsets = torch.arange(int(lengths.sum())) - (torch.cumsum(lengths, 0) - lengths).repeat_interleave(lengths)
    return starts.repeat_interleave(lengths) + offsets


def indptr(lengths: torch.Tensor) -> torch.Tensor:
    """[B+1] int64 boundaries of these lengths (host)."""
    out = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    out[1:] = lengths.cumsum(0)
    return out
