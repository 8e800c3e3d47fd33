"""The project's server (lossless sparse layers) answers SGLang's native and OpenAI-compatible endpoints."""

from __future__ import annotations

import json

import pytest
import requests

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _chat(server, stream: bool) -> requests.Response:
    return requests.post(
        f"{server.url}/v1/chat/completions",
        json={"model": "default", "messages": QUESTION, "max_tokens": 24, "temperature": 0, "stream": stream},
        stream=stream,
        timeout=300,
    )


def test_chat_completion_answers(sparse_server):
    response = _chat(sparse_server, stream=False)
    response.raise_for_status()
    body = response.json()
    answer = body["choices"][0]["message"]["content"]
    assert "Paris" in answer
    assert body["usage"]["completion_tokens"] > 0


def test_chat_completion_streams_the_same_answer(sparse_server):
    expected = _chat(sparse_server, stream=False).json()["choices"][0]["message"]["content"]
    response = _chat(sparse_server, stream=True)
    response.raise_for_status()
    pieces = []
    for line in response.iter_lines(decode_unicode=True):
        if not line or not line.startswith("data: ") or line == "data: [DONE]":
            continue
        delta = json.loads(line[len("data: ") :])["choices"][0]["delta"]
        pieces.append(delta.get("content") or "")
    assert len([p for p in pieces if p]) > 1, "expected the answer in several chunks"
    assert "".join(pieces) == expected


def test_generate_endpoint(sparse_server):
    body = sparse_server.generate("The capital of France is", max_new_tokens=8)
    assert "Paris" in body["text"]
    assert body["meta_info"]["completion_tokens"] == len(body["output_ids"]) > 0
