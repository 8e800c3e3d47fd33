"""Admission with sparse layers (SGLang 0.5.23 prefill scheduling).

AROUND `PrefillAdder.add_one_req`: SGLang asks this once per waiting request while it builds a
prefill batch, one `PrefillAdder` per round. On the round's first call the running requests' sparse
growth is added to SGLang's budget (`admission.running_growth`); what the previous forward held went
back when SGLang issued it (`attention.release_after_forward`, the one caller of `finish_forward`).
For each request the heap allocator's `request_slot_reserve`, which SGLang adds to the request's
charge on every admission path, answers the sparse rows of the prefill SGLang is sizing while it
decides (`AdmissionRound.charge`, `admission.prefill_charge`: a chunk before the prompt's last
takes store rows, the last chunk the request's entries); a request reusing a cached prefix pins the
prefix's store blocks first (unpinned if the request is not admitted after all). AROUND
`PrefillAdder.add_chunked_req` does the same for the next chunk of a chunked prompt; once a chunk
before its prompt's last is admitted, no other request starts a chunk in that round (SGLang tracks
one chunked request). A request that would reuse much more of a prompt admitted in the same round
waits for the next round (`AddReqResult.OTHER`: SGLang stops adding for this round without marking
the batch full). A request whose own setting would be one more than `max_distinct_settings` among
the running and admitted ones sits this round out and stays first in the queue
(`AddReqResult.CONTINUE`: SGLang goes on to the next request). A request refused for memory while
this round's guided prefills hold rows that come back after their forward ends the round
(`AddReqResult.OTHER`) instead of marking the batch full, so it is tried again next round rather
than after a running request leaves. A fault in this per-request work fails the request alone
(`patches/faults.py`).

AFTER `ReqToTokenPool.alloc` (`expect_lengths`): when SGLang gives admitted requests their indices,
the state learns how long each may grow, so that only requests that will evict get score rows, how
long its prefill is, so that a shorter allocation is known to be a chunk, and the request's own
sparsity setting (`custom_params`, `request_sparsity.py`), which every charge above uses too.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from sglang.srt.managers.schedule_policy import CLIP_MAX_NEW_TOKENS, AddReqResult

from sglang_kvsparse.config.request_sparsity import (
    SERVER_GROUPING,
    RequestSparsity,
    one_setting_too_many,
    parse_request,
)
from sglang_kvsparse.state.admission import AdmissionRound, prefill_charge, prefill_guide_rows, running_growth

from . import context, faults


def final_len(req: Any, context_len: int, clip: int = CLIP_MAX_NEW_TOKENS) -> int:
    """The length a request may reach: its tokens so far plus its remaining max_new_tokens
    (clipped at `clip`, as SGLang's admission plans), within the context."""
    held = len(req.origin_input_ids) + len(req.output_ids)
    max_new = req.sampling_params.max_new_tokens
    if max_new is None:
        return context_len
    return min(held + min(max(max_new - len(req.output_ids), 0), clip), context_len)


def expect_lengths(result: Any, pool: Any, reqs: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER hook: requests got their indices; tell the state the most each may grow to (unclipped:
    a request that might evict must keep scores)."""
    if result is None:
        return
    state = context.state()
    context_len = state.resolved.context_len
    state.expect(
        [r.kv.req_pool_idx for r in reqs],
        [final_len(r, context_len, clip=context_len) for r in reqs],
        [fill_len(r) for r in reqs],
        [setting(r) for r in reqs],
    )


def setting(req: Any) -> RequestSparsity:
    """The request's own sparsity setting (checked in the HTTP process: `validation.py`), parsed
    once, when it arrives (`Requests.arrive`)."""
    state = context.state()
    return state.requests.arrive(req.rid, lambda: parse_request(req.sampling_params.custom_params, state.resolved))


def fill_len(req: Any) -> int:
    """The length the request's prefill reaches (its prompt, and any output of an earlier run)."""
    return len(req.origin_input_ids) + len(req.output_ids)


@contextmanager
def charging(round_: AdmissionRound, req: Any) -> Iterator[None]:
    """While SGLang sizes a prefill of `req`, the allocator's reserve includes its sparse rows."""
    state = context.state()
    fill, final = fill_len(req), final_len(req, state.resolved.context_len)
    budget = setting(req).own_budget(state.resolved)

    def charge(end: int) -> int:
        return prefill_charge(state, req.prefix_len, end, fill, final, budget)

    with round_.charging(charge):
        yield


def admit(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook (see the module doc)."""
    if faults.sits_out(req):
        return AddReqResult.CONTINUE
    state = context.state()
    round_ = context.admission_round(adder) or _start_round(adder)
    token_ids, prefix = (), None
    if req.to_finish is None:  # one SGLang aborts prefills a single token: nothing to check or pin
        if _one_setting_too_many(adder, req):
            state.counters.add(setting_waits=1)
            return AddReqResult.CONTINUE  # stays in the queue; SGLang goes on to the next request
        with faults.request_guard(req, "admission"):
            token_ids = req.origin_input_ids + req.output_ids if state.store is not None else ()
            if token_ids and round_.should_wait(token_ids, req.prefix_len):
                return AddReqResult.OTHER  # ends this round's admission; first in line for the next
            prefix = prefix_ids(adder.tree_cache, req)
            if prefix is not None:
                state.pin_prefix(prefix)
            faults.inject("admission", req)
        if faults.sits_out(req):
            if prefix is not None:
                state.unpin_prefix(prefix)
            return AddReqResult.CONTINUE
    admitted_before = len(adder.can_run_list)
    with charging(round_, req):
        result = original(adder, req, *args, **kwargs)
    if len(adder.can_run_list) > admitted_before:
        budget = setting(req).own_budget(state.resolved)
        round_.admitted(token_ids, prefill_guide_rows(state, req.prefix_len, req.extend_end, fill_len(req), budget))
        if adder.new_chunked_req is req:
            _spend_chunk_budget(adder)
            result = adder.budget_state()
        return result
    if prefix is not None:
        state.unpin_prefix(prefix)
    if result == AddReqResult.NO_TOKEN and round_.short_for_now():
        state.counters.add(guide_waits=1)
        return AddReqResult.OTHER  # first in line next round, when the guided prefills' rows are back
    return result


def _one_setting_too_many(adder: Any, req: Any) -> bool:
    """Whether the request's own setting would be one more than `max_distinct_settings` among
    the running requests and those admitted this round."""
    resolved = context.state().resolved
    running = context.state().requests.own_settings()
    running |= {setting(other).grouping(resolved) for other in adder.can_run_list} - {SERVER_GROUPING}
    return one_setting_too_many(setting(req), running, resolved)


def admit_chunk(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND `add_chunked_req`: the next chunk of a chunked prompt is charged its sparse rows.

    While the prompt has chunks left (SGLang returns it), no other request starts a chunk this
    round, whether this chunk was admitted or refused for memory: SGLang tracks one chunked
    request, and a new one beside a refused continuation fails its `chunked_req is None` assertion
    (stock's charge always fits a continuation; the sparse charge may not, until rows free)."""
    round_ = context.admission_round(adder) or _start_round(adder)
    with charging(round_, req):
        result = original(adder, req, *args, **kwargs)
    if result is not None:
        _spend_chunk_budget(adder)
    elif req in adder.can_run_list:  # its last chunk: a guided one holds rows for its forward
        state = context.state()
        budget = setting(req).own_budget(state.resolved)
        round_.admitted((), prefill_guide_rows(state, req.prefix_len, req.extend_end, fill_len(req), budget))
    return result


def _spend_chunk_budget(adder: Any) -> None:
    """A chunk before its prompt's last was admitted: no other request starts a chunk this round.

    In stock SGLang such a chunk takes the round's whole chunk budget; the window-safe cut
    (`patches/chunking.py`) can leave a few tokens of it, and SGLang tracks one chunked request
    at a time, so the rest of the budget is given up as stock would have used it."""
    if adder.rem_chunk_tokens is not None:
        adder.rem_chunk_tokens = 0


def _start_round(adder: Any) -> AdmissionRound:
    state = context.state()
    running = [] if adder.running_batch is None else adder.running_batch.reqs
    context_len = state.resolved.context_len
    growing = [
        (r.kv.req_pool_idx, final_len(r, context_len), 1.0 if r.sampling_params.ignore_eos else adder.new_token_ratio)
        for r in running
        if r.kv.req_pool_idx is not None
    ]
    adder.memory_budget.total_offset += running_growth(state, growing)
    state.requests.new_round()
    round_ = AdmissionRound()
    context.start_round(adder, round_)
    return round_


def prefix_ids(tree_cache: Any, req: Any) -> torch.Tensor | None:
    """SGLang's full-pool ids of the request's matched prefix (CPU), None without a match."""
    if not req.prefix_len or context.state().store is None:
        return None
    return tree_cache.prefix_device_indices(req).to("cpu")
