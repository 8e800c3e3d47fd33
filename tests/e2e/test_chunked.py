"""Long prompts and conversations with sparse layers: chunked prefill and multi-turn reuse.

Every server of the session but "unchunked" prefills in chunks of 512 tokens with mixed chunks, so
`test_lossless.py` and `test_radix.py` already compare chunked prompts with stock SGLang (same
chunk size) with and without prefix hits. Here: a chunked prompt keeps what the unchunked prompt
keeps when the budget is below its length (same greedy outputs), a prompt near the model's
context is served, and a conversation's turn k reuses at least turn k-1's whole prompt.
"""

from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

from kvsparse_testbed.continuations import tokenized_essay_passages
from kvsparse_testbed.retrieval import passkey_prompts
from kvsparse_testbed.teacher_forcing import KEY, ForcedContinuation

from .conftest import SPARSE_CONTEXT
from .prompts import long_prompt
from .servers import assert_every_slot_back

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 16


def test_prompts_whose_last_chunk_is_moved_match_stock(sparse_server, stock_server):
    """Prompts a few tokens longer than one or two chunks, sent at once: the project moves each
    cut so the last chunk holds the window (and gives up the rest of that round's chunk budget,
    as stock would have used it), stock cuts at 512; the outputs are stock's."""
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1000, 30000, (n,), generator=generator).tolist() for n in (530, 1050, 600)]

    def generate(server, ids):
        payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0}}
        response = requests.post(f"{server.url}/generate", json=payload, timeout=600)
        response.raise_for_status()
        return response.json()["output_ids"]

    for server in (sparse_server, stock_server):
        server.flush_cache()
    with ThreadPoolExecutor(len(prompts)) as pool:
        ours = list(pool.map(lambda ids: generate(sparse_server, ids), prompts))
        stock = list(pool.map(lambda ids: generate(stock_server, ids), prompts))
    assert ours == stock
    assert_every_slot_back(sparse_server.idle_stats())


@pytest.mark.extended  # CI's tier: the same at one layer, `tests/unit/test_chunked_prefill.py`
def test_chunked_and_unchunked_prompts_keep_the_same_entries(evicting_server, unchunked_server):
    """Budget 256, retrieval prompts of ~2,100 tokens (5 chunks), one at a time on each server:
    the chunked server scores every key with the last chunk's window, as the unchunked one does."""
    chunked, unchunked = evicting_server, unchunked_server
    prompts = [p.user_message for p in passkey_prompts(seed=7, lengths=(2_100,), depths=(0.3, 0.7))]
    for server in (chunked, unchunked):
        server.flush_cache()
    chunks_before = chunked.stats()["chunks_stored"]
    for prompt in prompts:
        mine = chunked.generate(prompt, MAX_NEW_TOKENS)
        theirs = unchunked.generate(prompt, MAX_NEW_TOKENS)
        assert mine["meta_info"]["prompt_tokens"] > 4 * 512
        assert mine["output_ids"] == theirs["output_ids"], prompt[-60:]
    stats = chunked.idle_stats()
    # The first prompt stores 4 chunks before its last; the others hit its cached opening first.
    assert stats["chunks_stored"] - chunks_before >= 2 * len(prompts)
    assert unchunked.stats()["chunks_stored"] == 0
    assert_every_slot_back(stats)


def test_a_prompt_near_the_context_is_served_in_chunks(sparse_server):
    before = sparse_server.stats()["chunks_stored"]
    result = sparse_server.generate(long_prompt(19_000), 4)
    assert SPARSE_CONTEXT - 600 < result["meta_info"]["prompt_tokens"] < SPARSE_CONTEXT - 4
    assert len(result["output_ids"]) == 4
    stats = sparse_server.idle_stats()
    assert stats["chunks_stored"] - before >= 7
    assert_every_slot_back(stats)


