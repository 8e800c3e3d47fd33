"""Each request's record in the sparse layers, at SGLang's request index (`req_pool_idx`; no
SGLang imports).

A record holds what the sparse layers know of a request beyond its entries (those are in the
groups' `EntryTable`s) and the store blocks its chunked prompt holds (`PrefixStore.held_by`): its
sequence length, the lengths it will reach, its own budget and policy (its setting, parsed once,
when it arrives: `arrive`) and its `Phase`, which changes only through `move` (an illegal move
raises). The records are stored column by column (host tensors), so that a batch's fields are
read with one index, without a Python loop per request.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from enum import IntEnum

import torch

from sglang_kvsparse.config.request_sparsity import SERVER_GROUPING, RequestSparsity
from sglang_kvsparse.policies import ScoringPolicy


class Phase(IntEnum):
    """Where a request is in its life at its index. FREE -> ADMITTED (SGLang gave it the index:
    `SparseState.expect`) -> CHUNKED* (a chunk before its prompt's last was allocated) ->
    PREFILLING (its last, or only, prefill forward was allocated) -> DECODING (its first decode
    token was allocated: the prefill has run) -> FREE (finished, aborted or retracted:
    `SparseState.free`). A retracted request comes back at a new index, ADMITTED again."""

    FREE = 0  # no request
    ADMITTED = 1  # given its index, its first forward not yet allocated
    CHUNKED = 2  # its prefill continues in a later chunk; it keeps no entries yet
    PREFILLING = 3  # allocated for its last (or only) prefill forward
    DECODING = 4  # each step appends one token


#: The phases a request may move to each phase from (FREE from any: finish, abort, retraction).
MOVES: dict[Phase, frozenset[Phase]] = {
    Phase.FREE: frozenset(Phase),
    Phase.ADMITTED: frozenset({Phase.FREE}),
    Phase.CHUNKED: frozenset({Phase.ADMITTED, Phase.CHUNKED}),
    Phase.PREFILLING: frozenset({Phase.ADMITTED, Phase.CHUNKED}),
    Phase.DECODING: frozenset({Phase.PREFILLING, Phase.DECODING}),
}


class PhaseError(RuntimeError):
    """A request was moved to a phase it cannot reach from where it is (a bug in the caller)."""


class Requests:
    """The records of `size` request indices. A field of an index without a request is 0 (None)."""

    def __init__(self, size: int) -> None:
        self.length = torch.zeros(size, dtype=torch.int64)  # its sequence length in the sparse layers
        self.final_len = torch.zeros(size, dtype=torch.int64)  # prompt + max new tokens, 0: unknown
        self.fill_len = torch.zeros(size, dtype=torch.int64)  # the length its prefill reaches, 0: unknown
        self.budget = torch.zeros(size, dtype=torch.int64)  # its own budget, 0: the groups'
        self.policy: list[ScoringPolicy | None] = [None] * size  # its own policy, None: the server's
        self.phase = torch.zeros(size, dtype=torch.int8)
        #: The settings of requests that arrived and have no index yet, by SGLang's rid, parsed
        #: once (`arrive`); those not asked for during a whole admission round are dropped.
        self._arrived: dict[str, RequestSparsity] = {}
        self._arrived_before: dict[str, RequestSparsity] = {}

    @property
    def size(self) -> int:
        return self.phase.numel()

    # -- arrival ----------------------------------------------------------------------------
    def arrive(self, rid: str, parse: Callable[[], RequestSparsity]) -> RequestSparsity:
        """The setting of the waiting request `rid`: `parse()` the first time it is asked for,
        the same object after."""
        setting = self._arrived.get(rid) or self._arrived_before.pop(rid, None) or parse()
        self._arrived[rid] = setting
        return setting

    def new_round(self) -> None:
        """An admission round starts: forget the settings not asked for since the last one
        (requests that were admitted, or left the queue)."""
        self._arrived_before, self._arrived = self._arrived, {}

    # -- phases -------------------------------------------------------------------------------
    def move(self, req_indices: torch.Tensor, to: Phase) -> None:
        """Move these requests (host [n]) to phase `to`; PhaseError (changing nothing) when one
        cannot reach it from where it is (`MOVES`)."""
        if req_indices.numel() == 0:
            return
        now = self.phase[req_indices]
        allowed = torch.tensor([int(p) for p in MOVES[to]], dtype=now.dtype)
        wrong = ~torch.isin(now, allowed)
        if bool(wrong.any()):
            moves = ", ".join(
                f"{i} {Phase(int(p)).name}" for i, p in zip(req_indices[wrong].tolist(), now[wrong].tolist())
            )
            raise PhaseError(f"requests cannot move to {to.name} from where they are: {moves}")
        self.phase[req_indices] = int(to)

    def admit(
        self,
        req_indices: torch.Tensor,
        final_lens: torch.Tensor,
        fill_lens: torch.Tensor | None,
        settings: Iterable[RequestSparsity],
        own_budget: Callable[[RequestSparsity], int],
    ) -> torch.Tensor:
        """SGLang gave these requests their indices: record the lengths they reach and their
        settings, and move the new ones (FREE) to ADMITTED (a chunked prompt's later chunks keep
        the record of its first). Returns which were new (bool [n])."""
        settings = list(settings)
        self.final_len[req_indices] = final_lens
        if fill_lens is not None:
            self.fill_len[req_indices] = fill_lens
        self.budget[req_indices] = torch.tensor([own_budget(s) for s in settings], dtype=torch.int64)
        for req_idx, setting in zip(req_indices.tolist(), settings):
            self.policy[req_idx] = setting.policy
        new = self.is_(Phase.FREE, req_indices)
        self.move(req_indices[new], Phase.ADMITTED)
        return new

    def set_length(self, req_indices: torch.Tensor, lengths: torch.Tensor) -> None:
        """These requests' sequences are now `lengths` long (SGLang allocated their tokens)."""
        self.length[req_indices] = lengths

    def release(self, req_idx: int) -> None:
        """Forget the request at `req_idx` (FREE)."""
        self.move(torch.tensor([req_idx]), Phase.FREE)
        for column in (self.length, self.final_len, self.fill_len, self.budget):
            column[req_idx] = 0
        self.policy[req_idx] = None

    def reset(self) -> None:
        """Forget every request."""
        for column in (self.length, self.final_len, self.fill_len, self.budget, self.phase):
            column.zero_()
        self.policy = [None] * self.size

    # -- queries ------------------------------------------------------------------------------
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

    def own_settings(self) -> set[tuple[int, ScoringPolicy | None]]:
        """The distinct own settings (own budget, policy) of the running requests, as the sparse
        layers group them (`RequestSparsity.grouping`); the server's is not one."""
        running = self.running_requests().tolist()
        return {(int(self.budget[i]), self.policy[i]) for i in running} - {SERVER_GROUPING}

    def held_requests(self) -> torch.Tensor:
        """The indices holding a request in any phase."""
        return torch.nonzero(self.phase).flatten()
