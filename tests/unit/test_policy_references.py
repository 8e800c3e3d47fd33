"""Every scoring policy against a float64 computation by hand of what it keeps, at prefill and while
decoding, through the sparse layer's own forward on a heap (one sparse layer, one request).

Prefill: the row keeps the sink, the window and the best of the rest by the policy's float64
scores, and stores those scores; a prompt within the budget keeps every key, scored as a decoded
key would be (so that later evictions compare it in the policy's units). Decode, step by step
from what the row holds: the new key's score is the policy's (zero, its position, -||k|| or its
position's pseudo-random number), every kept key's score is updated by this step's float64
attention as the policy says (added, replaced or left), and an eviction keeps the sink, the
window and the best-ranked rest (SnapKV's ranking is the stored score; span's spreads it forward
over the row's entries). Checks are tie-proof: a kept entry never ranks below a dropped one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from sglang_kvsparse.forward.eviction import evict_planned
from sglang_kvsparse.forward.planning import plan_decode, plan_extend
from sglang_kvsparse.forward.sparse_attention import sparse_decode, sparse_extend
from sglang_kvsparse.policies import POLICIES, ScoringPolicy
from sglang_kvsparse.policies.sentences import SENTENCE_KEYS, sentence_numbers

from .heap import H_KV, D, grow, make_state

G = 2  # query heads per KV head
SCALE = 0.3
SINK, WINDOW, BUDGET, EVICT_PAGE = 1, 3, 12, 4
STEPS = 22
#: Small knobs so that pooling and spreading show at these lengths.
KNOBS: dict[str, dict] = {
    "snapkv": {"pool_kernel": 3},
    "span": {"long_follow": 4},
}


def probabilities(q: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """float64 causal attention of the last len(q) of `keys`' positions, summed over each KV
    head's query heads: [T, H_q, D] x [L, H_kv, D] -> [H_kv, T, L]."""
    t, n = q.shape[0], keys.shape[0]
    logits = torch.einsum("thd,lhd->htl", q.double(), keys.double().repeat_interleave(G, dim=1)) * SCALE
    future = torch.arange(n)[None, :] > (n - t + torch.arange(t))[:, None]
    probs = logits.masked_fill(future, float("-inf")).softmax(-1)
    return probs.unflatten(0, (H_KV, G)).sum(1)


def max_over(scores: torch.Tensor, offsets: range) -> torch.Tensor:
    """scores [L, H]: each position's max over scores[i + o] for o in offsets, inside 0..L-1."""
    n = scores.shape[0]
    return torch.stack([torch.stack([scores[i + o] for o in offsets if 0 <= i + o < n]).amax(0) for i in range(n)])


@dataclass(frozen=True)
class HandPolicy:
    """What a policy means, written out: its prefill score, its decode update, a decoded key's
    first score and the ranking an eviction uses."""

    prefill: Callable[[torch.Tensor, torch.Tensor, dict], torch.Tensor]  # (probs [H, T, L], keys, knobs) -> [L, H]
    update: str  # "add", "replace" or "none"
    new_key: Callable[[torch.Tensor, int], torch.Tensor] = lambda k, position: torch.zeros(H_KV, dtype=torch.float64)
    eviction_rank: Callable[[torch.Tensor, dict], torch.Tensor] = lambda scores, knobs: scores


def window_mass(probs: torch.Tensor, queries: int) -> torch.Tensor:
    return probs[:, -queries:].sum(1).T


