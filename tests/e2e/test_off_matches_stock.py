"""Installed but off changes nothing: greedy outputs equal stock SGLang's, token for token."""

from concurrent.futures import ThreadPoolExecutor

import pytest

from .prompts import comparison_prompts

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 32


def _outputs(server, prompts):
    # Sent concurrently, as a production server would see them (batched prefill and decode).
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: server.generate(p, MAX_NEW_TOKENS), prompts))


def test_greedy_outputs_identical_to_stock(project_server, stock_server):
    prompts = comparison_prompts()
    ours = _outputs(project_server, prompts)
    stock = _outputs(stock_server, prompts)
    assert max(o["meta_info"]["prompt_tokens"] for o in ours) > 1000
    for prompt, mine, theirs in zip(prompts, ours, stock):
        assert mine["output_ids"] == theirs["output_ids"], prompt[:60]
        assert len(mine["output_ids"]) > 0
