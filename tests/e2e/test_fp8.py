"""Sparse layers on an FP8 KV cache (`--kv-cache-dtype fp8_e4m3`, `fp8_e5m2`): at budgets above
every length, greedy outputs equal stock SGLang's with the same FP8 cache, token for token up to
a near tie of stock's top two (`assert_same_greedy`; chunked prefill and prefix hits included);
chat, streaming and a frontend program are served; the heap's rows are one byte a value; with
eviction (budget 256, retractions) the soak profile's mix comes through and every heap row comes
back; the default preset in FP8 still answers the frozen-suite prompts it answered when measured,
all but at most one at each budget (`FP8_GUARD`).

Stock runs on this CPU through the FP8 reference (`patches/cpu_fp8.py`, which
`tests/integration/test_cpu_fp8.py` checks against plain attention). Requests are compared one at
a time: every forward then has the same shape on both servers. Sent together, SGLang batches them
by timing, and a batch's float32 rounding (its matrix shapes) moves a K/V value across an FP8
rounding step now and then, which changes a later token where the model's top two are nearly
tied (seen: log-probability gaps of 0.03 and 0.11). These servers run in a pytest session of
their own (`make test-e2e`); prefix hits, the soak, e5m2 and the guard in the extended tier's
(`make test-extended`; a prefix hit over FP8 lanes is checked against the fresh prefill in
`tests/unit/test_sparse_state.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest
import requests
import sglang as sgl

from sglang_kvsparse.server.serving_defaults import CPU_MAX_TOTAL_TOKENS

from .prompts import SHORT_PROMPTS, long_prompt
from .servers import Server, assert_at_rest, assert_every_slot_back, assert_prefix_hits_equal_stock
from .test_frontend import capital_quiz
from .test_regression_guard import lost_answers

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 24
SOAK = Path(__file__).resolve().parents[2] / "bench" / "soak.py"


#: How far the two servers' log-probabilities of the same greedy token may drift apart, and so how
#: close stock's top two must be where their greedy outputs part. The sparse layers' attention sums
#: in another order than `torch_native`'s, so now and then a K/V value rounds to the neighbouring
#: FP8 byte, a step of 1/8 to 1/4 of the value, and later log-probabilities drift (seen over 24
#: tokens: up to 0.075 in e4m3); where stock's top two are closer than that the greedy choice may
#: go the other way (seen in e5m2: "Write a haiku about the sea.", stock's top two 0.007 apart).
DRIFT = 0.15


class Greedy(NamedTuple):
    """A greedy output: its ids, their log-probabilities, each step's top two (id ->
    log-probability), and the prompt's length."""

    ids: list[int]
    logprobs: list[float]
    tops: list[dict[int, float]]
    prompt_tokens: int


def greedy(server: Server, prompt: str) -> Greedy:
    """`prompt`'s greedy output from `server`, with the log-probabilities `assert_same_greedy` reads."""
    answer = server.generate(prompt, MAX_NEW_TOKENS, top_logprobs=2)
    meta = answer["meta_info"]
    logprobs = [logprob for logprob, _, _ in meta["output_token_logprobs"]]
    tops = [{token: logprob for logprob, token, _ in top} for top in meta["output_top_logprobs"]]
    return Greedy(answer["output_ids"], logprobs, tops, meta["prompt_tokens"])


def assert_same_greedy(mine: Greedy, theirs: Greedy, prompt: str) -> None:
    """Token for token, each token's log-probabilities within `DRIFT`; where the outputs part, both
    servers' top two are the two tokens chosen, and stock's within `DRIFT` of each other."""
    (ids, logprobs, tops, _), (stock_ids, stock_logprobs, stock_tops, _) = mine, theirs
    assert ids, prompt[:60]
    same = next((i for i, (a, b) in enumerate(zip(ids, stock_ids)) if a != b), min(len(ids), len(stock_ids)))
    gaps = [abs(a - b) for a, b in zip(logprobs[:same], stock_logprobs[:same])]
    assert max(gaps, default=0.0) < DRIFT, (prompt[:60], gaps)
    if same == len(ids) == len(stock_ids):
        return
    assert same < min(len(ids), len(stock_ids)), (prompt[:60], "one output stopped early", ids, stock_ids)
    ours, stocks = ids[same], stock_ids[same]
    assert set(tops[same]) == set(stock_tops[same]) == {ours, stocks}, (prompt[:60], same, tops[same], stock_tops[same])
    assert stock_tops[same][stocks] - stock_tops[same][ours] < DRIFT, (prompt[:60], same, stock_tops[same])


def assert_same_outputs(sparse: Server, stock: Server) -> None:
    prompts = [*SHORT_PROMPTS, long_prompt(10000), long_prompt(16000)[8000:]]  # two of several chunks
    ours = [greedy(sparse, prompt) for prompt in prompts]
    theirs = [greedy(stock, prompt) for prompt in prompts]
    assert max(answer.prompt_tokens for answer in ours) > 2000
    for prompt, mine, stock_out in zip(prompts, ours, theirs):
        assert_same_greedy(mine, stock_out, prompt)
    assert_every_slot_back(sparse.idle_stats())


def test_outputs_may_part_only_at_a_near_tie():
    """`assert_same_greedy` itself, on made-up outputs: a near tie passes, a clear choice or drifting
    log-probabilities fail."""
    stock = Greedy([5, 7, 9], [-0.5, -1.0, -0.2], [{5: -0.5, 6: -2.0}, {7: -1.0, 8: -1.05}, {9: -0.2, 4: -3.0}], 10)
    tied = Greedy([5, 8, 2], [-0.45, -0.99, -0.3], [{5: -0.45, 6: -2.0}, {8: -0.99, 7: -1.0}, {2: -0.3, 4: -3.0}], 10)
    assert_same_greedy(stock, stock, "same")
    assert_same_greedy(tied, stock, "near tie")
    clear = stock._replace(tops=[stock.tops[0], {7: -1.0, 8: -1.3}, stock.tops[2]])
    drifted = stock._replace(logprobs=[-0.3, -1.0, -0.2])
    for wrong, against in ((tied, clear), (drifted, stock)):
        with pytest.raises(AssertionError):
            assert_same_greedy(wrong, against, "wrong")


