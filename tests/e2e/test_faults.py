"""A fault in the sparse layers' per-request scheduler work fails that request alone
(`patches/faults.py`): the "evicting" server injects one for requests whose rid says so, at the
admission (after the request's prefix is pinned) or while its radix match is capped at the prefix
store. The faulty request gets an HTTP 500 naming the fault; the requests in flight beside it
finish with the outputs they give alone; the server stays healthy and every slot comes back."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from kvsparse_testbed.texts import essay_text

from .conftest import FAULT_ADMISSION_RID, FAULT_MATCH_RID
from .servers import assert_at_rest

pytestmark = pytest.mark.e2e

MAX_NEW = 24


def _post(url: str, text: str, rid: str | None = None) -> requests.Response:
    payload = {"text": text, "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0}}
    return requests.post(f"{url}/generate", json=payload | ({"rid": rid} if rid else {}), timeout=600)


def _assert_fault_fails_only_its_request(server, faulty_text: str, rid: str, where: str) -> None:
    text = essay_text(20000)
    others = [text[3000 + i * 700 : 3000 + (i + 1) * 700] for i in range(2)]  # ~150 tokens each
    with ThreadPoolExecutor(len(others) + 1) as pool:
        beside = [pool.submit(_post, server.url, t) for t in others]
        faulty = pool.submit(_post, server.url, faulty_text, rid)
        responses = [f.result() for f in beside]
        failed = faulty.result()
    assert failed.status_code == 500, failed.text
    assert f"kvsparse: internal error in the sparse layers' {where}" in failed.json()["message"]
    assert all(r.status_code == 200 for r in responses)
    assert [r.json()["output_ids"] for r in responses] == [_post(server.url, t).json()["output_ids"] for t in others]
    assert requests.get(f"{server.url}/health", timeout=60).status_code == 200
    assert_at_rest(server)


def test_a_fault_in_admission_fails_only_its_request(evicting_server):
    prompt = essay_text(2000)[:1500]
    _assert_fault_fails_only_its_request(evicting_server, prompt, FAULT_ADMISSION_RID + "1", "admission")


def test_a_fault_while_matching_a_cached_prefix_fails_only_its_request(evicting_server):
    """The match is capped only on a radix hit: the prompt is cached first, then extended."""
    prompt = essay_text(2000)[:1500]
    assert _post(evicting_server.url, prompt).status_code == 200
    _assert_fault_fails_only_its_request(evicting_server, prompt + " And then?", FAULT_MATCH_RID + "1", "prefix match")
