"""The admission hook on a chunked prompt's next chunk (`patches/admission.admit_chunk`): while the
prompt has chunks left, no other request may start a chunk in the same round, whether SGLang
admitted this chunk or refused it for memory. (Found by the soak: a refused continuation left the
round's chunk budget to a new request, and SGLang's scheduler died on `assert self.chunked_req is
None`.)"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture
def admission(monkeypatch):
    from sglang_kvsparse.patches import admission, context
    from sglang_kvsparse.state.requests import Requests

    state = SimpleNamespace(resolved=SimpleNamespace(context_len=8192), requests=Requests(4))
    monkeypatch.setattr(context, "_state", state)
    monkeypatch.setattr(context, "_round", None)
    monkeypatch.setattr(admission, "prefill_charge", lambda *a: 7)
    monkeypatch.setattr(admission, "prefill_guide_rows", lambda *a: 0)
    return admission


class Adder(SimpleNamespace):
    """A stand-in for SGLang's `PrefillAdder` (which, unlike `SimpleNamespace`, takes weak references)."""


def _adder() -> Adder:
    """A `PrefillAdder` in a round already started, with a 512-token chunk budget."""
    from sglang_kvsparse.patches import context
    from sglang_kvsparse.state.admission import AdmissionRound

    adder = Adder(can_run_list=[], rem_chunk_tokens=512)
    context.start_round(adder, AdmissionRound())
    return adder


def _chunked_req() -> SimpleNamespace:
    return SimpleNamespace(
        rid="chunked",
        origin_input_ids=[1] * 3000,
        output_ids=[],
        prefix_len=1024,
        sampling_params=SimpleNamespace(max_new_tokens=16, custom_params=None),
    )


@pytest.mark.parametrize("admitted", [True, False])
def test_a_prompt_with_chunks_left_takes_the_rounds_chunk_budget(admission, admitted):
    adder, req = _adder(), _chunked_req()

    charged = []

    def add_chunked_req(adder, req):  # SGLang: the prompt has chunks left, so it is returned
        charged.append(admission.context.prefill_charge(1536))  # the allocator's reserve asks
        if admitted:
            adder.can_run_list.append(req)
        return req

    assert admission.admit_chunk(add_chunked_req, adder, req) is req
    assert adder.rem_chunk_tokens == 0
    assert charged == [7] and admission.context.prefill_charge(1536) == 0  # charged only during SGLang's call


def test_a_prompts_last_chunk_leaves_the_budget_to_others(admission):
    adder, req = _adder(), _chunked_req()

    def add_chunked_req(adder, req):
        adder.can_run_list.append(req)
        adder.rem_chunk_tokens -= 300
        req.extend_end = req.prefix_len + 300
        return None

    assert admission.admit_chunk(add_chunked_req, adder, req) is None
    assert adder.rem_chunk_tokens == 212


@pytest.mark.parametrize(("remaining_total", "admitted"), [(8000, True), (6000, False)])
def test_a_new_requests_first_chunk_is_admitted_only_if_its_store_rows_fit(monkeypatch, remaining_total, admitted):
    """SGLang checks a new request by its whole prompt (here 3,878 sparse rows, fitting), then
    cuts a first chunk whose store rows (501 tokens x 14 columns = 7,014) it reserved unchecked.
    (Found by the soak: the heap ran out at the forward.)"""
    from sglang.srt.managers.schedule_policy import AddReqResult, _PrefillAdmission

    from sglang_kvsparse.patches import chunking, context

    monkeypatch.setattr(context, "_state", SimpleNamespace(config=SimpleNamespace(window=32)))
    adder = SimpleNamespace(
        page_size=1,
        memory_budget=SimpleNamespace(remaining_total=remaining_total),
        ceil_paged_tokens=lambda tokens: tokens,
        _request_slot_reserve_for_req=lambda req, extend_input_len: 14 * extend_input_len,
    )
    req = SimpleNamespace(full_untruncated_fill_ids=[1] * 533)
    chunk = _PrefillAdmission(prefix_len=0, extend_len=501, max_new_tokens=0, is_chunked=True, replay_len=0)
    result = chunking.fit_admission(lambda adder, req: chunk, adder, req)
    assert result is chunk if admitted else result == AddReqResult.NO_TOKEN


@pytest.mark.parametrize("transient_rows", [0, 28_000])
def test_a_request_refused_while_guided_prefills_hold_rows_is_tried_next_round(monkeypatch, transient_rows):
    """A guided prefill's waiting tokens hold heap rows only until its forward has been issued.
    A request SGLang refuses for memory in the same round is put off to the next round (OTHER),
    not left to mark the batch full until a running request leaves (NO_TOKEN); without such rows
    in the round the refusal stands."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    from sglang_kvsparse.patches import admission, context
    from sglang_kvsparse.state.admission import AdmissionRound
    from sglang_kvsparse.state.counters import Counters
    from sglang_kvsparse.state.requests import Requests

    state = SimpleNamespace(
        resolved=SimpleNamespace(context_len=8192, request_cap=8192),
        store=None,
        counters=Counters(),
        requests=Requests(4),
    )
    monkeypatch.setattr(context, "_state", state)
    monkeypatch.setattr(context, "_round", None)
    monkeypatch.setattr(admission, "prefill_charge", lambda *a: 0)
    monkeypatch.setattr(admission, "prefill_guide_rows", lambda *a: transient_rows)
    adder = Adder(can_run_list=[], new_chunked_req=None, tree_cache=None)
    context.start_round(adder, AdmissionRound())

    def request() -> SimpleNamespace:
        return SimpleNamespace(
            rid="r",
            to_finish=None,
            origin_input_ids=[1] * 2000,
            output_ids=[],
            prefix_len=0,
            sampling_params=SimpleNamespace(max_new_tokens=32, custom_params=None),
        )

    def add_one_req(adder, req):  # SGLang: the first fits, the second does not
        if adder.can_run_list:
            return AddReqResult.NO_TOKEN
        req.extend_end = len(req.origin_input_ids)
        adder.can_run_list.append(req)
        return AddReqResult.CONTINUE

    assert admission.admit(add_one_req, adder, request()) == AddReqResult.CONTINUE
    refused = admission.admit(add_one_req, adder, request())
    assert refused == (AddReqResult.OTHER if transient_rows else AddReqResult.NO_TOKEN)
    assert state.counters.guide_waits == int(bool(transient_rows))
