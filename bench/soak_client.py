"""The soak's client (`bench/soak.py`): sends one mix request, or a conversation's turns, to a server
and says what came of it, for SGLang's `/generate` and the OpenAI endpoints alike, streamed or not,
with the interruption the mix drew (an abort by rid during the prefill or the decode, a
disconnect). Only requests; no checks of the server."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import requests
from soak_mix import SoakRequest, prompt_ids

REQUEST_TIMEOUT_S = 900.0
FOLLOW_UP = "Go on: what does that imply?"
PATHS = {"generate": "/generate", "completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class Outcome:
    """What one request (or one conversation turn) came to."""

    index: int
    turn: int
    kind: str
    status: str  # ok | aborted | disconnected | error | lost
    seconds: float
    http_status: int | None = None
    message: str = ""
    prompt_tokens: int | None = None
    texts: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)
    payload: dict[str, Any] | None = None  # kept for the requests compared with stock


class Client:
    """Sends the mix's requests to one server and classifies what comes back."""

    def __init__(self, url: str, model: str, text_ids: list[int], offsets: dict[int, int], tokenizer: Any):
        self.url, self.model, self.text_ids, self.offsets, self.tokenizer = url, model, text_ids, offsets, tokenizer

    def run(self, request: SoakRequest) -> list[Outcome]:
        """The request, and for a conversation each follow-up turn with the whole history."""
        payload = self.payload(request)
        outcomes = [self.send(request, 0, payload)]
        for turn in range(1, request.follow_ups + 1):
            last = outcomes[-1]
            if last.status != "ok":
                break
            history = [*payload["messages"], *self.next_turn(last.texts[0])]
            payload = {**payload, "messages": history, "rid": rid_of(request, turn)}
            outcomes.append(self.send(request, turn, payload))
        return outcomes

    @staticmethod
    def next_turn(answer: str) -> list[dict[str, str]]:
        return [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]

    def payload(self, request: SoakRequest) -> dict[str, Any]:
        ids = prompt_ids(request, self.text_ids, self.offsets)
        rid = rid_of(request, 0)
        if request.endpoint == "generate":
            sampling: dict[str, Any] = {"max_new_tokens": request.max_new_tokens, "n": request.n}
            sampling |= {"temperature": 0} if request.greedy else {"temperature": 0.8, "top_p": 0.95}
            if request.stop:
                sampling["stop"] = list(request.stop)
            body: dict[str, Any] = {"input_ids": ids, "sampling_params": sampling, "stream": request.stream, "rid": rid}
            if request.logprobs:
                body |= {"return_logprob": True, "top_logprobs_num": 2}
            return body
        body = {
            "model": self.model,
            "max_tokens": request.max_new_tokens,
            "temperature": 0 if request.greedy else 0.8,
            "n": request.n,
            "stream": request.stream,
            "rid": rid,
        }
        if request.stop:
            body["stop"] = list(request.stop)
        if request.stream:
            body["stream_options"] = {"include_usage": True}  # the prompt's length, for the comparison
        if request.endpoint == "completions":
            return body | {"prompt": ids} | ({"logprobs": 2} if request.logprobs else {})
        content = self.tokenizer.decode(ids)
        return (
            body
            | {"messages": [{"role": "user", "content": content}]}
            | ({"logprobs": True, "top_logprobs": 2} if request.logprobs else {})
        )

    def send(self, request: SoakRequest, turn: int, payload: dict[str, Any]) -> Outcome:
        started = time.monotonic()
        outcome = Outcome(request.index, turn, request.kind, "lost", 0.0)
        interrupt = request.interrupt if turn == 0 else None
        try:
            if request.stream:
                self._stream(request, payload, interrupt, outcome)
            else:
                self._whole(request, payload, interrupt, outcome)
        except requests.ReadTimeout:
            outcome.status, outcome.message = ("disconnected", "") if interrupt else ("lost", "no answer in time")
        except requests.RequestException as exc:
            outcome.status, outcome.message = "lost", str(exc).splitlines()[0]
        outcome.seconds = time.monotonic() - started
        outcome.payload = payload
        return outcome

    def _whole(self, request: SoakRequest, payload: dict, interrupt: str | None, outcome: Outcome) -> None:
        timeout = request.interrupt_after / 1000 if interrupt == "disconnect-waiting" else REQUEST_TIMEOUT_S
        response = requests.post(self.url + PATHS[request.endpoint], json=payload, timeout=(30, timeout))
        if response.status_code >= 400:
            return _error(outcome, response.status_code, response.text)
        answers = parse_whole(request.endpoint, response.json())
        _answered(outcome, answers, interrupt)

    def _stream(self, request: SoakRequest, payload: dict, interrupt: str | None, outcome: Outcome) -> None:
        timer = None
        if interrupt == "abort-prefill":
            timer = threading.Timer(request.interrupt_after / 1000, self.abort, args=(payload["rid"],))
            timer.start()
        url = self.url + PATHS[request.endpoint]
        with requests.post(url, json=payload, stream=True, timeout=(30, REQUEST_TIMEOUT_S)) as response:
            if response.status_code >= 400:
                return _error(outcome, response.status_code, response.text)
            chunks = Stream(request.endpoint)
            for count, line in enumerate(response.iter_lines(), start=1):
                if not chunks.feed(line):
                    break
                if interrupt in ("abort-decode", "disconnect-decode") and count == request.interrupt_after:
                    if interrupt == "disconnect-decode":
                        outcome.status = "disconnected"
                        return
                    self.abort(payload["rid"])
        if timer is not None:
            timer.cancel()
        if chunks.error:
            return _error(outcome, 200, chunks.error)
        _answered(outcome, chunks.answers(), interrupt)

    def abort(self, rid: str) -> None:
        requests.post(f"{self.url}/abort_request", json={"rid": rid}, timeout=60)


