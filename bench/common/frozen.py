"""Asking the frozen suite's prompts (`kvsparse_testbed.frozen_suite`) through a server, as
`bench/regression_guard.py` and `bench/ablation.py` do: greedy, through the chat endpoint as
`bench/fidelity.py` asks, with a request's own sparsity setting in `custom_params`."""

from __future__ import annotations

from typing import Any

import requests

from kvsparse_testbed.frozen_suite import FROZEN_SUITE
from kvsparse_testbed.ruler import MAX_NEW_TOKENS, RulerPrompt


def ask(base_url: str, prompt: RulerPrompt, setting: dict[str, Any] | None) -> dict[str, Any]:
    """One greedy chat completion with this request setting (`custom_params.kvsparse`; None: the
    server's): the output and whether it is right."""
    body: dict[str, Any] = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt.user_message}],
        "temperature": 0,
        "max_tokens": MAX_NEW_TOKENS,
    }
    if setting is not None:
        body["custom_params"] = {"kvsparse": setting}
    response = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=900)
    response.raise_for_status()
    output = response.json()["choices"][0]["message"]["content"] or ""
    return {"output": output, "correct": prompt.correct(output)}


def chosen_prompts(seeds: list[int], tasks: list[str], lengths: list[int]) -> list[RulerPrompt]:
    """The frozen suite's prompts of these seeds, tasks and lengths (ids
    `ruler-s<seed>-<task>-<length>-<i>`)."""
    wanted = {f"s{seed}-{task}-{length}" for seed in seeds for task in tasks for length in lengths}
    return [p for p in FROZEN_SUITE.prompts() if p.prompt_id.removeprefix("ruler-").rsplit("-", 1)[0] in wanted]
