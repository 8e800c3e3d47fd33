"""Requests' own sparsity settings in SGLang's HTTP process (SGLang 0.5.23 internals): checked,
written in SGLang's type, reported back.

- `make_check_setting`, AFTER `TokenizerManager._create_tokenized_object`: the tokenized request
  carries its prompt's token ids and its sampling parameters, `custom_params` included (from
  `/generate`'s `sampling_params` or the OpenAI endpoints' `custom_params`). A bad
  `custom_params.kvsparse`, or beam search (`beam_width` above 1: beam members share and remap a
  request's KV rows, which the sparse layers' per-request tables do not follow), raises ValueError
  with a message naming the field, which SGLang's HTTP server answers with a 400 before the
  request reaches a scheduler (`request_sparsity.check_request`). An accepted setting is written
  back in the flat form (`RequestSparsity.to_params`), within SGLang's declared `custom_params`
  type, so that it crosses SGLang's msgpack IPC as it crosses the default pickle one.
- `make_report_setting`, AROUND `TokenizerManager._wait_one_response`: every response's
  `meta_info` says which setting was applied (`RequestSparsity.applied`, under "kvsparse"): on
  `/generate`, and on the OpenAI endpoints with `return_meta_info`.
- `MisplacedSettingGuard`: a `"kvsparse"` key at the top of a JSON request body (where the
  OpenAI endpoints would ignore it) is a 400 saying where it goes.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from sglang_kvsparse.config import ResolvedSparsity, SparsityConfig
from sglang_kvsparse.config.request_sparsity import REQUEST_KEY, check_request, parse_request
from sglang_kvsparse.server.model_support import resolve_for_model

#: The one line a misplaced setting gets.
MISPLACED = (
    f'"{REQUEST_KEY}" goes inside "custom_params": {{"custom_params": {{"{REQUEST_KEY}": {{"budget": 256}}}}}} '
    '(the OpenAI client\'s extra_body={"custom_params": ...}; /generate: in "sampling_params")'
)


def _resolver(config: SparsityConfig) -> Callable[[Any], ResolvedSparsity]:
    """The configuration resolved for a tokenizer manager's model (once per model shape)."""

    done: dict[int, ResolvedSparsity] = {}  # by the model config's identity: it lives as long as the process

    def resolved(manager: Any) -> ResolvedSparsity:
        model = manager.model_config
        if id(model) not in done:
            done[id(model)] = resolve_for_model(
                config, model.hf_config.to_dict(), model.num_hidden_layers, model.context_len
            )
        return done[id(model)]

    return resolved


def make_check_setting(config: SparsityConfig):
    """The AFTER hook for `hooks.CREATE_REQUEST`, bound to the configuration."""
    resolved = _resolver(config)

    def check_setting(result: Any, manager: Any, *args: Any, **kwargs: Any) -> None:
        params = getattr(result, "sampling_params", None)
        if params is None:  # an embedding request: nothing to check
            return
        if (getattr(params, "beam_width", None) or 1) > 1:
            raise ValueError(
                f"beam_width {params.beam_width}: beam search is not served with sparse layers (beam members "
                "share and remap a request's KV rows; the sparse layers' per-request tables do not follow them)"
            )
        setting = check_request(
            params.custom_params, len(result.input_ids or ()), params.max_new_tokens, resolved(manager)
        )
        if isinstance(params.custom_params, dict) and params.custom_params.get(REQUEST_KEY) is not None:
            params.custom_params = {**params.custom_params, REQUEST_KEY: setting.to_params()}

    return check_setting


def make_report_setting(config: SparsityConfig):
    """The AROUND hook for `hooks.WAIT_RESPONSE`, bound to the configuration."""
    resolved = _resolver(config)

    def report_setting(original: Any, manager: Any, obj: Any, *args: Any, **kwargs: Any) -> Any:
        responses = original(manager, obj, *args, **kwargs)
        sampling = getattr(obj, "sampling_params", None)
        if not isinstance(sampling, dict):  # an embedding request, or a batch's template
            return responses
        applied = parse_request(sampling.get("custom_params"), resolved(manager)).applied(resolved(manager))
        return _with_setting(responses, applied)

    return report_setting


async def _with_setting(responses: AsyncIterator[dict], applied: dict[str, Any]) -> AsyncIterator[dict]:
    async for out in responses:
        meta_info = out.get("meta_info") if isinstance(out, dict) else None
        if meta_info is not None:
            meta_info[REQUEST_KEY] = applied
        yield out


class MisplacedSettingGuard:
    """ASGI middleware: a POST whose JSON body has `"kvsparse"` at its top (where the OpenAI
    endpoints would ignore it) is answered with a 400; every other request passes untouched. Only
    a body that contains the key's text is parsed."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        messages, body = [], b""
        while True:
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if message["type"] != "http.request" or not message.get("more_body"):
                break
        if f'"{REQUEST_KEY}"'.encode() in body and _has_top_level_key(body):
            payload = json.dumps({"object": "error", "message": MISPLACED, "code": 400}).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
            await send({"type": "http.response.start", "status": 400, "headers": headers})
            return await send({"type": "http.response.body", "body": payload})

        async def replay() -> dict:
            return messages.pop(0) if messages else await receive()

        return await self.app(scope, replay, send)


def _has_top_level_key(body: bytes) -> bool:
    try:
        data = json.loads(body)
    except ValueError:
        return False
    return isinstance(data, dict) and REQUEST_KEY in data