def _error(outcome: Outcome, status: int, body: str) -> None:
    outcome.status, outcome.http_status = "error", status
    try:
        detail = json.loads(body)
        outcome.message = str(detail.get("message") or detail.get("error") or detail.get("detail") or body)[:300]
    except ValueError:
        outcome.message = body[:300]


def rid_of(request: SoakRequest, turn: int) -> str:
    """A request id no other one starts with (SGLang aborts every rid with the given prefix)."""
    return f"soak-{request.index:05d}-{turn}"


def _answered(outcome: Outcome, answers: list[tuple[str, str, int | None]], interrupt: str | None) -> None:
    """Every answer finished: aborted if any finish says abort (an error when the client did not
    ask for it), lost if any has none."""
    outcome.texts = [text for text, _, _ in answers]
    outcome.finish = [finish for _, finish, _ in answers]
    outcome.prompt_tokens = next((tokens for _, _, tokens in answers if tokens is not None), None)
    if not answers or any(not finish for finish in outcome.finish):
        outcome.status, outcome.message = "lost", "the answer ended without a finish reason"
    elif any(finish == "abort" for finish in outcome.finish):
        outcome.status = "aborted" if interrupt else "error"
        outcome.message = "" if interrupt else "aborted by the server"
    else:
        outcome.status = "ok"


def parse_whole(endpoint: str, body: Any) -> list[tuple[str, str, int | None]]:
    """(text, finish reason, prompt tokens) per answer of a non-streamed response."""
    if endpoint == "generate":
        items = body if isinstance(body, list) else [body]
        return [(item["text"], _native_finish(item["meta_info"]), item["meta_info"]["prompt_tokens"]) for item in items]
    prompt = (body.get("usage") or {}).get("prompt_tokens")
    choices = sorted(body["choices"], key=lambda c: c["index"])
    key = "text" if endpoint == "completions" else "message"
    return [(c[key] if key == "text" else c[key]["content"] or "", c["finish_reason"] or "", prompt) for c in choices]


def _native_finish(meta: dict[str, Any]) -> str:
    reason = meta.get("finish_reason")
    return "" if reason is None else reason.get("type", "") if isinstance(reason, dict) else str(reason)


class Stream:
    """Server-sent events of one streamed response, per answer index."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.text: dict[int, str] = {}
        self.finish: dict[int, str] = {}
        self.prompt_tokens: int | None = None
        self.error = ""

    def feed(self, line: bytes) -> bool:
        """Take one line; False once the stream says it is done."""
        if not line.startswith(b"data:"):
            return True
        data = line[5:].strip()
        if data == b"[DONE]":
            return False
        event = json.loads(data)
        if "error" in event:
            self.error = str(event["error"])[:300]
            return False
        if self.endpoint == "generate":
            index = event.get("index", 0)
            self.text[index] = event["text"]  # cumulative
            self.finish[index] = _native_finish(event["meta_info"])
            self.prompt_tokens = event["meta_info"].get("prompt_tokens")
            return True
        if event.get("usage"):
            self.prompt_tokens = event["usage"].get("prompt_tokens")
        for choice in event.get("choices", ()):
            piece = choice.get("text") if self.endpoint == "completions" else (choice.get("delta") or {}).get("content")
            self.text[choice["index"]] = self.text.get(choice["index"], "") + (piece or "")
            if choice.get("finish_reason"):
                self.finish[choice["index"]] = choice["finish_reason"]
        return True

    def answers(self) -> list[tuple[str, str, int | None]]:
        return [(self.text[i], self.finish.get(i, ""), self.prompt_tokens) for i in sorted(self.text)]
