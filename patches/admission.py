"""Admission to the sparse pools (SGLang 0.5.23 prefill scheduling).

AROUND `PrefillAdder.add_one_req`: SGLang asks this once per waiting request while it builds a
prefill batch, one `PrefillAdder` per round. Before SGLang's own checks (full-pool tokens, request
slots) the request must fit the sparse pools (`sglang_kvsparse.admission.SparseAdmission`, created
on the adder's first call from its running batch); when it does not, the answer is SGLang's own
"no room" (`AddReqResult.NO_TOKEN`), so the request waits in the queue as it would in stock SGLang.
A request with a radix-cache hit is also charged the prefix store pages it pins (its prefill reads
them). A request that would reuse much more of a prompt admitted in the same round waits for the
next round (`AddReqResult.OTHER`: SGLang stops adding for this round, without marking the batch
full), when that prompt is in the cache.
"""

from __future__ import annotations

from typing import Any

import torch
from sglang.srt.managers.schedule_policy import AddReqResult

from sglang_kvsparse.admission import SparseAdmission

from . import memory

TARGET = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"

_ROUND = "_kvsparse_admission"


def final_len(req: Any, context_len: int) -> int:
    """The most tokens a request can reach: its prompt plus max_new_tokens, within the context."""
    max_new = req.sampling_params.max_new_tokens
    return context_len if max_new is None else min(len(req.origin_input_ids) + max_new, context_len)


def admit(original: Any, adder: Any, req: Any, *args: Any, **kwargs: Any) -> Any:
    """The AROUND hook: refuse with NO_TOKEN unless the sparse pools can take the request."""
    state = memory.STATE
    context_len = state.resolved.context_len
    round_ = adder.__dict__.get(_ROUND)
    if round_ is None:
        running = [] if adder.running_batch is None else adder.running_batch.reqs
        rows = [(r.kv.req_pool_idx, final_len(r, context_len)) for r in running if r.kv.req_pool_idx is not None]
        round_ = SparseAdmission(state, rows)
        setattr(adder, _ROUND, round_)
    need = final_len(req, context_len)
    prefix = prefix_ids(adder.tree_cache, req)
    token_ids = req.origin_input_ids + req.output_ids if state.stores else ()
    if token_ids and round_.should_wait(token_ids, req.prefix_len):
        return AddReqResult.OTHER  # ends this round's admission; first in line for the next
    if not round_.fits(need, prefix):
        return AddReqResult.NO_TOKEN
    admitted_before = len(adder.can_run_list)
    result = original(adder, req, *args, **kwargs)
    if len(adder.can_run_list) > admitted_before:
        round_.reserve(need, prefix, token_ids)
    return result


def prefix_ids(tree_cache: Any, req: Any) -> torch.Tensor | None:
    """SGLang's full-pool ids of the request's matched prefix (CPU), None without a match."""
    if not req.prefix_len or not memory.STATE.stores:
        return None
    return tree_cache.prefix_device_indices(req).to("cpu")
