"""An SGLang frontend program runs against the project's server."""

import pytest
import sglang as sgl

pytestmark = pytest.mark.e2e


@sgl.function
def capital_quiz(s, country):
    s += sgl.user(f"What is the capital of {country}? Answer in one word.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))


def test_frontend_program(sparse_server):
    backend = sgl.RuntimeEndpoint(sparse_server.url)
    state = capital_quiz.run(country="France", backend=backend)
    assert "Paris" in state["answer"]
    states = capital_quiz.run_batch([{"country": "France"}, {"country": "Italy"}], backend=backend)
    assert "Rome" in states[1]["answer"]
