"""Installed but off changes nothing: greedy outputs equal stock SGLang's, token for token."""

import pytest

from .prompts import comparison_prompts

pytestmark = [pytest.mark.e2e, pytest.mark.extended]

MAX_NEW_TOKENS = 32


def test_greedy_outputs_identical_to_stock(project_server, stock_server):
    prompts = comparison_prompts()
    ours = project_server.generate_all(prompts, MAX_NEW_TOKENS)
    stock = stock_server.generate_all(prompts, MAX_NEW_TOKENS)
    assert max(o["meta_info"]["prompt_tokens"] for o in ours) > 1000
    for prompt, mine, theirs in zip(prompts, ours, stock):
        assert mine["output_ids"] == theirs["output_ids"], prompt[:60]
        assert len(mine["output_ids"]) > 0
