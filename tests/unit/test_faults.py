"""The per-request fault guard of the sparse scheduler work (`patches/faults.py`): a fault fails
the request it belongs to through SGLang's abort (an HTTP 500 naming it), the request sits out one
admission round, and the injection variable raises only for the rids and point it names."""

from __future__ import annotations

from http import HTTPStatus

import pytest

from sglang_kvsparse.patches import faults


class FakeReq:
    def __init__(self, rid: str):
        self.rid = rid
        self.aborted: tuple | None = None

    def set_finish_with_abort(self, error_msg: str, status_code: int, err_type: str) -> None:
        self.aborted = (error_msg, status_code, err_type)


def test_a_fault_in_guarded_work_fails_only_that_request_once():
    req, other = FakeReq("a"), FakeReq("b")
    with faults.request_guard(req, "admission"):
        raise KeyError("no store entry")
    with faults.request_guard(other, "admission"):
        pass
    message, status, kind = req.aborted
    assert "sparse layers' admission: KeyError" in message and "no store entry" in message
    assert (status, kind) == (HTTPStatus.INTERNAL_SERVER_ERROR, "InternalServerError")
    assert other.aborted is None and not faults.sits_out(other)
    assert faults.sits_out(req) and not faults.sits_out(req)  # one round only


def test_injection_raises_for_the_named_point_and_rid_prefix_only(monkeypatch):
    monkeypatch.setenv(faults.FAULT_ENV, "admission:bad-,match:worse-")
    with pytest.raises(faults.InjectedFault, match="admission for request bad-1"):
        faults.inject("admission", FakeReq("bad-1"))
    faults.inject("match", FakeReq("bad-1"))
    faults.inject("admission", FakeReq("good-1"))
    with pytest.raises(faults.InjectedFault):
        faults.inject("match", FakeReq("worse-2"))


def test_injection_is_off_without_the_variable_and_refuses_a_bad_one(monkeypatch):
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    faults.inject("admission", FakeReq("anything"))
    monkeypatch.setenv(faults.FAULT_ENV, "forward:x")
    with pytest.raises(ValueError, match="point"):
        faults.inject("admission", FakeReq("x"))
