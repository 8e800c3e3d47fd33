"""Per-request sparsity (`custom_params` {"kvsparse": ...}): parsing, the HTTP-side checks, and
requests with different settings in one batch of the sparse state, without SGLang."""

import json
import re
from dataclasses import dataclass

import pytest
import torch

from sglang_kvsparse.config import SparsityConfig, SparsityConfigError, parse_config
from sglang_kvsparse.config.request_sparsity import (
    SERVER_SETTING,
    RequestSparsity,
    check_request,
    one_setting_too_many,
    parse_request,
)
from sglang_kvsparse.forward.decode_graph import DecodeBuffers
from sglang_kvsparse.forward.eviction import evict_planned
from sglang_kvsparse.forward.planning import plan_decode, plan_extend
from sglang_kvsparse.forward.sparse_attention import sparse_decode, sparse_extend
from sglang_kvsparse.policies import POLICIES, SnapKVPolicy, SpanPolicy
from sglang_kvsparse.server.stats import collect
from sglang_kvsparse.state.admission import request_rows_to_hold

from .heap import H_KV, D, grow, make_state

G = 2  # query heads per KV head
RESOLVED = SparsityConfig(
    full_layers=(0,), budget=64, sink=4, window=16, max_request_budget=512, request_policies=tuple(POLICIES)
).resolve(4, 4096)


def test_a_request_without_a_setting_keeps_the_servers():
    for params in (None, {}, {"other": 1}, {"kvsparse": None}):
        assert parse_request(params, RESOLVED) == SERVER_SETTING
    assert SERVER_SETTING.label == "server" and SERVER_SETTING.own_budget(RESOLVED) == 0


def test_a_request_asks_for_its_own_budget_or_for_no_sparsity():
    own = parse_request({"kvsparse": {"budget": 20}}, RESOLVED)
    assert (own.label, own.own_budget(RESOLVED)) == ("budget 20", 20)
    off = check_request({"kvsparse": {"enabled": False}}, 400, 112, RESOLVED)
    assert (off.label, off.own_budget(RESOLVED)) == ("off", 512)  # every token of a 512-token request
    assert parse_request({"kvsparse": {"enabled": True}}, RESOLVED) == SERVER_SETTING
    both = parse_request({"kvsparse": {"budget": 30, "policy": {"name": "span", "long_follow": 32}}}, RESOLVED)
    assert both == RequestSparsity(budget=30, policy=SpanPolicy(long_follow=32))
    knobs = "long_follow 32, sentence 0.5"
    assert both.label == f"budget 30, policy span ({knobs})"
    assert parse_request({"kvsparse": {"policy": "h2o"}}, RESOLVED).label == "policy h2o"


