"""Essay passages and teacher-forced scores (`kvsparse_testbed.continuations`)."""

import math

import pytest

from kvsparse_testbed.continuations import ForcedScore, essay_passages, tokenized_essay_passages, total
from kvsparse_testbed.texts import essay_text


def test_passages_are_disjoint_spans_of_the_tokens_in_order():
    tokens = list(range(1000))
    passages = essay_passages(tokens, context_lens=(100, 200), per_len=2, continuation_len=10)
    assert [p.passage_id for p in passages] == ["essay-100-0", "essay-100-1", "essay-200-0", "essay-200-1"]
    spans = [(*p.context_ids, *p.continuation_ids) for p in passages]
    assert [len(p.context_ids) for p in passages] == [100, 100, 200, 200]
    assert all(len(p.continuation_ids) == 10 for p in passages)
    assert [t for span in spans for t in span] == tokens[: 2 * 110 + 2 * 210]  # end to end, no overlap
    assert passages[0].continuation_ids == tuple(range(100, 110))


def test_too_few_tokens_or_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="fewer than"):
        essay_passages(list(range(50)), context_lens=(40,), per_len=2, continuation_len=10)
    with pytest.raises(ValueError):
        essay_passages(list(range(50)), context_lens=(0,), per_len=1, continuation_len=10)


def test_forced_scores_sum_over_tokens_and_passages():
    forced = [5, 7, 9]
    records = [[math.log(0.5), 5], [math.log(0.25), 3], [math.log(1.0), 9]]
    score = ForcedScore.of(records, forced)
    assert score.tokens == 3 and score.top1_matches == 2
    assert score.perplexity == pytest.approx(math.exp((math.log(2) + math.log(4)) / 3))
    both = total([score, ForcedScore.of([[math.log(0.5), 1]], [1])])
    assert both.tokens == 4 and both.top1_matches == 3 and both.nll == pytest.approx(4 * math.log(2))
    assert ForcedScore.from_json(score.to_json()) == score
    with pytest.raises(ValueError, match="records"):
        ForcedScore.of(records[:2], forced)
    assert math.isnan(total([]).perplexity)


def test_essay_passages_are_cut_from_the_tokenized_essays():
    calls = []

    def tokenizer(text, add_special_tokens):
        calls.append(add_special_tokens)
        return {"input_ids": [ord(c) for c in text]}  # one "token" per character

    passages = tokenized_essay_passages(tokenizer, context_lens=(50,), per_len=2, continuation_len=5)
    assert calls == [False] and len(passages) == 2
    first = "".join(map(chr, passages[0].context_ids + passages[0].continuation_ids))
    assert first == essay_text(1)[:55]
