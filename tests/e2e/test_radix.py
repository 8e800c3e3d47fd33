"""The radix cache stays on and prefix hits change no output: a repeated prompt and prompts
sharing a long prefix give the same greedy output as each served fresh (after a flush).

With sparse layers ("evicting", budget 256) the full layers hit SGLang's cache as in stock, and
the sparse layers read the prefix's uncompressed K/V from the project's prefix store, so a hit
attends, scores and keeps exactly what the fresh prefill would; the server reports the hits
(`cached_tokens`, `prefix_hits`). (With sparsity off the cache is SGLang's own, unchanged:
`test_off_matches_stock.py` shows the plugin off changes no output.)

Concurrent hits are compared with stock token for token on the lossless server
(`test_lossless.py`). On the evicting server they are checked for what they hold, not for their
tokens: with a budget of 256, greedy outputs depend on how the scheduler happened to batch the
requests, hit or no hit (measured: the same four prompts, no hits, one differed between being
served alone and in one batch; served in the same batches, with and without hits, all four were
identical). Eviction choices amplify float differences that stock SGLang's argmax rarely shows.
"""

import pytest
import requests
from transformers import AutoTokenizer

from sglang_kvsparse.policies.sentences import SENTENCE_END

from .prompts import long_prompt
from .servers import assert_every_slot_back

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 24
PREFIX = long_prompt(7000)
SUFFIXES = ["\nIn one sentence:", "\nThe three key ideas are:", "\nA title for it:"]


def _served_fresh(server, prompts: list[str]) -> list[list[int]]:
    fresh = []
    for prompt in prompts:
        server.flush_cache()
        fresh.append(server.generate(prompt, MAX_NEW_TOKENS)["output_ids"])
    server.flush_cache()
    return fresh


def test_every_prefix_hit_matches_its_fresh_output(evicting_server):
    """The prefix cached alone, then prompts sharing it and one of them again (a whole-prompt hit):
    each output is the one it gets served fresh."""
    prompts = [PREFIX + suffix for suffix in SUFFIXES]
    fresh = _served_fresh(evicting_server, prompts)
    evicting_server.generate(PREFIX, 1)  # caches the prefix
    for prompt, expected in [*zip(prompts, fresh), (prompts[0], fresh[0])]:
        result = evicting_server.generate(prompt, MAX_NEW_TOKENS)
        assert result["meta_info"]["cached_tokens"] > 1000
        assert result["output_ids"] == expected, prompt[-30:]


def test_concurrent_hits_read_pinned_prefixes_and_give_every_slot_back(evicting_server):
    """Four requests reuse one cached prefix in the same steps: each gets its hit, and all the
    prefix store's pages outlive the batch's allocations (a lost entry would fail the prefill)."""
    evicting_server.flush_cache()
    evicting_server.generate(PREFIX, 1)
    hits_before = evicting_server.stats()["prefix_hits"]
    together = evicting_server.generate_all([PREFIX + suffix for suffix in SUFFIXES], MAX_NEW_TOKENS)
    assert all(result["meta_info"]["cached_tokens"] > 1000 for result in together)
    assert all(len(result["output_ids"]) > 0 for result in together)
    stats = evicting_server.idle_stats()
    assert stats["prefix_hits"] - hits_before == len(SUFFIXES)
    assert stats["heap"]["prefix_store"] > 1000 * 14  # the prefix in all 14 columns, for the next hit
    assert_every_slot_back(stats)


def test_prefills_see_the_sentence_ends_of_cached_and_decoded_tokens(evicting_server, model_path):
    """`span` keeps whole sentences by the marks the server records for each KV slot from the
    token written there (`sglang_kvsparse.policies.sentences`). Every prefill that keeps entries counts the
    sentence ends among its keys, cached prefix included. In a three-turn conversation the third
    turn's cached prefix holds the first answer under the slots it was decoded into (the tree
    keeps those; `patches/prefix.py`), so its count is right only if decode steps marked them."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)

    def sentence_ends(ids: list[int]) -> int:  # by hand, from this process's own tokenizer
        return sum(any(c in tokenizer.decode([token]) for c in SENTENCE_END) for token in ids)

    def tokens(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    def turn(ids: list[int], max_new_tokens: int) -> tuple[list[int], int, int]:
        """The answer's ids, the cached prefix's length and the prefill's count of sentence ends."""
        before = evicting_server.stats()["prefill_sentence_ends"]
        payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
        response = requests.post(f"{evicting_server.url}/generate", json=payload, timeout=600)
        response.raise_for_status()
        result = response.json()
        counted = evicting_server.stats()["prefill_sentence_ends"] - before
        return result["output_ids"], result["meta_info"]["cached_tokens"], counted

    evicting_server.flush_cache()
    chat = [{"role": "user", "content": long_prompt(3000)}]
    first = tokens(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    answer, _, counted = turn(first, 48)
    assert counted == sentence_ends(first) > 10
    second = (
        first + answer + tokens("<|im_end|>\n<|im_start|>user\nAnd in one word?<|im_end|>\n<|im_start|>assistant\n")
    )
    answer_2, _, counted = turn(second, 8)
    assert counted == sentence_ends(second)
    third = second + answer_2 + tokens("<|im_end|>\n<|im_start|>user\nWhy?<|im_end|>\n<|im_start|>assistant\n")
    _, cached, counted = turn(third, 1)
    assert cached >= len(first) + len(answer) - 1  # the first answer came from the cache
    assert sentence_ends(answer[:-1]) > 0  # decoded tokens with marks to read
    assert counted == sentence_ends(third)