@pytest.mark.parametrize(
    "value, message",
    [
        (256, 'custom_params.kvsparse: expected an object such as {"budget": 256} (or a JSON string of one), got 256'),
        ("budget 64", "custom_params.kvsparse: expected an object such as"),
        ('{"budget": 8}', "custom_params.kvsparse.budget: 8 is smaller than the server's sink + window"),
        ({"policy.long_follow": 8}, 'custom_params.kvsparse: "policy.<knob>" keys need "policy" given as a name'),
        ({"policy": "span", "policy.nope": 8}, "custom_params.kvsparse.policy.nope: unknown knob of policy 'span'"),
        ({"budgte": 8}, "custom_params.kvsparse: unknown key 'budgte' (known: budget, policy, enabled)"),
        ({"enabled": "no"}, "custom_params.kvsparse.enabled: expected true or false, got 'no'"),
        ({"budget": "64"}, "custom_params.kvsparse.budget: expected an integer, got '64'"),
        ({"budget": True}, "custom_params.kvsparse.budget: expected an integer, got True"),
        ({"budget": 19}, "custom_params.kvsparse.budget: 19 is smaller than the server's sink + window (4 + 16)"),
        ({"budget": 513}, "custom_params.kvsparse.budget: 513 is above this server's max_request_budget (512;"),
        ({"budget": 64, "enabled": False}, "custom_params.kvsparse: enabled: false keeps every token; give it without"),
        (
            {"policy": "h2o", "enabled": False},
            "custom_params.kvsparse: enabled: false keeps every token; give it without",
        ),
        (
            {"policy": "lru"},
            "custom_params.kvsparse.policy: unknown policy 'lru' (known: h2o, keynorm, random, snapkv,",
        ),
        (
            {"policy": {"name": "span", "long_follow": -1}},
            "custom_params.kvsparse.policy.long_follow: expected an integer from 0 to 256",
        ),
        (
            {"policy": {"long_follow": 8}},
            "custom_params.kvsparse.policy: expected a policy name or an object with a 'name'",
        ),
        (
            {"policy": {"name": "span", "reach": 16}},
            "custom_params.kvsparse.policy.reach: unknown knob of policy 'span'",
        ),
    ],
)
def test_a_bad_setting_is_refused_naming_the_field(value, message):
    with pytest.raises(ValueError) as error:
        check_request({"kvsparse": value}, 100, 10, RESOLVED)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize(
    "value",
    [
        {"budget": 30, "policy": "span", "policy.long_follow": 32},
        '{"budget": 30, "policy": {"name": "span", "long_follow": 32}}',
        {"budget": 30, "policy": {"name": "span", "long_follow": 32}},
    ],
    ids=["flat", "json-string", "nested"],
)
def test_each_form_of_a_setting_reads_the_same_and_goes_on_in_sglangs_type(value):
    """The flat form and a JSON string are within SGLang's `custom_params` type; the nested one is
    read too. Each is written back flat (`to_params`: scalars only), which reads back the same."""
    setting = parse_request({"kvsparse": value}, RESOLVED)
    assert setting == RequestSparsity(budget=30, policy=SpanPolicy(long_follow=32))
    flat = setting.to_params()
    assert flat == {"budget": 30, "policy": "span", "policy.long_follow": 32, "policy.sentence": 0.5}
    assert all(isinstance(item, (bool, int, float, str)) for item in flat.values())
    assert parse_request({"kvsparse": flat}, RESOLVED) == setting
    for other in (SERVER_SETTING, RequestSparsity(enabled=False), RequestSparsity(policy=POLICIES["h2o"]())):
        assert parse_request({"kvsparse": other.to_params()}, RESOLVED) == other


def test_a_response_reports_the_setting_applied():
    assert SERVER_SETTING.applied(RESOLVED) == {
        "setting": "server",
        "budget": 64,
        "policy": "snapkv (pool_kind max, pool_kernel 15)",
    }
    own = RequestSparsity(budget=30, policy=POLICIES["h2o"]())
    assert own.applied(RESOLVED) == {"setting": "budget 30, policy h2o", "budget": 30, "policy": "h2o"}
    assert RequestSparsity(enabled=False).applied(RESOLVED) == {"setting": "off", "budget": None, "policy": None}


def test_the_server_chooses_which_policies_a_request_may_pick_and_whether_it_may_ask_at_all():
    """By default every policy but h2o; `--kvsparse-request-policies none` none; and
    `--kvsparse-request-settings off` refuses any setting, naming the option that allows it."""
    default = parse_config(full_layers="0", budget=64).resolve(4, 4096)
    assert parse_request({"kvsparse": {"policy": "tova"}}, default).policy.name == "tova"
    with pytest.raises(ValueError, match=r"'h2o' is not one a request may choose on this server \(allowed: keynorm"):
        parse_request({"kvsparse": {"policy": "h2o"}}, default)
    none = parse_config(full_layers="0", budget=64, request_policies="none").resolve(4, 4096)
    with pytest.raises(ValueError, match=r"\(allowed: none; --kvsparse-request-policies\)"):
        parse_request({"kvsparse": {"policy": "span"}}, none)
    assert parse_request({"kvsparse": {"budget": 40}}, none).budget == 40
    off = parse_config(full_layers="0", budget=64, request_settings="off").resolve(4, 4096)
    with pytest.raises(ValueError, match=r"settings are off on this server \(--kvsparse-request-settings off\)"):
        parse_request({"kvsparse": {"budget": 40}}, off)
    assert parse_request({"other": 1}, off) == SERVER_SETTING
    chosen = parse_config(full_layers="0", budget=64, request_policies="h2o, tova")
    assert chosen.request_policies == ("h2o", "tova")
    assert parse_config(json.dumps(chosen.to_dict())) == chosen
    for flags, message in (
        ({"request_policies": "span,lru"}, "--kvsparse-request-policies: unknown policy 'lru'"),
        ({"request_policies": "span,span"}, "--kvsparse-request-policies: policy 'span' is listed twice"),
        ({"request_settings": "maybe"}, "--kvsparse-request-settings: expected on or off, got 'maybe'"),
    ):
        with pytest.raises(SparsityConfigError, match=re.escape(message)):
            parse_config(full_layers="0", budget=64, **flags)
    with pytest.raises(SparsityConfigError, match="max_distinct_settings: must be >= 1, got 0"):
        parse_config('{"max_distinct_settings": 0}')


