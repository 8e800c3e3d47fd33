"""What one forward's sparse layers read and write: what a forward changed in the state
(`ExtendStep`, `EvictingRequests`: `SparseState.begin_extend` / `begin_decode`), and the plans
`planning.py` builds from them and the state, which the attention backend hands to every sparse
layer (`sparse_attention.py`). Plain frozen records of tensors; no SGLang imports."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.layout import LayerPlace
from sglang_kvsparse.policies import ScoringPolicy


@dataclass(frozen=True)
class Eviction:
    """The decode evictions of one group's requests that keep the same `budget` by the same
    `policy` (None: the server's), in every column of the group at once: `slots` [columns, N,
    n_old] their old rows, in position order, `score_slots` their score slots; the forward keeps
    `budget` of each request's in its first `budget` rows (`sparse_attention.evict_planned`)."""

    group: int
    budget: int
    slots: torch.Tensor
    score_slots: torch.Tensor
    policy: ScoringPolicy | None = None


@dataclass(frozen=True)
class PolicyGroup:
    """The requests of a batch that one policy serves: `members` [n] their positions in the batch
    and `mask` [B] the same as a mask, both on the device (None: every request)."""

    policy: ScoringPolicy
    members: torch.Tensor | None
    mask: torch.Tensor | None


@dataclass(frozen=True)
class ColumnPlan:
    """Kernel inputs of one sparse column (its layers read the same rows, each in its own lane).

    `new_slots`/`new_score_slots`: where the forward's kept tokens go (decode: one per request;
    prefill: the requests' rows, request-major). `budgets` ([B] on the host: each request's own)
    and `compress` (some prefill request is longer than its budget) tell the prefill whether and
    how much to select.
    Decode: `kv_lens` [B] and `kv_indices` [B, W] (each request's rows in position order, padded
    with valid rows past its length), `score_indices` [B, W] their score slots (the lane's score
    view): the decode kernel's table layout.
    `guided` ([B] on the host; None without guide layers): the requests a selecting prefill keeps
    by the cross-layer guide (`SparseState.guided`), and `work_slots` the heap rows their new
    tokens (at `ForwardPlan.work_positions`) wait in until the guide has chosen.
    Prefill with the prefix store: `prefix_slots` (the matched prefixes' store rows, request-major,
    aligned with `ForwardPlan.prefix_positions`) and `store_slots` (where the new tokens at
    `ForwardPlan.store_positions` are stored, for later hits or the prompt's next chunk).
    """

    new_slots: torch.Tensor
    new_score_slots: torch.Tensor
    budgets: torch.Tensor | None = None
    compress: bool = False
    kv_lens: torch.Tensor | None = None
    kv_indices: torch.Tensor | None = None
    score_indices: torch.Tensor | None = None
    prefix_slots: torch.Tensor | None = None
    store_slots: torch.Tensor | None = None
    guided: torch.Tensor | None = None
    work_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class DecodeTables:
    """One group's decode inputs for B requests, shared by its columns (column c is `[..., c]`
    of the tables, `[c]` of the newest entries).

    `lengths` [B] int64; `entries` and `score_slots` [B, W, columns]: each request's rows and
    score slots in position order, padded past its length with valid ones (the padding row and
    its scratch score slots); `newest` and `newest_scores` [columns, B]: where the step's token
    goes."""

    lengths: torch.Tensor
    entries: torch.Tensor
    score_slots: torch.Tensor
    newest: torch.Tensor
    newest_scores: torch.Tensor

    def column(self, c: int) -> ColumnPlan:
        return ColumnPlan(
            self.newest[c],
            self.newest_scores[c],
            kv_lens=self.lengths,
            kv_indices=self.entries[..., c],
            score_indices=self.score_slots[..., c],
        )


@dataclass(frozen=True)
class ForwardPlan:
    """Everything the sparse layers of one forward need beyond their lane buffers.

    A prefill attends over each request's whole sequence, prefix then new tokens, laid out
    request-major with boundaries `kv_indptr` (`qo_indptr` when no request has a prefix).
    `prefix_positions`/`new_positions` say where the prefixes' store entries and the batch's new
    tokens go in that layout (None when no request has a prefix). `keeps` [B] (None: all) marks
    the requests that keep entries: a chunk before a prompt's last keeps none (its tokens are
    only stored), and `kept_positions` are then the sequence positions of the requests that do.
    `store_positions`: which of the batch's new tokens the columns' `store_slots` store;
    `work_positions`: those of guided requests, which wait in the columns' `work_slots`.
    `policy_groups`: when some request has a policy of its own, every policy of the batch with its
    requests (empty: the server's policy serves them all). `sentence_ends` [total_kv] bool: the
    sequence's keys whose token ends a sentence (a prefill on a server that knows its tokens;
    `sglang_kvsparse.sentences`), else None. `evictions`: a decode step's, one per group and
    (budget, policy) among its evicting requests.
    """

    qo_indptr: torch.Tensor
    columns: tuple[tuple[ColumnPlan, ...], ...]  # [group][column]
    sink: int = 0
    window: int = 0
    kv_indptr: torch.Tensor | None = None
    prefix_positions: torch.Tensor | None = None
    new_positions: torch.Tensor | None = None
    keeps: torch.Tensor | None = None
    kept_positions: torch.Tensor | None = None
    store_positions: torch.Tensor | None = None
    work_positions: torch.Tensor | None = None
    decode_tables: tuple[DecodeTables, ...] = ()  # [group], decode plans only
    evictions: tuple[Eviction, ...] = ()
    policy_groups: tuple[PolicyGroup, ...] = ()
    sentence_ends: torch.Tensor | None = None

    def column(self, place: LayerPlace) -> ColumnPlan:
        return self.columns[place.group][place.column]


@dataclass(frozen=True)
class MixedPlan:
    """A prefill and running requests' decode step in one forward (SGLang's mixed chunk): the
    batch's first `extend_tokens` tokens are the prefill's, one token per decoding row follows."""

    extend: ForwardPlan
    decode: ForwardPlan
    extend_tokens: int


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
