"""Where a prompt's sentences end, for policies that keep whole sentences (no SGLang imports).

Why: at tight budgets a selection can hold every token of an answer and the model still answers
wrongly, because the words around it are gone ("The special magic UUID for" before the asked
key). `span` raises each key to a share of its
sentence's best score (`raise_to_sentence_best`), so a fact is kept with its sentence. Policies
see keys, not tokens, so the server marks, once per forward, which of SGLang's KV slots hold a
token that ends a sentence (`SentenceMarks.record`, from the forward's token ids), and a prefill
reads the marks of its whole sequence, cached prefix included (`SentenceMarks.ends_at`): a
prefix's slots were marked when its tokens were prefilled or decoded.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from sglang_kvsparse.kernels.common import Segments

#: A token ends a sentence when its text holds one of these.
SENTENCE_END = ".?!\n。？！"
#: Keys after which a sentence is cut even without an end mark: text without punctuation (code,
#: tables) is not one sentence. (Cutting at 1,024 in its place gave the same answers on the frozen
#: suite, whose text has punctuation.)
SENTENCE_KEYS = 64


def sentence_end_tokens(decode: Callable[[list[list[int]]], list[str]], vocab_size: int) -> torch.Tensor:
    """[vocab_size] bool: which token ids' texts hold a sentence end. `decode` turns a list of
    one-token id lists into their texts (a tokenizer's `batch_decode`)."""
    texts = decode([[token] for token in range(vocab_size)])
    return torch.tensor([any(c in text for c in SENTENCE_END) for text in texts], dtype=torch.bool)


class SentenceMarks:
    """One flag per KV slot of SGLang's pool: the token stored there ends a sentence."""

    def __init__(self, ends_sentence: torch.Tensor, slots: int, device: torch.device | str = "cpu") -> None:
        """`ends_sentence` [vocab] bool (`sentence_end_tokens`); `slots`: the pool's slot ids are
        0..slots-1."""
        if ends_sentence.dim() != 1 or ends_sentence.dtype != torch.bool or not ends_sentence.numel():
            raise ValueError("ends_sentence must be a non-empty 1-D bool tensor, one flag per token id")
        self.ends_sentence = ends_sentence.to(device)
        self.at_slot = torch.zeros(slots, dtype=torch.bool, device=device)
        self.counted = torch.zeros((), dtype=torch.int64, device=device)  # for stats: `count`

    def record(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """A forward writes `token_ids` [T] to `slots` [T]: mark those that end a sentence. Ids
        outside the vocabulary (padding, multimodal placeholders) end none."""
        ids = token_ids.to(self.ends_sentence.device, torch.int64)
        inside = (ids >= 0) & (ids < self.ends_sentence.numel())
        ends = self.ends_sentence[ids.clamp(0, self.ends_sentence.numel() - 1)] & inside
        self.at_slot[slots.to(self.at_slot.device, torch.int64)] = ends

    def ends_at(
        self, prefix_slots: Sequence[torch.Tensor], new_slots: torch.Tensor, extend_lens: Sequence[int]
    ) -> torch.Tensor:
        """[total_kv] bool for a prefill's keys, request-major, each request's cached prefix
        (`prefix_slots[r]`) before its new tokens (its `extend_lens[r]` of `new_slots`)."""
        device = self.at_slot.device
        parts = []
        for prefix, new in zip(prefix_slots, torch.split(new_slots, list(extend_lens))):
            parts += [prefix.to(device, torch.int64), new.to(device, torch.int64)]
        slots = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64, device=device)
        return self.at_slot[slots]

    def count(self, ends: torch.Tensor) -> None:
        """Add the sentence ends among `ends` to `counted`, on the device (no host sync)."""
        self.counted += ends.sum()


def sentence_numbers(ends: torch.Tensor, keys: Segments, longest: int = SENTENCE_KEYS) -> torch.Tensor:
    """[total] int64: each key's sentence, numbered across the batch (requests bounded by
    `keys`). A sentence starts at a request's first key and after a key that `ends` one; one
    longer than `longest` keys is cut every `longest` keys (text with no punctuation is not one
    sentence). The same for every layer: a prefill's plan numbers them once (`ForwardPlan.sentences`)."""
    if longest < 1:
        raise ValueError(f"longest: expected an integer >= 1, got {longest}")
    # No boolean-mask indexing and no value read back: on a GPU either waits for the device.
    total = ends.shape[0]
    starts = torch.zeros(total + 1, dtype=torch.bool, device=ends.device)  # one more: an empty request's start
    starts[1:total] = ends[:-1]
    starts[keys.indptr[:-1].long()] = True
    starts = starts[:total]
    positions = torch.arange(total, device=ends.device)
    first = torch.cummax(torch.where(starts, positions, 0), 0).values  # each key's sentence's first key
    starts |= (positions - first) % longest == 0
    return torch.cumsum(starts, 0) - 1


def raise_to_sentence_best(scores: torch.Tensor, sentences: torch.Tensor, share: float) -> torch.Tensor:
    """scores [total, H] (>= 0), each key raised to `share` times its sentence's best score in
    the same head: max(score, share * best of its sentence)."""
    heads = scores.shape[1]
    best = torch.zeros_like(scores)  # no more sentences than keys (and no device sync to count them)
    best = best.scatter_reduce(0, sentences[:, None].expand(-1, heads), scores, "amax", include_self=False)
    return torch.maximum(scores, share * best[sentences])