def test_sparsity_off_needs_the_whole_request_within_the_servers_largest_budget():
    with pytest.raises(ValueError, match=r"enabled: false keeps at most 512 tokens .* may reach 513 \(prompt 500"):
        check_request({"kvsparse": {"enabled": False}}, 500, 13, RESOLVED)
    with pytest.raises(ValueError, match="enabled: false needs max_new_tokens"):
        check_request({"kvsparse": {"enabled": False}}, 500, None, RESOLVED)
    assert check_request({"kvsparse": {"enabled": False}}, 500, 12, RESOLVED).label == "off"


def test_max_request_budget_is_validated_and_round_trips():
    config = parse_config(full_layers="0", budget=64, max_request_budget="300")
    assert config.max_request_budget == 300 and config.resolve(4, 200).request_cap == 200  # within the context
    assert parse_config(json_or_path=json.dumps(config.to_dict())) == config
    assert parse_config(full_layers="0", budget=64).resolve(4, 4096).request_cap == 64  # default: the largest budget
    with pytest.raises(SparsityConfigError, match="--kvsparse-max-request-budget: 32 is below the largest sparse"):
        parse_config(full_layers="0", budget=64, max_request_budget=32).resolve(4, 4096)
    with pytest.raises(SparsityConfigError, match="--kvsparse-max-request-budget: expected an integer"):
        parse_config(max_request_budget="lots")


def forward_prefill(state, req_indices, lengths):
    plan = plan_extend(state, req_indices, [0] * len(req_indices), lengths)
    total = sum(lengths)
    q, k, v = torch.randn(total, H_KV * G, D), torch.randn(total, H_KV, D), torch.randn(total, H_KV, D)
    for place in state.layout.layer_places.values():
        sparse_extend(q, k, v, 0.3, plan, plan.column(place), state.lanes[place.lane], state.policy)
    state.finish_forward()
    return plan


def forward_decode(state, req_indices, positions):
    plan = plan_decode(state, req_indices)
    evict_planned(plan, state.layout, state.lanes, state.policy)
    n = len(req_indices)
    q, k, v = torch.randn(n, H_KV * G, D), torch.randn(n, H_KV, D), torch.randn(n, H_KV, D)
    for place in state.layout.layer_places.values():
        sparse_decode(q, k, v, 0.3, plan, plan.column(place), state.lanes[place.lane], state.policy, positions)
    state.finish_forward()
    return plan