def test_a_prompt_chunked_at_sglangs_own_size_is_served_without_the_radix_cache(uncached_server):
    """`--disable-radix-cache` and no `--chunked-prefill-size`: SGLang still chunks, at its own
    default (4,096 tokens on the CPU), and the sparse layers hold the earlier chunk in the prefix
    store until the last (`patches.memory.needs_prefix_store`; reading the size as given, None,
    such a server stopped at its first chunked prompt). Then its first 500-odd tokens as a prompt
    of their own, which a radix cache would reuse: nothing is reused."""
    server = uncached_server
    before = server.stats()
    text = long_prompt(18_000)
    chunked = server.generate(text, MAX_NEW_TOKENS)  # 4,261 tokens
    opening = server.generate(text[:2400], MAX_NEW_TOKENS)
    assert chunked["meta_info"]["prompt_tokens"] > 4096
    assert opening["meta_info"]["prompt_tokens"] > 500 and opening["meta_info"]["cached_tokens"] == 0
    stats = server.idle_stats()
    assert stats["chunks_stored"] - before["chunks_stored"] == 1
    assert stats["prefix_hits"] == before["prefix_hits"]
    assert_every_slot_back(stats)


def test_each_turn_of_a_conversation_reuses_the_previous_prompt(evicting_server):
    """Four turns through the OpenAI endpoint on the evicting server (budget 256: every turn
    evicts): turn k's cached tokens are at least turn k-1's prompt tokens. Each new message is
    longer than the observation window (16 tokens), which a prefill must compute itself."""
    evicting_server.flush_cache()
    messages = [{"role": "user", "content": long_prompt(4000)}]
    questions = [
        "Please say that again in fewer words, keeping only the one idea that matters most to the "
        "author, and leave out every example he gives along the way.",
        "Now tell me which single sentence of the essay you would keep if you could keep only one, "
        "and explain in a few words why that sentence and not another.",
        "Finally, give the essay a short title of at most six words that a reader would remember, "
        "and say who you think the intended reader of the essay is.",
    ]
    prompt_tokens, cached = [], []
    for turn in range(4):
        response = requests.post(
            f"{evicting_server.url}/v1/chat/completions",
            json={"model": "default", "messages": messages, "max_tokens": 24, "temperature": 0},
            timeout=300,
        )
        response.raise_for_status()
        body = response.json()
        usage = body["usage"]
        prompt_tokens.append(usage["prompt_tokens"])
        cached.append((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0))
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
        if turn < 3:
            messages.append({"role": "user", "content": questions[turn]})
    assert prompt_tokens[0] > 800
    for k in range(1, 4):
        assert cached[k] >= prompt_tokens[k - 1], (prompt_tokens, cached)
    stats = evicting_server.idle_stats()
    assert stats["store_entries_adopted"] > 0
    assert_every_slot_back(stats)


@pytest.mark.extended  # a benchmark's instrument (`bench/fidelity.py`), not what the server serves
def test_teacher_forcing_decodes_every_forced_token_of_chunked_prompts(evicting_server, model_path):
    """bench/fidelity.py's language-model suite on the evicting server: passages of 1,100 and 700
    tokens (three and two chunks, mixed with each other's decode steps) forced on their real
    continuations at once. SGLang samples a token for a prompt's middle chunk too and drops it;
    the forcing processor must not count that as a step, or every later token is shifted."""
    from transformers import AutoTokenizer

    passages = tokenized_essay_passages(AutoTokenizer.from_pretrained(model_path), (1_100, 700), 1, 24)

    def forced(passage):
        sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
        sampling["custom_params"] = {"forced_ids": list(passage.continuation_ids)}
        payload = {
            "input_ids": list(passage.context_ids),
            "sampling_params": sampling,
            "custom_logit_processor": ForcedContinuation.to_str(),
        }
        response = requests.post(f"{evicting_server.url}/generate", json=payload, timeout=600)
        response.raise_for_status()
        return response.json()

    evicting_server.flush_cache()
    with ThreadPoolExecutor(len(passages)) as pool:
        results = list(pool.map(forced, passages))
    for passage, result in zip(passages, results):
        assert result["output_ids"] == list(passage.continuation_ids)
        assert len(result["meta_info"][KEY]) == len(passage.continuation_ids)
    assert_every_slot_back(evicting_server.idle_stats())