def test_fp8_sparse_layers_with_full_budgets_match_fp8_stock(fp8_sparse_server, fp8_stock_server):
    assert_same_outputs(fp8_sparse_server, fp8_stock_server)


@pytest.mark.extended
def test_fp8_prefix_hits_match_fp8_stock(fp8_sparse_server, fp8_stock_server):
    assert_prefix_hits_equal_stock(fp8_sparse_server, fp8_stock_server, MAX_NEW_TOKENS)


def test_fp8_heap_rows_hold_one_byte_a_value(fp8_sparse_server):
    """The heap holds the KV bytes of the same number of dense tokens as a float32 one, at a
    quarter of the bytes: one byte per K/V value in every row (`/kvsparse/stats`)."""
    heap = fp8_sparse_server.stats()["replicas"][0]["tp_ranks"][0]["heap"]
    assert heap["kv_dtype"] == "float8_e4m3fn"
    assert heap["rows_total"] == CPU_MAX_TOTAL_TOKENS * 30  # 30 layers, one lane: layer 0 full
    assert heap["row_bytes"] == 2 * 3 * 64  # K and V of SmolLM2's 3 KV heads of dim 64, a byte each


def test_fp8_chat_streaming_and_a_frontend_program(fp8_sparse_server):
    url = fp8_sparse_server.url
    body = {"model": "default", "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    answer = requests.post(f"{url}/v1/chat/completions", json={**body, "max_tokens": 16, "temperature": 0}, timeout=120)
    answer.raise_for_status()
    text = answer.json()["choices"][0]["message"]["content"]
    assert "Paris" in text
    streamed = []
    with requests.post(
        f"{url}/v1/chat/completions",
        json={**body, "max_tokens": 16, "temperature": 0, "stream": True},
        stream=True,
        timeout=120,
    ) as response:
        for line in response.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                streamed.append(delta.get("content") or "")
    assert "".join(streamed) == text
    state = capital_quiz.run(country="France", backend=sgl.RuntimeEndpoint(url))
    assert "Paris" in state["answer"]


@pytest.mark.extended  # as the bf16 soak (`test_soak.py`): the longest test of its tier
def test_the_soak_mix_through_fp8_eviction_comes_back_clean(fp8_evicting_server, fp8_stock_server, tmp_path):
    """Budget 256 in a small FP8 heap (retractions): every request answered or ended by its own
    client, the server healthy and at rest after, every heap row back."""
    argv = ["--requests", "16", "--concurrency", "8", "--max-prompt-tokens", "1600", "--seed", "5"]
    argv += ["--url", fp8_evicting_server.url, "--stock-url", fp8_stock_server.url, "--out-dir", str(tmp_path)]
    run = subprocess.run([sys.executable, str(SOAK), *argv], capture_output=True, text=True, timeout=1200)
    reports = list(tmp_path.glob("soak-*.json"))
    assert len(reports) == 1, run.stderr[-3000:]
    soak = json.loads(reports[0].read_text())["soak"]
    assert soak["not_sent"] == 0 and "lost" not in soak["outcomes"]["by_status"], soak["failures"]
    assert soak["rest"]["idle_ok"] and soak["rest"]["flushed_ok"] and soak["rest"]["healthy"], soak["rest"]
    assert_at_rest(fp8_evicting_server)


@pytest.mark.extended
def test_e5m2_sparse_layers_with_full_budgets_match_e5m2_stock(e5m2_sparse_server, e5m2_stock_server):
    assert_same_outputs(e5m2_sparse_server, e5m2_stock_server)


#: The regression guard in FP8: the frozen-suite prompts the default preset with an FP8 KV cache
#: answered at each budget in `bench/results/ablation-fp8-2026-12-05.md` (4 of the float32 guard's 8
#: at both budgets, 2 more at 256; its full FP8 cache answers 8 of the float32 cache's 10), asked
#: again of a server started as that run's (`fp8_default`).
FP8_GUARD = {
    128: ("ruler-s3-uuid-2000-0", "ruler-s3-uuid-2000-1", "ruler-s4-multikey-2000-0", "ruler-s4-multikey-3000-0"),
    256: (
        "ruler-s3-uuid-2000-0",
        "ruler-s3-uuid-2000-1",
        "ruler-s3-uuid-3000-0",
        "ruler-s4-multikey-2000-0",
        "ruler-s4-multikey-3000-0",
        "ruler-s5-uuid-2000-1",
    ),
}


@pytest.mark.extended
def test_the_default_in_fp8_still_answers_its_guard_prompts(fp8_default_server):
    """All but at most one at each budget, the issue's tolerance against bfloat16 (within one
    prompt): on another CPU, FP8's rounding of this 135M model's K/V moves a near-miss UUID copy
    (seen on an AVX2 machine: `ruler-s3-uuid-2000-1` at 256, its UUID's tail as zeros, at the
    commit the guard was recorded on too). The float32 guard (`test_regression_guard.py`) is exact."""
    lost = lost_answers(fp8_default_server.url, FP8_GUARD)
    for budget in FP8_GUARD:
        assert sum(lost_budget == budget for _, lost_budget, _ in lost) <= 1, lost
