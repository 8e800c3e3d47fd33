"""SGLang frontend programs run against the project's server: a plain one, and one that reads a
long document and uses what reuses its prefix (`fork`, `select`'s logprobs of each choice, a
regex-constrained `gen`): the same values as stock SGLang's at budgets above every length, and,
where the sparse layers evict, answers within the program's constraints and every heap row back."""

import re

import pytest
import sglang as sgl

from .prompts import long_prompt
from .servers import assert_at_rest

pytestmark = pytest.mark.e2e


@sgl.function
def capital_quiz(s, country):
    s += sgl.user(f"What is the capital of {country}? Answer in one word.")
    s += sgl.assistant(sgl.gen("answer", max_tokens=12, temperature=0))


#: `select`'s choices and `gen`'s regex in `report_reader`.
TOPICS = ("science", "cooking", "sports")
YEAR = r"(19|20)[0-9]{2}"


@sgl.function
def report_reader(s, document):
    s += sgl.user(f"Read this report.\n\n{document}\n\nWhat is the report about? Answer in one sentence.")
    s += sgl.assistant(sgl.gen("summary", max_tokens=24, temperature=0))
    branches = s.fork(2)
    for branch, question in zip(branches, ["List two words from the report.", "Is the report long or short?"]):
        branch += sgl.user(question)
        branch += sgl.assistant(sgl.gen("answer", max_tokens=16, temperature=0))
    s["branches"] = [branch["answer"] for branch in branches]
    s += sgl.user("Is the report about science, cooking or sports?")
    s += sgl.assistant(sgl.select("topic", choices=list(TOPICS)))
    s += sgl.user("Give a year as four digits.")
    s += sgl.assistant(sgl.gen("year", max_tokens=8, temperature=0, regex=YEAR))


def test_frontend_program(sparse_server):
    backend = sgl.RuntimeEndpoint(sparse_server.url)
    state = capital_quiz.run(country="France", backend=backend)
    assert "Paris" in state["answer"]
    states = capital_quiz.run_batch([{"country": "France"}, {"country": "Italy"}], backend=backend)
    assert "Rome" in states[1]["answer"]


def _read(server) -> dict:
    state = report_reader.run(document=long_prompt(3000), backend=sgl.RuntimeEndpoint(server.url))
    values = {name: state[name] for name in ("summary", "branches", "topic", "year")}
    values["topic_logprobs"] = state.get_meta_info("topic")["normalized_prompt_logprobs"]
    return values


def test_fork_select_and_regex_over_a_long_document_match_stock(sparse_server, stock_server):
    sparse, stock = _read(sparse_server), _read(stock_server)
    assert sparse["year"].isdigit() and len(sparse["year"]) == 4, sparse["year"]
    assert all(sparse["branches"]), sparse["branches"]
    assert sparse["topic_logprobs"] == pytest.approx(stock["topic_logprobs"], abs=1e-4)
    del sparse["topic_logprobs"], stock["topic_logprobs"]
    assert sparse == stock


def test_the_same_program_where_sparse_layers_evict(evicting_server):
    """The ~700-token document is above the evicting server's budget of 256: values may differ
    from stock's, but `select` picks one of its choices, the regex holds, and the program's
    requests (forks and choices sharing the document's prefix) give every row back."""
    values = _read(evicting_server)
    assert values["topic"] in TOPICS and len(values["topic_logprobs"]) == len(TOPICS)
    assert re.fullmatch(YEAR, values["year"]), values["year"]
    assert all(values["branches"]), values["branches"]
    assert_at_rest(evicting_server)