def test_requests_with_different_settings_in_one_batch_each_keep_their_own():
    """Server budget 8, a request's own 12, and one with sparsity off, prefilled and decoded
    together: each keeps, compresses, evicts and is charged at its own budget, and every row
    comes back when they finish."""
    torch.manual_seed(0)
    state, heap = make_state(context=64, budget=8, window=2, evict_page=16, rows=512, max_request_budget=40)
    group = state.groups[0]
    settings = [SERVER_SETTING, RequestSparsity(budget=12), RequestSparsity(enabled=False)]
    req_indices, prompt = [1, 2, 3], 20
    state.expect(req_indices, [40, 40, 30], [prompt] * 3, settings)
    # Charged before any row is taken: entries up to budget + evict_page, and scores (8 a row) if it evicts.
    charges = [request_rows_to_hold(state, req_idx, final) for req_idx, final in zip(req_indices, [40, 40, 30])]
    assert charges == [3 * (24 + 3), 3 * (28 + 4), 3 * 30]
    grow(state, req_indices, [prompt] * 3)
    assert group.table.counts[req_indices].tolist() == [8, 12, 20]
    assert [state.rows_held(req_idx) for req_idx in req_indices] == [3 * (8 + 3), 3 * (12 + 4), 3 * 20]
    assert state.requests.own_settings() == {(12, None), (40, None)}  # off keeps the largest request budget
    plan = forward_prefill(state, req_indices, [prompt] * 3)
    column = plan.column(state.layout.layer_places[1])
    assert column.compress and column.budgets.tolist() == [8, 12, 40]

    lengths = {req_idx: prompt for req_idx in req_indices}
    for step in range(17):
        decoding = [req_idx for req_idx in req_indices if lengths[req_idx] < (30 if req_idx == 3 else 40)]
        grow(state, decoding, [lengths[req_idx] + 1 for req_idx in decoding])
        plan = forward_decode(state, decoding, torch.tensor([lengths[req_idx] for req_idx in decoding]))
        evictions = plan.evictions
        if step < 16:  # rows 1 and 2 fill up to 24 and 28 entries, row 3 holds all it has
            assert not evictions
        else:  # both evict in the same step, each back to its own budget
            assert sorted((e.budget, e.slots.shape[2]) for e in evictions) == [(8, 24), (12, 28)]
        for req_idx in decoding:
            lengths[req_idx] += 1
        if lengths[3] == 30 and bool(state.requests.running()[3]):
            assert group.table.count(3) == 30  # off: every token, never a score row
            assert state.rows_held(3) == 3 * 30
            state.free(3)
    assert group.table.counts[[1, 2]].tolist() == [9, 13]
    state.expect([2], [40], [prompt], [settings[1]])  # as SGLang does for a chunked prompt's next chunk
    assert collect(state, heap.free_rows()).requests_by_setting == {"server": 1, "budget 12": 1, "off": 1}
    state.free(1)
    state.free(2)
    state.finish_forward()
    assert heap.free_rows() == 512


def test_a_request_with_one_own_setting_too_many_waits():
    """With `max_distinct_settings` 2 and two own settings running, a third waits; one of the two
    again, or the server's, does not (the server's is never counted)."""
    resolved = parse_config('{"max_distinct_settings": 2, "request_policies": ["tova"]}', full_layers="0", budget=64)
    resolved = resolved.resolve(4, 4096)
    first, second, third = (parse_request({"kvsparse": {"budget": n}}, resolved) for n in (40, 48, 56))
    tova = parse_request({"kvsparse": {"budget": 40, "policy": "tova"}}, resolved)
    assert not one_setting_too_many(first, set(), resolved)
    running = {first.grouping(resolved), second.grouping(resolved)}
    assert one_setting_too_many(third, running, resolved) and one_setting_too_many(tova, running, resolved)
    assert not one_setting_too_many(first, running, resolved)
    assert not one_setting_too_many(SERVER_SETTING, running, resolved)


@dataclass(frozen=True)
class LowestFirst(SnapKVPolicy):
    """SnapKV whose decode evictions keep the lowest-scored entries, so that an eviction ranked by
    another policy's rule shows. (`span` would too, but its spread scores tie, and which of equal
    scores `select_kept` keeps depends on the batch's shape.)"""

    name = "lowest-first"

    def eviction_scores(self, scores: torch.Tensor) -> torch.Tensor:
        return -scores


def run_requests(state, req_indices, settings, prompts, steps):
    """Prefill `prompts` ([L, ...] q/k/v per request) as one batch, then decode them `steps` times
    together (inputs of step t: row t of each request's `steps` decode inputs)."""
    lengths = [prompt[0].shape[0] for prompt in prompts]
    state.expect(req_indices, [n + len(steps[0][0]) for n in lengths], lengths, settings)
    grow(state, req_indices, lengths)
    plan = plan_extend(state, req_indices, [0] * len(req_indices), lengths)
    q, k, v = (torch.cat([prompt[i] for prompt in prompts]) for i in range(3))
    for place in state.layout.layer_places.values():
        sparse_extend(q, k, v, 0.3, plan, plan.column(place), state.lanes[place.lane], state.policy)
    state.finish_forward()
    for t in range(len(steps[0][0])):
        grow(state, req_indices, [n + t + 1 for n in lengths])
        plan = plan_decode(state, req_indices)
        evict_planned(plan, state.layout, state.lanes, state.policy)
        q, k, v = (torch.stack([step[i][t] for step in steps]) for i in range(3))
        positions = torch.tensor([n + t for n in lengths])
        for place in state.layout.layer_places.values():
            sparse_decode(q, k, v, 0.3, plan, plan.column(place), state.lanes[place.lane], state.policy, positions)
        state.finish_forward()


