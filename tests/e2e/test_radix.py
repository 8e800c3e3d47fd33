"""The radix cache stays on and stays correct: a repeated prompt, or prompts sharing a long
prefix, give the same greedy output as when each is served fresh.

With sparsity off ("project") the second request really hits SGLang's cache. With sparse layers
("evicting") prefix hits are turned off (`SGLANG_RADIX_FORCE_MISS=1`: a cached prefix has no
sparse-layer K/V yet), so the tree is still built but every request is recomputed; the test shows
that this costs no correctness and that the server reports no hit.
"""

import pytest
import requests

from .prompts import long_prompt

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 24
PREFIX = long_prompt(7000)
SUFFIXES = ["\nIn one sentence:", "\nThe three key ideas are:"]


def _flush(server) -> None:
    requests.post(f"{server.url}/flush_cache", timeout=120).raise_for_status()


@pytest.mark.parametrize(("name", "expect_hits"), [("project", True), ("evicting", False)])
def test_prefix_hits_do_not_change_outputs(servers, name, expect_hits):
    server = servers[name]
    fresh = {}
    for suffix in SUFFIXES:
        _flush(server)
        fresh[suffix] = server.generate(PREFIX + suffix, MAX_NEW_TOKENS)["output_ids"]
    _flush(server)
    first = server.generate(PREFIX + SUFFIXES[0], MAX_NEW_TOKENS)
    repeated = server.generate(PREFIX + SUFFIXES[0], MAX_NEW_TOKENS)
    shared = server.generate(PREFIX + SUFFIXES[1], MAX_NEW_TOKENS)
    assert first["output_ids"] == repeated["output_ids"] == fresh[SUFFIXES[0]]
    assert shared["output_ids"] == fresh[SUFFIXES[1]]
    cached = [result["meta_info"]["cached_tokens"] for result in (repeated, shared)]
    if expect_hits:
        assert all(tokens > 1000 for tokens in cached), cached
    else:
        assert cached == [0, 0]
