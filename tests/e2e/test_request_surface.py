"""A request's own setting as SGLang carries it: within SGLang's declared `custom_params` type (a
policy's knobs as "policy.<knob>" keys, or the setting as one JSON string; the nested form is
read too), through SGLang's default pickle IPC (the evicting server) and its msgpack IPC (the
"uncached" server, `MSGPACK_IPC`); every response's meta_info saying which setting was applied;
a "kvsparse" key misplaced at the top of a request a 400 saying where it goes; beam search
refused with a 400 naming it."""

from __future__ import annotations

import pytest
import requests

pytestmark = pytest.mark.e2e

PROMPT = "Alice keeps a red umbrella by the door. What colour is Alice's umbrella? Answer:"
SPAN_32 = {"setting": "budget 64, policy span (long_follow 32, sentence 0.5)", "budget": 64}
FORMS = {
    "flat": {"budget": 64, "policy": "span", "policy.long_follow": 32},
    "json-string": '{"budget": 64, "policy": {"name": "span", "long_follow": 32}}',
    "nested": {"budget": 64, "policy": {"name": "span", "long_follow": 32}},
}


def _generate(server, custom_params, **sampling) -> requests.Response:
    params = {"max_new_tokens": 8, "temperature": 0, "custom_params": custom_params, **sampling}
    return requests.post(f"{server.url}/generate", json={"text": PROMPT, "sampling_params": params}, timeout=600)


def _chat(server, **body) -> requests.Response:
    payload = {"model": "default", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 8, **body}
    return requests.post(f"{server.url}/v1/chat/completions", json=payload, timeout=600)


@pytest.fixture(params=["evicting", "uncached"], ids=["pickle-ipc", "msgpack-ipc"])
def server(request, evicting_server, uncached_server):
    return {"evicting": evicting_server, "uncached": uncached_server}[request.param]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_form_of_a_setting_is_served_and_reported(server, form):
    response = _generate(server, {"kvsparse": FORMS[form]})
    assert response.status_code == 200, response.text
    applied = response.json()["meta_info"]["kvsparse"]
    assert {key: applied[key] for key in SPAN_32} == SPAN_32 and applied["policy"].startswith("span (long_follow 32")


def test_a_response_reports_the_servers_setting_or_none(server):
    applied = _generate(server, None).json()["meta_info"]["kvsparse"]
    assert applied["setting"] == "server" and isinstance(applied["budget"], int) and applied["policy"]
    off = _generate(server, {"kvsparse": {"enabled": False}}).json()["meta_info"]["kvsparse"]
    assert off == {"setting": "off", "budget": None, "policy": None}


def test_the_chat_endpoint_reports_the_setting_with_its_meta_info(server):
    response = _chat(server, custom_params={"kvsparse": {"budget": 64}}, return_meta_info=True)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["meta_info"]["kvsparse"]["setting"] == "budget 64"


def test_a_misplaced_setting_is_a_400_saying_where_it_goes(evicting_server):
    response = _chat(evicting_server, kvsparse={"budget": 64})
    assert response.status_code == 400
    assert response.json()["message"].startswith('"kvsparse" goes inside "custom_params"')
    payload = {"text": PROMPT, "sampling_params": {"max_new_tokens": 4}, "kvsparse": {"budget": 64}}
    assert requests.post(f"{evicting_server.url}/generate", json=payload, timeout=600).status_code == 400
    mentioned = _chat(evicting_server, messages=[{"role": "user", "content": 'What does "kvsparse" mean?'}])
    assert mentioned.status_code == 200, mentioned.text


def test_beam_search_is_refused_naming_it(evicting_server):
    response = _generate(evicting_server, None, beam_width=2)
    assert response.status_code == 400
    assert "beam_width 2: beam search is not served with sparse layers" in response.text