def kept(state, req_idx):
    """Per sparse layer: the K and the scores of the req_idx's entries, in position order."""
    group = state.groups[0]
    n = group.table.count(req_idx)
    held = []
    for place in state.layout.layer_places.values():
        lane = state.lanes[place.lane]
        entries = group.table.entries(req_idx)[:, place.column]
        scores = group.score_slots(torch.full((n,), req_idx), torch.arange(n))[:, place.column]
        held.append((lane.k[entries].clone(), lane.scores[scores].clone()))
    return held


@pytest.mark.parametrize("server_policy", ["snapkv", "tova"])
def test_a_request_with_its_own_policy_keeps_what_a_server_of_that_policy_keeps(server_policy):
    """Four requests, the server's policy and three of their own (score updates that differ: TOVA
    replaces, StreamingLLM, KeyNorm and random leave, SnapKV and H2O add; first scores that differ:
    zero, a position, a key norm, a position's hash; `LowestFirst` ranks an eviction its own way),
    prefilled past their budget and decoded past an eviction in one batch: each keeps the K and
    the scores it keeps alone on a server whose policy is its own."""
    torch.manual_seed(3)
    other = POLICIES["streamingllm"]() if server_policy == "snapkv" else POLICIES["h2o"]()
    fourth = POLICIES["random"]() if server_policy == "snapkv" else POLICIES["keynorm"]()
    own = [None, other, LowestFirst(pool_kernel=1), fourth]
    server = SnapKVPolicy(pool_kernel=1) if server_policy == "snapkv" else POLICIES["tova"]()
    lengths = (20, 26, 22, 24)
    prompts = [(torch.randn(n, H_KV * G, D), torch.randn(n, H_KV, D), torch.randn(n, H_KV, D)) for n in lengths]
    steps = [(torch.randn(20, H_KV * G, D), torch.randn(20, H_KV, D), torch.randn(20, H_KV, D)) for _ in prompts]
    options = dict(context=64, budget=8, window=2, evict_page=16, rows=512)
    mixed, _ = make_state(policy=server, **options)
    settings = [RequestSparsity(policy=policy) for policy in own]
    requests = [1, 2, 3, 4]
    run_requests(mixed, requests, settings, prompts, steps)
    assert sum(collect(mixed, 0).requests_by_setting.values()) == 4
    for req_idx, policy, prompt, step in zip(requests, own, prompts, steps):
        alone, _ = make_state(policy=policy or server, **options)
        run_requests(alone, [1], [SERVER_SETTING], [prompt], [step])
        assert mixed.groups[0].table.count(req_idx) == alone.groups[0].table.count(1) == 8 + 20 - 16  # evicted once
        for (k_mixed, s_mixed), (k_alone, s_alone) in zip(kept(mixed, req_idx), kept(alone, 1)):
            torch.testing.assert_close(k_mixed, k_alone, rtol=0, atol=0)
            torch.testing.assert_close(s_mixed, s_alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("own", ["h2o", "tova", "keynorm"])
def test_a_captured_decode_step_takes_a_request_of_any_policy(own):
    """H2O beside the server's SnapKV decodes alike (both add each step's attention, no first score
    for a new key): the plan has no row kinds. TOVA replaces scores and KeyNorm leaves them and
    scores a new key by its norm: the plan gives each row its rule, which the buffers a captured
    step reads take; rows past the batch decode by the server's rule."""
    state, _ = make_state(context=64, budget=8, window=2, rows=512)
    policy = POLICIES[own]()
    state.expect([1, 2], [30, 30], [10, 10], [SERVER_SETTING, RequestSparsity(policy=policy)])
    grow(state, [1, 2], [10, 10])
    plan_extend(state, [1, 2], [0, 0], [10, 10])
    grow(state, [1, 2], [11, 11])
    plan = plan_decode(state, [1, 2])
    server = list(state.policy.decode_rule())
    mine = list(policy.decode_rule())
    if own == "h2o":
        assert plan.row_kinds is None and mine == server
    else:
        assert plan.row_kinds.tolist() == [server, mine]
    buffers = DecodeBuffers(state, 4, "cpu")
    buffers.fill(plan)
    assert buffers.row_kinds.tolist() == [server, mine, server, server]
    assert buffers.plan(2).row_kinds.tolist() == [server, mine]
