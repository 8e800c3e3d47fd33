"""What one forward's sparse layers read and write: the plans `planning.py` builds from the
state and its step (`steps.py`), which every sparse layer reads (`sparse_attention.py`). Plain
frozen records of tensors; no SGLang imports."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sglang_kvsparse.kernels.common import Segments
from sglang_kvsparse.policies import ScoringPolicy
from sglang_kvsparse.state.layout import LayerPlace


@dataclass(frozen=True)
class Eviction:
    """The decode evictions of one group's requests that keep the same `budget` by the same
    `policy` (None: the server's), in every column of the group at once: `slots` [columns, N,
    n_old] their old rows, in position order, `score_slots` their score slots; the forward keeps
    `budget` of each request's in its first `budget` rows (`eviction.evict_planned`)."""

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
    `kept` ([B] on the host, a prefill's): each request's entries kept in the column (0 for a
    chunk before its prompt's last), and `device_budgets` the budgets on the device, so a
    selection sizes its rows without reading anything back.
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
    kept: torch.Tensor | None = None
    device_budgets: torch.Tensor | None = None


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
    request-major: `keys` bounds the requests' keys (each key's request and position computed once,
    for every layer). `prefix_positions`/`new_positions` say where the prefixes' store entries and
    the batch's new tokens go in that layout (None when no request has a prefix: the keys are the
    new tokens, bounded by `qo_indptr`). `keeps` [B] (None: all) marks
    the requests that keep entries: a chunk before a prompt's last keeps none (its tokens are
    only stored), and `kept_positions` are then the sequence positions of the requests that do.
    `store_positions`: which of the batch's new tokens the columns' `store_slots` store;
    `work_positions`: those of guided requests, which wait in the columns' `work_slots`.
    `policy_groups` (a prefill): when some request has a policy of its own, every policy of the
    batch with its requests (empty: the server's policy serves them all). `row_kinds` (a decode
    step) [B, 2] int32: each request's policy's `decode_rule` (score update, first score), when
    some request decodes otherwise than the server's policy (None: every row as the server's); a
    captured step always reads them (its buffers'). `sentences` [total_kv] int64: each key's
    sentence (a prefill on a server that knows its tokens;
    `sglang_kvsparse.policies.sentences.sentence_numbers`), else None. `evictions`: a decode step's,
    one per group and (budget, policy) among its evicting requests. `max_q_len` (a prefill): the
    most new tokens of a request, known on the host, so the kernels size their launches without
    reading the boundaries back from the device (None: they read them), as `keys.max_len` does
    for the keys.
    """

    qo_indptr: torch.Tensor
    columns: tuple[tuple[ColumnPlan, ...], ...]  # [group][column]; a decode step's: () (`column`)
    sink: int = 0
    window: int = 0
    keys: Segments | None = None  # a prefill's
    prefix_positions: torch.Tensor | None = None
    new_positions: torch.Tensor | None = None
    keeps: torch.Tensor | None = None
    kept_positions: torch.Tensor | None = None
    store_positions: torch.Tensor | None = None
    work_positions: torch.Tensor | None = None
    decode_tables: tuple[DecodeTables, ...] = ()  # [group], decode plans only
    evictions: tuple[Eviction, ...] = ()
    policy_groups: tuple[PolicyGroup, ...] = ()
    row_kinds: torch.Tensor | None = None
    sentences: torch.Tensor | None = None
    max_q_len: int | None = None

    def column(self, place: LayerPlace) -> ColumnPlan:
        """The column's plan: a prefill's from `columns`; a decode step's (whose `columns` is
        empty) made from its group's tables when a layer asks, so that a step replayed from a
        captured graph, whose layers never ask, dispatches no per-column views."""
        if self.decode_tables:
            return self.decode_tables[place.group].column(place.column)
        return self.columns[place.group][place.column]


@dataclass(frozen=True)
class MixedPlan:
    """A prefill and running requests' decode step in one forward (SGLang's mixed chunk): the
    batch's first `extend_tokens` tokens are the prefill's, one token per decoding row follows."""

    extend: ForwardPlan
    decode: ForwardPlan
    extend_tokens: int
