"""Each request's record in the sparse layers, at SGLang's request index (`req_pool_idx`; no
SGLang imports).

A record holds what the sparse layers know of a request beyond its entries (those are in the
groups' `EntryTable`s): its sequence length, the lengths it will reach, its own budget and policy,
the prefix-store blocks it holds between chunks, and its `Phase`. The records are stored column
by column (host tensors), so that a batch's fields are read with one index, without a Python
loop per request.
"""

from __future__ import annotations

from enum import IntEnum

import torch

from sglang_kvsparse.policies import ScoringPolicy


class Phase(IntEnum):
    """Where a request is in its life. A request moves FREE -> ADMITTED (`SparseState.expect`)
    -> (CHUNKED ->)* PREFILLING (SGLang allocated its tokens: `growth.grow_to_lengths`) -> DECODING
    (its last prefill began: `forward_step.begin_extend`) -> FREE (`SparseState.free`, on finish,
    abort or retraction)."""

    FREE = 0  # no request
    ADMITTED = 1  # given its record, its first forward not yet allocated
    CHUNKED = 2  # its prefill continues in a later chunk; it keeps no entries yet
    PREFILLING = 3  # allocated for its last (or only) prefill forward
    DECODING = 4  # each step appends one token


class RequestTable:
    """The records of `size` request indices. A field of an index without a request is 0 (None)."""

    def __init__(self, size: int) -> None:
        self.length = torch.zeros(size, dtype=torch.int64)  # its sequence length in the sparse layers
        self.final_len = torch.zeros(size, dtype=torch.int64)  # prompt + max new tokens, 0: unknown
        self.fill_len = torch.zeros(size, dtype=torch.int64)  # the length its prefill reaches, 0: unknown
        self.budget = torch.zeros(size, dtype=torch.int64)  # its own budget, 0: the groups'
        self.policy: list[ScoringPolicy | None] = [None] * size  # its own policy, None: the server's
        self.phase = torch.zeros(size, dtype=torch.int8)
        self.held: dict[int, torch.Tensor] = {}  # a CHUNKED request's index -> the store blocks its chunks are in

    @property
    def size(self) -> int:
        return self.phase.numel()

    def is_(self, phase: Phase, req_indices: torch.Tensor | None = None) -> torch.Tensor:
        """Which requests (all indices, or these) are in `phase` (bool, host)."""
        phases = self.phase if req_indices is None else self.phase[req_indices]
        return phases == int(phase)

    def running(self) -> torch.Tensor:
        """Which indices hold a request whose tokens SGLang has allocated (bool, host)."""
        return self.phase >= int(Phase.CHUNKED)

    def running_requests(self) -> torch.Tensor:
        """The indices of the running requests."""
        return torch.nonzero(self.running()).flatten()

    def clear(self, req_idx: int) -> None:
        """Forget the request at `req_idx` (the store blocks it held are the caller's to give back)."""
        for column in (self.length, self.final_len, self.fill_len, self.budget, self.phase):
            column[req_idx] = 0
        self.policy[req_idx] = None
        self.held.pop(req_idx, None)

    def reset(self) -> None:
        """Forget every request."""
        for column in (self.length, self.final_len, self.fill_len, self.budget, self.phase):
            column.zero_()
        self.policy = [None] * self.size
        self.held.clear()
