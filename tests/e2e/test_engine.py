"""`sglang_kvsparse.Engine` gives an in-process engine that agrees with the stock server.

The engine runs in a child Python process: `Engine.shutdown()` kills every child process of the
process it runs in, which inside pytest would include the shared servers.
"""

import json
import subprocess
import sys

import pytest

from .prompts import SHORT_PROMPTS
from .servers import server_env

pytestmark = [pytest.mark.e2e, pytest.mark.extended]

MAX_NEW_TOKENS = 16

SCRIPT = f"""
import json, sys
import sglang_kvsparse

prompts = json.loads(sys.argv[1])
engine = sglang_kvsparse.Engine(dtype="float32", max_total_tokens=8192)
try:
    results = engine.generate(
        prompt=prompts, sampling_params={{"max_new_tokens": {MAX_NEW_TOKENS}, "temperature": 0}}
    )
    print("RESULT " + json.dumps([r["output_ids"] for r in results]))
finally:
    engine.shutdown()
"""


def test_engine_matches_stock_server(stock_server):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(SHORT_PROMPTS)],
        capture_output=True,
        text=True,
        env=server_env(),
        timeout=600,
    )
    lines = [line for line in result.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, result.stderr[-4000:]
    engine_ids = json.loads(lines[0][len("RESULT ") :])
    for prompt, ids in zip(SHORT_PROMPTS, engine_ids):
        assert ids == stock_server.generate(prompt, MAX_NEW_TOKENS)["output_ids"], prompt


def test_engine_rejects_a_layer_outside_the_model_before_starting():
    import sglang_kvsparse

    with pytest.raises(Exception, match="layer 40 is outside the model"):
        sglang_kvsparse.Engine(kvsparse_full_layers="0,40")
