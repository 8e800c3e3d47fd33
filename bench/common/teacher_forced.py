"""The language-model suite of bench/fidelity.py, client side: teacher-forced decoding of essay
continuations through a server's `/generate` (see `kvsparse_testbed.continuations` for what is
measured and why).

The server must run with `--enable-custom-logit-processor`. Requests send token ids (no chat
template, no re-tokenisation), greedy, with `ignore_eos`, so every passage decodes exactly its
continuation's length.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests

from kvsparse_testbed.continuations import ForcedScore, Passage, tokenized_essay_passages, total
from kvsparse_testbed.teacher_forcing import KEY, ForcedContinuation

#: Server flag the suite needs.
SERVER_FLAGS = ("--enable-custom-logit-processor",)
#: Requests in flight at once: the server batches their decode steps.
CONCURRENCY = 4


def build_passages(model_dir: Path, context_lens: Sequence[int], per_len: int, continuation_len: int) -> list[Passage]:
    """Essay passages, tokenised with the served model's own tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return tokenized_essay_passages(tokenizer, context_lens, per_len, continuation_len)


def _generate(
    base_url: str, context: Sequence[int], max_new_tokens: int, forced: Sequence[int] | None
) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    body: dict[str, Any] = {"input_ids": list(context), "sampling_params": sampling}
    if forced is not None:
        sampling["custom_params"] = {"forced_ids": list(forced)}
        body["custom_logit_processor"] = ForcedContinuation.to_str()
    response = requests.post(f"{base_url}/generate", json=body, timeout=1800)
    response.raise_for_status()
    return response.json()


def greedy_continuation(base_url: str, passage: Passage) -> list[int]:
    """The server's own greedy continuation of the passage's context, as long as the real one."""
    result = _generate(base_url, passage.context_ids, len(passage.continuation_ids), None)
    return [int(t) for t in result["output_ids"]]


def forced_score(base_url: str, context: Sequence[int], forced: Sequence[int]) -> ForcedScore:
    """Decode `forced` after `context`, teacher-forced, and score what the model predicted."""
    result = _generate(base_url, context, len(forced), forced)
    records = result["meta_info"].get(KEY)
    if records is None:
        raise RuntimeError(f"no '{KEY}' in the answer: does the server run {' '.join(SERVER_FLAGS)}?")
    if [int(t) for t in result["output_ids"]] != [int(t) for t in forced]:
        raise RuntimeError("the server did not decode the forced tokens")
    return ForcedScore.of(records, forced)


def run_lm_suite(
    base_url: str, passages: Sequence[Passage], references: dict[str, list[int]], progress: Callable[[str], None]
) -> dict[str, dict[str, dict[str, float]]]:
    """Per passage: the real continuation's score and, where `references` has the full cache's
    greedy continuation, the agreement with it. `references` is filled first when empty (the
    full-cache system builds it)."""
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        missing = [p for p in passages if p.passage_id not in references]
        for passage, ids in zip(missing, pool.map(lambda p: greedy_continuation(base_url, p), missing)):
            references[passage.passage_id] = ids
        jobs = [(p.passage_id, "real", p.context_ids, p.continuation_ids) for p in passages]
        jobs += [(p.passage_id, "full_greedy", p.context_ids, references[p.passage_id]) for p in passages]
        scores = pool.map(lambda job: forced_score(base_url, job[2], job[3]), jobs)
        results: dict[str, dict[str, dict[str, float]]] = {}
        for (passage_id, reference, _, _), score in zip(jobs, scores):
            results.setdefault(passage_id, {})[reference] = score.to_json()
            progress(f"{passage_id} {reference}: ppl {score.perplexity:.2f}, top-1 {score.top1_rate:.3f}")
    return results


def summarize(per_passage: dict[str, dict[str, dict[str, float]]], reference: str) -> ForcedScore:
    """Token-weighted total over the passages for one reference ("real" or "full_greedy")."""
    return total([ForcedScore.from_json(p[reference]) for p in per_passage.values() if reference in p])
