"""Asking the frozen suite's prompts (`kvsparse_testbed.frozen_suite`) through a server, as
`bench/regression_guard.py` and `bench/ablation.py` do: greedy, through the chat endpoint as
`bench/fidelity.py` asks, with a request's own sparsity setting in `custom_params`."""

from __future__ import annotations

import argparse
from typing import Any

import requests

from common.systems import ServerSettings
from kvsparse_testbed.frozen_suite import FROZEN_SUITE, FrozenSuite
from kvsparse_testbed.ruler import MAX_NEW_TOKENS, RulerPrompt
from sglang_kvsparse.server.serving_defaults import CPU_MAX_TOTAL_TOKENS

#: The server these benchmarks ask, as the end-to-end tests' "uncached" server runs: the default
#: model in float32 on the CPU pool, `--disable-radix-cache` (every prompt prefilled whole).
SERVER_SETTINGS = ServerSettings("default", "auto", "float32", CPU_MAX_TOTAL_TOKENS, None, 1, 900.0)
SERVER_FLAGS = ("--disable-radix-cache",)


#: After a prompt's text, for a base model (`ask(..., completion=True)`): where its answer starts.
ANSWER_CUE = "\nAnswer:"


def ask(base_url: str, prompt: RulerPrompt, setting: dict[str, Any] | None, completion: bool = False) -> dict[str, Any]:
    """One greedy completion with this request setting (`custom_params.kvsparse`; None: the
    server's): the output and whether it is right. Through the chat endpoint, or (`completion`,
    a base model without a chat template) the completions endpoint with the prompt's text and
    `ANSWER_CUE`."""
    body: dict[str, Any] = {"model": "default", "temperature": 0, "max_tokens": MAX_NEW_TOKENS}
    if completion:
        body["prompt"] = prompt.user_message + ANSWER_CUE
    else:
        body["messages"] = [{"role": "user", "content": prompt.user_message}]
    if setting is not None:
        body["custom_params"] = {"kvsparse": setting}
    endpoint = "completions" if completion else "chat/completions"
    response = requests.post(f"{base_url}/v1/{endpoint}", json=body, timeout=900)
    response.raise_for_status()
    choice = response.json()["choices"][0]
    output = (choice["text"] if completion else choice["message"]["content"]) or ""
    return {"output": output, "correct": prompt.correct(output)}


def chosen_prompts(
    seeds: list[int], tasks: list[str], lengths: list[int], suite: FrozenSuite = FROZEN_SUITE
) -> list[RulerPrompt]:
    """A frozen suite's prompts of these seeds, tasks and lengths (ids
    `ruler-s<seed>-<task>-<length>-<i>`)."""
    wanted = {f"s{seed}-{task}-{length}" for seed in seeds for task in tasks for length in lengths}
    return [p for p in suite.prompts() if p.prompt_id.removeprefix("ruler-").rsplit("-", 1)[0] in wanted]


def add_selection_arguments(parser: argparse.ArgumentParser, seeds: str | None) -> None:
    """The options that choose the suite's prompts (seeds, tasks, lengths) and the budgets;
    `seeds` None: all of the suite's."""
    parser.add_argument(
        "--seeds",
        default=seeds,
        help="of the suite's seeds (default: all)" if seeds is None else "of the suite's seeds",
    )
    parser.add_argument("--tasks", default=",".join(FROZEN_SUITE.tasks), help="of the frozen suite's tasks")
    parser.add_argument("--lengths", default="2000,3000", help="of the frozen suite's lengths")
    parser.add_argument("--budgets", default="128,256")


def selection(args: argparse.Namespace, suite: FrozenSuite = FROZEN_SUITE) -> tuple[list[RulerPrompt], list[int]]:
    """The prompts of `suite` and the budgets `add_selection_arguments`' options chose."""
    seeds = list(suite.seeds) if args.seeds is None else [int(s) for s in args.seeds.split(",")]
    lengths = [int(n) for n in args.lengths.split(",")]
    return chosen_prompts(seeds, args.tasks.split(","), lengths, suite), [int(b) for b in args.budgets.split(",")]
