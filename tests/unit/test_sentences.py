"""Sentence marks and the sentence raise (`sglang_kvsparse.policies.sentences`) against loops written out
by hand, on random ragged batches."""

from __future__ import annotations

import pytest
import torch

from sglang_kvsparse.kernels.common import Segments
from sglang_kvsparse.policies.sentences import (
    SentenceMarks,
    raise_to_sentence_best,
    sentence_end_tokens,
    sentence_numbers,
)


def hand_numbers(ends: list[bool], lengths: list[int], longest: int) -> list[int]:
    """Each key's sentence: a new one at each request's first key, after an end, and after
    `longest` keys of the same sentence."""
    numbers, current, run, key = [], -1, 0, 0
    for length in lengths:
        for i in range(length):
            if i == 0 or ends[key - 1] or run == longest:
                current, run = current + 1, 0
            numbers.append(current)
            run, key = run + 1, key + 1
    return numbers


@pytest.mark.parametrize("longest", [1, 3, 64])
@pytest.mark.parametrize("seed", range(4))
def test_sentence_numbers_match_a_loop(seed, longest):
    gen = torch.Generator().manual_seed(seed)
    lengths = [int(n) for n in torch.randint(1, 40, (int(torch.randint(1, 5, (1,), generator=gen)),), generator=gen)]
    total = sum(lengths)
    ends = torch.rand(total, generator=gen) < 0.15
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    got = sentence_numbers(ends, Segments.of(indptr), longest)
    assert got.tolist() == hand_numbers(ends.tolist(), lengths, longest)


@pytest.mark.parametrize("lengths", [[3, 0, 4], [5, 0], [0, 6], [2, 0, 0, 3]])
def test_empty_requests_start_no_sentence(lengths):
    ends = torch.tensor([True, False, False, True, False, False, False])[: sum(lengths)]
    indptr = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    assert sentence_numbers(ends, Segments.of(indptr), 3).tolist() == hand_numbers(ends.tolist(), lengths, 3)


def test_a_text_without_ends_is_cut_every_longest_keys():
    got = sentence_numbers(torch.zeros(10, dtype=torch.bool), Segments.of(torch.tensor([0, 10])), 4)
    assert got.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2]


def test_bad_longest_is_refused():
    with pytest.raises(ValueError, match="longest: expected an integer >= 1"):
        sentence_numbers(torch.zeros(3, dtype=torch.bool), Segments.of(torch.tensor([0, 3])), 0)


@pytest.mark.parametrize("share", [0.0, 0.5, 1.0])
def test_raise_to_sentence_best_matches_a_loop(share):
    gen = torch.Generator().manual_seed(7)
    scores = torch.rand(50, 3, generator=gen)
    sentences = torch.sort(torch.randint(0, 12, (50,), generator=gen)).values
    got = raise_to_sentence_best(scores, sentences, share)
    for i in range(50):
        same = sentences == sentences[i]
        want = torch.maximum(scores[i], share * scores[same].amax(0))
        torch.testing.assert_close(got[i], want)


def test_sentence_end_tokens_reads_each_tokens_text():
    texts = ["Hello", ".", " world", "?\n", "3", "!", "。", "-"]
    ends = sentence_end_tokens(lambda ids: [texts[i[0]] for i in ids], len(texts))
    assert ends.tolist() == [False, True, False, True, False, True, True, False]


def test_marks_follow_the_slots_a_forward_wrote():
    ends_sentence = torch.tensor([False, True, False, True])  # tokens 1 and 3 end sentences
    marks = SentenceMarks(ends_sentence, slots=16)
    marks.record(torch.tensor([3, 4, 5, 6]), torch.tensor([0, 1, 2, 3]))  # a first prompt
    marks.record(torch.tensor([9, 10, 11]), torch.tensor([1, 99, -1]))  # ids outside the vocab end none
    # A prefill of two requests: the first reuses slots 3..6 as its prefix and adds slots 9, 10;
    # the second has no prefix and adds slot 11.
    got = marks.ends_at(
        [torch.tensor([3, 4, 5, 6]), torch.tensor([], dtype=torch.int64)], torch.tensor([9, 10, 11]), [2, 1]
    )
    assert got.tolist() == [False, True, False, True, True, False, False]
    marks.record(torch.tensor([4]), torch.tensor([2]))  # a slot freed and written again
    assert not bool(marks.at_slot[4])
    marks.count(got)
    marks.count(got[:4])
    assert int(marks.counted) == 3 + 2


def test_marks_refuse_a_bad_table():
    with pytest.raises(ValueError, match="one flag per token id"):
        SentenceMarks(torch.tensor([0, 1]), slots=4)