def snapkv(probs, keys, knobs):
    """The window's mass, pooled."""
    mass = window_mass(probs, WINDOW)
    return max_over(mass, range(-(knobs["pool_kernel"] // 2), knobs["pool_kernel"] // 2 + 1))


def span(probs, keys, knobs):
    """The window's mass (unpooled); per head, the best local maximum (within `long_follow` keys
    either side) past the sink and `long_follow` keys before the window spread `long_follow` keys
    forward."""
    pooled = window_mass(probs, WINDOW)
    n, reach = pooled.shape[0], knobs["long_follow"]
    places = range(SINK, n - (WINDOW + reach))
    longer = torch.zeros_like(pooled)
    for h in range(pooled.shape[1]):
        peaks = [i for i in places if pooled[i, h] == pooled[max(0, i - reach) : i + reach + 1, h].max()]
        best = max(pooled[i, h] for i in peaks)
        for i in (i for i in peaks if pooled[i, h] == best):
            longer[i : i + reach + 1, h] = torch.maximum(longer[i : i + reach + 1, h], best)
    return torch.maximum(pooled, longer)


def position_hash(position: int) -> torch.Tensor:
    """`random`'s number of a position, per KV head, in Python integers: an integer hash
    (xor-shift 16, multiply by 0x45D9F3B, twice, then xor-shift 16) of position x heads + head + 1,
    over 2**32."""
    numbers = []
    for head in range(H_KV):
        x = (position * H_KV + head + 1) % 2**32
        for _ in range(2):
            x = (((x >> 16) ^ x) * 0x45D9F3B) % 2**32
        numbers.append(((x >> 16) ^ x) / 2**32)
    return torch.tensor(numbers, dtype=torch.float64)


HAND: dict[str, HandPolicy] = {
    "snapkv": HandPolicy(snapkv, "add"),
    "span": HandPolicy(span, "add"),
    "h2o": HandPolicy(lambda probs, keys, knobs: probs.sum(1).T, "add"),
    "tova": HandPolicy(lambda probs, keys, knobs: window_mass(probs, 1), "replace"),
    "streamingllm": HandPolicy(
        lambda probs, keys, knobs: torch.arange(keys.shape[0], dtype=torch.float64)[:, None].expand(-1, H_KV),
        "none",
        new_key=lambda k, position: torch.full((H_KV,), float(position), dtype=torch.float64),
    ),
    "keynorm": HandPolicy(
        lambda probs, keys, knobs: -keys.double().norm(dim=-1),
        "none",
        new_key=lambda k, position: -k.double().norm(dim=-1),
    ),
    "random": HandPolicy(
        lambda probs, keys, knobs: torch.stack([position_hash(p) for p in range(keys.shape[0])]),
        "none",
        new_key=lambda k, position: position_hash(position),
    ),
}


def test_every_policy_has_a_hand_computation():
    assert set(HAND) == set(POLICIES)


def assert_best_kept(rank: torch.Tensor, kept: list[int], length: int) -> None:
    """`kept` (positions within 0..length-1, one head) holds the protected ones and the best of the
    rest by `rank` [length]: budget entries, no dropped one ranking above a kept one."""
    protected = {*range(min(SINK, length)), *range(max(0, length - WINDOW), length)}
    assert len(kept) == min(BUDGET, length) and protected <= set(kept)
    chosen = [p for p in kept if p not in protected]
    dropped = [p for p in range(length) if p not in kept]
    if chosen and dropped:
        assert float(rank[chosen].min()) >= float(rank[dropped].max()) - 1e-9, (chosen, dropped)


class Row:
    """One request's row in the sparse layer (layer 1) of a two-layer state."""

    def __init__(self, policy: ScoringPolicy, final_length: int) -> None:
        self.state, _ = make_state(
            num_layers=2, full_layers=(0,), budget=BUDGET, window=WINDOW, evict_page=EVICT_PAGE, policy=policy
        )
        self.state.expect([1], [final_length])
        place = self.state.layout.layer_places[1]
        self.place, self.lane, self.group = place, self.state.lanes[place.lane], self.state.groups[place.group]

    def held(self, keys: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
        """Per KV head, the positions the row holds in entry order (found by their keys among
        `keys` [L, H, D]), and their stored scores [n, H] in float64."""
        n = self.group.table.count(1)
        rows = self.group.table.entries(1)[:n, self.place.column]
        score_slots = self.group.score_slots(torch.full((n,), 1), torch.arange(n))[:, self.place.column]
        stored = self.lane.k[rows]
        positions = [
            [int((keys[:, h] == stored[e, h]).all(-1).nonzero().item()) for e in range(n)] for h in range(H_KV)
        ]
        return positions, self.lane.scores[score_slots].double()


@pytest.mark.parametrize("prompt", [30, 8], ids=["prompt-over-budget", "prompt-within-budget"])
@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_keeps_what_its_float64_computation_keeps(name, prompt):
    knobs = KNOBS.get(name, {})
    hand, policy = HAND[name], POLICIES[name](**knobs)
    gen = torch.Generator().manual_seed(sorted(POLICIES).index(name))
    total = prompt + STEPS
    q = torch.randn(total, H_KV * G, D, generator=gen)
    keys = torch.randn(total, H_KV, D, generator=gen)
    values = torch.randn(total, H_KV, D, generator=gen)
    row = Row(policy, total)

    # Prefill: the best by the hand scores, with those scores stored (all keys, scored as
    # decoded ones, when the prompt fits the budget).
    grow(row.state, [1], [prompt])
    plan = plan_extend(row.state, [1], [0], [prompt])
    sparse_extend(q[:prompt], keys[:prompt], values[:prompt], SCALE, plan, plan.column(row.place), row.lane, policy)
    row.state.finish_forward()
    if prompt > BUDGET:
        want = hand.prefill(probabilities(q[:prompt], keys[:prompt]), keys[:prompt], knobs)
    else:
        want = torch.stack([hand.new_key(keys[p], p) for p in range(prompt)])
    held, stored = row.held(keys)
    for h in range(H_KV):
        assert held[h] == sorted(held[h])  # entries in position order
        assert_best_kept(want[:, h], held[h], prompt)
        torch.testing.assert_close(stored[:, h], want[held[h], h], atol=1e-5, rtol=1e-5)

    evictions = 0
    for position in range(prompt, total):
        held, before = row.held(keys)
        grow(row.state, [1], [position + 1])
        plan = plan_decode(row.state, [1])
        evicting = bool(plan.evictions)
        evict_planned(plan, row.state.layout, row.state.lanes, policy)
        sparse_decode(
            q[position : position + 1],
            keys[position : position + 1],
            values[position : position + 1],
            SCALE,
            plan,
            plan.column(row.place),
            row.lane,
            policy,
            torch.tensor([position]),
        )
        row.state.finish_forward()
        after_positions, after = row.held(keys)
        evictions += evicting
        for h in range(H_KV):
            old = held[h]
            if evicting:  # the eviction kept the best-ranked of the old entries, in their order
                rank = hand.eviction_rank(before[:, h : h + 1], knobs)[:, 0]
                kept_entries = [old.index(p) for p in after_positions[h][:-1]]
                assert_best_kept(rank, kept_entries, len(old))
            else:
                kept_entries = list(range(len(old)))
            assert after_positions[h] == [old[e] for e in kept_entries] + [position]
            # This step's attention over what the row now holds, and the update it makes.
            mass = probabilities(q[position : position + 1], keys[after_positions[h]])[h, 0]
            start = torch.cat([before[kept_entries, h], hand.new_key(keys[position], position)[h : h + 1]])
            expected = {"add": start + mass, "replace": mass, "none": start}[hand.update]
            torch.testing.assert_close(after[:, h], expected, atol=1e-5, rtol=1e-5)
    assert evictions >= 3


def raised_to_sentences(scores: torch.Tensor, ends: list[bool], share: float, longest: int) -> torch.Tensor:
    """`span`'s sentence raise by hand: a sentence starts at key 0, after a key that ends one and
    after `longest` keys; each key becomes max(its score, share * its sentence's best), per head."""
    sentences, current, run = [], -1, 0
    for i in range(len(ends)):
        if i == 0 or ends[i - 1] or run == longest:
            current, run = current + 1, 0
        sentences.append(current)
        run += 1
    out = scores.clone()
    for i, sentence in enumerate(sentences):
        members = [j for j, s in enumerate(sentences) if s == sentence]
        out[i] = torch.maximum(scores[i], share * scores[members].amax(0))
    return out


@pytest.mark.parametrize("share", [0.9, 1.0])
def test_span_keeps_whole_sentences_as_its_float64_computation_says(share):
    """A prefill whose keys carry sentence ends (the server marks them from the prompt's tokens):
    `span` keeps by its scores raised to a share of each sentence's best."""
    knobs = {**KNOBS["span"], "sentence": share}
    policy = POLICIES["span"](**knobs)
    prompt = 30
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(prompt, H_KV * G, D, generator=gen)
    keys = torch.randn(prompt, H_KV, D, generator=gen)
    values = torch.randn(prompt, H_KV, D, generator=gen)
    ends = torch.rand(prompt, generator=gen) < 0.2
    row = Row(policy, prompt)
    grow(row.state, [1], [prompt])
    plan = plan_extend(row.state, [1], [0], [prompt])
    plan = dataclasses.replace(plan, sentences=sentence_numbers(ends, plan.keys))
    sparse_extend(q, keys, values, SCALE, plan, plan.column(row.place), row.lane, policy)
    row.state.finish_forward()
    plain = span(probabilities(q, keys), keys, knobs)
    want = raised_to_sentences(plain, ends.tolist(), share, SENTENCE_KEYS)
    held, stored = row.held(keys)
    changed = False
    for h in range(H_KV):
        assert_best_kept(want[:, h], held[h], prompt)
        torch.testing.assert_close(stored[:, h], want[held[h], h], atol=1e-5, rtol=1e-5)
        try:
            assert_best_kept(plain[:, h], held[h], prompt)
        except AssertionError:
            changed = True  # a kept key ranks below a dropped one by the plain scores
    assert changed  # the raise chose differently from the plain scores somewhere
