"""Prompts for output comparisons: short ones and one of well over 1,000 tokens."""

from kvsparse_testbed.texts import essay_text

SHORT_PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.\n",
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
]


def long_prompt(min_chars: int = 6000) -> str:
    """Essay text (about 1,300+ tokens at 6,000 characters) followed by a question."""
    return essay_text(min_chars)[:min_chars] + "\n\nQuestion: what is the essay above about?\nAnswer:"


def comparison_prompts() -> list[str]:
    return [*SHORT_PROMPTS, long_prompt()]
