"""SGLang options served with sparse layers (`option_support.SERVED`): pages of 4 tokens, a cap
on running requests, a prefill token cap, longest-prefix-first scheduling, LFU eviction in the
radix tree, a more conservative admission, no overlap scheduling and two decode steps per round
(`OPTION_ARGS`), on the lossless sparse server and on stock SGLang with the same options. The
refused ones: `tests/unit/test_option_support.py`, `tests/integration/test_option_groups.py` and
`tests/integration/test_launcher_errors.py`."""

from __future__ import annotations

import pytest

from .prompts import long_prompt
from .servers import assert_at_rest

#: Extended tier: two more servers beside CI's five do not start together in 24 GiB.
pytestmark = [pytest.mark.e2e, pytest.mark.extended]

SHARED = long_prompt(1500)


def test_outputs_equal_stocks_with_pages_admission_and_tree_options(options_server, options_stock_server):
    """Six concurrent requests, four sharing a ~350-token prefix (prefix hits under LPM and LFU),
    more than the 3 that may run at once: every greedy output is stock's, the shared prefix is
    reused, and every row comes back."""
    texts = [f"{SHARED} Question {i}: what is this text about?" for i in range(4)]
    texts += [long_prompt(700), long_prompt(1100)]
    sparse = options_server.generate_all(texts, 16)
    stock = options_stock_server.generate_all(texts, 16)
    assert [r["output_ids"] for r in sparse] == [r["output_ids"] for r in stock]
    stats = assert_at_rest(options_server)
    assert stats["prefix_hits"] >= 1 and stats["requests_running_peak"] <= 3
