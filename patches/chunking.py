"""Chunked prefill with sparse layers (SGLang 0.5.23 prefill scheduling): the last chunk of a
prompt holds every query the policies score with.

A prompt's sparse layers select what they keep in its last chunk, scoring every key of the prompt
with the last `window` tokens' queries. Queries of an earlier chunk are gone by then, so SGLang's
cut is moved so that the last chunk is at least `window` tokens long: a
chunked prompt then selects exactly what the unchunked prompt selects (`SparseState`, "partial"
rows, keeps the earlier chunks' K/V in the prefix store until then).

* AROUND `PrefillAdder._select_prefill_admission` (a new request's first chunk): a cut leaving
  fewer than `window` tokens is moved back (to a page edge); when that would empty the chunk the
  request waits for the next round (`AddReqResult.OTHER`), when the chunk budget is whole again.
  The chunk is admitted only if its own sparse charge fits (`chunk_fits`).
* AROUND `PrefillAdder.floor_chunked_tokens` (a chunked request's next chunk, and SGLang's
  ignore-eos path): the same move. Should it empty the chunk (the round's memory allows fewer
  than `window` tokens for a chunk that is not the last), the cut stays and the last chunk's
  queries are what it holds: never seen with chunk sizes above `window`, and logged.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from sglang.srt.managers.schedule_policy import AddReqResult

from sglang_kvsparse.state.admission import window_safe_cut

from . import context

logger = logging.getLogger(__name__)


def fit_admission(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook on `_select_prefill_admission` (see the module doc)."""
    admission = original(adder, req, *args, **kwargs)
    if isinstance(admission, AddReqResult) or not admission.is_chunked:
        return admission
    remaining = len(req.full_untruncated_fill_ids) - admission.prefix_len
    cut = window_safe_cut(admission.extend_len, remaining, context.state().config.window, adder.page_size)
    if cut <= 0:
        return AddReqResult.OTHER
    if not chunk_fits(adder, req, cut):
        return AddReqResult.NO_TOKEN
    return admission if cut == admission.extend_len else dataclasses.replace(admission, extend_len=cut)


def chunk_fits(adder: Any, req: Any, chunk: int) -> bool:
    """Whether a new request's first chunk of `chunk` tokens fits the round's memory budget.

    SGLang checks a new request against what its whole prompt takes, then cuts it into a chunk
    and reserves that chunk's charge unchecked: in stock SGLang a chunk never costs more than the
    whole. With sparse layers it can: a chunk before the prompt's last keeps every token in the
    prefix store (one row per sparse column each), the whole prompt only its budget. Unchecked,
    the chunk's store rows are missing from the heap at the forward (found by `bench/soak.py`)."""
    reserve = adder._request_slot_reserve_for_req(req, extend_input_len=chunk)
    return adder.ceil_paged_tokens(chunk) + reserve < adder.memory_budget.remaining_total


def fit_floor(original: Any, adder: Any, trunc_len: int, remaining: int) -> int:
    """The AROUND hook on `floor_chunked_tokens` (see the module doc)."""
    chunk = original(adder, trunc_len, remaining)
    cut = window_safe_cut(chunk, remaining, context.state().config.window, adder.page_size)
    if cut > 0:
        return cut
    logger.warning(
        "kvsparse: a %d-token chunk leaves %d tokens, fewer than the observation window", chunk, remaining - chunk
    )
    return chunk
