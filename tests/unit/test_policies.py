"""Every scoring policy: shape and alignment contract, plus what makes each one itself."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from sglang_kvsparse.config import parse_config
from sglang_kvsparse.kernels import FIRST_SCORES, SCORE_UPDATES, extend_attention_with_stats, first_scores, select_kept
from sglang_kvsparse.kernels.common import Segments
from sglang_kvsparse.kernels.testing import make_ragged_batch
from sglang_kvsparse.policies import POLICIES, PrefillScoringInputs, SnapKVPolicy
from sglang_kvsparse.policies.sentences import sentence_numbers

KV_LENS = [37, 80, 53]
Q_LENS = [37, 24, 53]  # the second request extends a cached prefix of 56 tokens
WINDOW = 8
SINK = 2


def _inputs(seed: int = 0) -> PrefillScoringInputs:
    batch = make_ragged_batch(Q_LENS, KV_LENS, num_kv_heads=3, group=3, head_dim=64, seed=seed)
    _, lse = extend_attention_with_stats(
        batch.q,
        batch.k_buf,
        batch.v_buf,
        batch.qo_indptr,
        batch.kv_indptr,
        batch.kv_indices,
        batch.sm_scale,
        backend="torch",
    )
    return PrefillScoringInputs(
        q=batch.q,
        k_buf=batch.k_buf,
        lse=lse,
        qo_indptr=batch.qo_indptr,
        keys=Segments.of(batch.kv_indptr),
        kv_indices=batch.kv_indices,
        sm_scale=batch.sm_scale,
        window=WINDOW,
        sink=SINK,
    )


def test_every_registered_policy_is_configurable_by_name_and_round_trips():
    for name, cls in POLICIES.items():
        config = parse_config(json_or_path=f'{{"policy": "{name}"}}', preset="snapkv")
        assert config.policy == cls() and config.to_dict()["policy"]["name"] == name
        assert parse_config(json_or_path=json.dumps(config.to_dict())) == config


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_scores_are_per_key_per_kv_head(name):
    inputs = _inputs()
    policy = parse_config(json_or_path=f'{{"policy": "{name}"}}', preset="snapkv").policy
    assert policy.name == name
    scores = policy.score(inputs)
    assert scores.shape == (sum(KV_LENS), 3)
    assert scores.dtype == torch.float32
    assert torch.isfinite(scores).all()
    # Deterministic for the same inputs: selection must not depend on run-to-run noise.
    assert torch.equal(scores, policy.score(inputs))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_scores_follow_the_keys_not_their_slots(name):
    """Moving keys to other slots (same content, same order) must not change the scores."""
    inputs = _inputs()
    perm = torch.randperm(inputs.k_buf.shape[0], generator=torch.Generator().manual_seed(5))
    moved_k = torch.empty_like(inputs.k_buf)
    moved_k[perm] = inputs.k_buf
    moved = PrefillScoringInputs(**{**inputs.__dict__, "k_buf": moved_k, "kv_indices": perm[inputs.kv_indices]})
    policy = POLICIES[name]()
    torch.testing.assert_close(policy.score(moved), policy.score(inputs))


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_selection_keeps_protected_and_budget(name):
    inputs = _inputs()
    scores = POLICIES[name]().score(inputs)
    kept, kept_lens = select_kept(scores, inputs.keys, budget=32, sink=4, window=WINDOW)
    assert kept_lens.tolist() == [32, 32, 32]
    for b, length in enumerate(KV_LENS):
        for h in range(3):
            positions = set(kept[b, h].tolist())
            assert set(range(4)) | set(range(length - WINDOW, length)) <= positions


def test_snapkv_prefers_the_key_the_window_attends_to():
    inputs = _inputs()
    # Make request 1's window queries on head group 0 point at its key at position 20.
    end = int(inputs.qo_indptr[2])
    slot = int(inputs.kv_indices[int(inputs.keys.indptr[1]) + 20])
    direction = torch.randn(64, generator=torch.Generator().manual_seed(9))
    q = inputs.q.clone()
    q[end - WINDOW : end, 0:3] = direction
    k_buf = inputs.k_buf.clone()
    k_buf[slot, 0] = direction
    _, lse = extend_attention_with_stats(
        q,
        k_buf,
        k_buf,
        inputs.qo_indptr,
        inputs.keys.indptr,
        inputs.kv_indices,
        inputs.sm_scale,
        backend="torch",
    )
    boosted = PrefillScoringInputs(**{**inputs.__dict__, "q": q, "k_buf": k_buf, "lse": lse})
    scores = SnapKVPolicy(pool_kernel=1).score(boosted)
    request = scores[int(inputs.keys.indptr[1]) : int(inputs.keys.indptr[2]), 0]
    assert int(request[: 80 - WINDOW].argmax()) == 20
    # Max pooling spreads the score to the neighbours, so the span survives together.
    pooled = SnapKVPolicy(pool_kernel=5).score(boosted)[int(inputs.keys.indptr[1]) :, 0]
    assert (pooled[18:23] == pooled[20]).all()


def test_streamingllm_keeps_the_most_recent():
    inputs = _inputs()
    scores = POLICIES["streamingllm"]().score(inputs)
    kept, _ = select_kept(scores, inputs.keys, budget=24, sink=4, window=WINDOW)
    assert kept[1, 0].tolist() == [0, 1, 2, 3, *range(60, 80)]


def test_random_keeps_a_spread_choice_per_head_and_scores_a_decoded_key_as_a_prompt_key():
    """Random eviction: beside the protected keys, each KV head keeps its own choice from the whole
    middle (not the latest, as StreamingLLM), the same in every run; a key decoded at position p
    starts with the score a prompt key at p gets."""
    inputs = _inputs()
    policy = POLICIES["random"]()
    scores = policy.score(inputs)
    kept, _ = select_kept(scores, inputs.keys, budget=24, sink=4, window=WINDOW)
    middle = [sorted(set(kept[1, h].tolist()) - set(range(4)) - set(range(80 - WINDOW, 80))) for h in range(3)]
    assert all(len(chosen) == 24 - 4 - WINDOW for chosen in middle)
    assert middle[0] != middle[1] != middle[2]
    assert min(min(chosen) for chosen in middle) < 20 and max(max(chosen) for chosen in middle) > 40
    positions = torch.arange(KV_LENS[1])
    k = torch.zeros(KV_LENS[1], 3, 64)
    request = scores[int(inputs.keys.indptr[1]) : int(inputs.keys.indptr[2])]
    assert torch.equal(first_scores(policy.first_score, k, positions), request)


def test_keynorm_prefers_small_keys():
    inputs = _inputs()
    k_buf = inputs.k_buf.clone()
    slot = int(inputs.kv_indices[10])
    k_buf[slot] *= 0.01
    scores = POLICIES["keynorm"]().score(PrefillScoringInputs(**{**inputs.__dict__, "k_buf": k_buf}))
    assert int(scores[: KV_LENS[0]].argmax(dim=0)[0]) == 10


def test_span_raises_every_requests_keys_to_their_sentences_best_where_the_ends_are_known():
    """Each request of a batch gets its keys raised to a share of their sentence's best; without
    sentence ends (no tokenizer) `span` keeps its plain scores."""
    ends = torch.zeros(sum(KV_LENS), dtype=torch.bool)
    ends[::5] = True
    inputs = _inputs()
    inputs = dataclasses.replace(inputs, sentences=sentence_numbers(ends, inputs.keys))
    plain = POLICIES["span"](sentence=0.0).score(inputs)
    raised = POLICIES["span"](sentence=1.0).score(inputs)
    bounds = [0, *torch.tensor(KV_LENS).cumsum(0).tolist()]
    for start, end in zip(bounds, bounds[1:]):
        mine, own = raised[start:end], plain[start:end]
        assert not torch.equal(mine, own) and bool((mine >= own).all())
    unknown = POLICIES["span"](sentence=1.0).score(dataclasses.replace(inputs, sentences=None))
    torch.testing.assert_close(unknown, plain, rtol=0, atol=0)


#: The policies whose decode steps are alike (each step's attention added, no first score for a
#: new key). TOVA replaces scores; KeyNorm, StreamingLLM and random leave them and score a new key
#: each its own way.
ADDING = {"h2o", "snapkv", "span"}


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policies_decode_alike_only_when_their_decode_steps_are_the_same(name):
    policy = POLICIES[name]()
    assert policy.decodes_like(policy)
    assert policy.decode_rule() == (SCORE_UPDATES.index(policy.score_update), FIRST_SCORES.index(policy.first_score))
    for other_name, other_cls in POLICIES.items():
        other = other_cls()
        alike = (name in ADDING and other_name in ADDING) or name == other_name
        assert policy.decodes_like(other) is alike, other_name
        assert other.decodes_like(policy) is alike
        assert (policy.decode_rule() == other.decode_rule()) is alike
