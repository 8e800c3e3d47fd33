"""The soak's seeded request mix (`bench/soak.py`): what each of its requests is, decided up front.

A production server sees every mechanism at once, so the mix draws each request's shape
independently: its endpoint (SGLang's `/generate`, OpenAI `/v1/completions` or
`/v1/chat/completions`), streaming, greedy or sampled with `n` > 1, logprobs, stop strings, and
what the client does to it (nothing, an abort during the prefill or the decode, a disconnect).
Prompt lengths run from one token to near the context length, with many placed on the edges the
sparse layers care about: the budget, the length at which a layer starts evicting, and the
eviction step's multiples, for the prompt alone and for prompt plus output. Some prompts come in
groups that share a prefix (radix-cache hits through the sparse layers), and some chat requests
are conversations whose later turns repeat the whole history.

Prompts are token ids cut from one long real text, so `/generate` and `/v1/completions` prompts
have exactly the drawn length. Pure: no server, no SGLang.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal

Endpoint = Literal["generate", "completions", "chat"]
Interrupt = Literal["abort-prefill", "abort-decode", "disconnect-decode", "disconnect-waiting"]

ENDPOINTS: tuple[Endpoint, ...] = ("generate", "completions", "chat")
INTERRUPTS: tuple[Interrupt, ...] = ("abort-prefill", "abort-decode", "disconnect-decode", "disconnect-waiting")
#: SGLang 0.5.23's `/abort_request` by rid does not reach the answers of an `n` > 1 request.
ABORTS = ("abort-prefill", "abort-decode")
STOP_STRINGS = ("\n\n", ". ", "?")


@dataclass(frozen=True)
class Edges:
    """The lengths a sparse server treats differently: `budget` entries are kept per layer, a layer
    evicts once it holds more than `max_entries`, and it evicts `step` entries at a time."""

    budget: int
    max_entries: int
    context_len: int

    @property
    def step(self) -> int:
        return max(1, self.max_entries - self.budget)

    def near(self, rng: random.Random) -> int:
        """A length within two tokens of an edge (the budget, the eviction start, a step multiple)."""
        anchors = [self.budget, self.max_entries, self.max_entries + self.step, rng.randint(1, 8) * self.step]
        return max(1, rng.choice(anchors) + rng.randint(-2, 2))


@dataclass(frozen=True)
class SoakRequest:
    """One request of the mix (a conversation's first turn for chat with `follow_ups`)."""

    index: int
    endpoint: Endpoint
    prompt_tokens: int  # exact for generate/completions; the chat template adds a few
    prompt_offset: int  # where the prompt starts in the text's token ids
    prefix_group: int | None  # requests of a group share their first `prefix_tokens`
    prefix_tokens: int
    max_new_tokens: int
    greedy: bool
    n: int
    logprobs: bool
    stop: tuple[str, ...]
    stream: bool
    interrupt: Interrupt | None
    interrupt_after: int  # chunks read (decode) or milliseconds waited (prefill, waiting)
    follow_ups: int  # chat turns sent after this one, each with the whole history

    @property
    def kind(self) -> str:
        """A short label for reports: endpoint, streaming and what the client does."""
        return f"{self.endpoint}{'-stream' if self.stream else ''}{'-' + self.interrupt if self.interrupt else ''}"


@dataclass(frozen=True)
class MixSettings:
    """How many requests and how long they may be."""

    requests: int
    max_prompt_tokens: int  # the longest prompt (near the context length on a full soak)
    text_tokens: int  # length of the token-id text prompts are cut from
    seed: int = 0
    prefix_groups: int = 6


def prompt_length(rng: random.Random, edges: Edges, longest: int) -> int:
    """Lengths from one token to `longest`: three in ten within the budget, three on an edge of
    `edges`, one in twelve in the last quarter up to `longest`."""
    band = rng.random()
    if band < 0.08:
        length = rng.randint(1, 8)
    elif band < 0.30:
        length = rng.randint(9, edges.budget)
    elif band < 0.60:
        length = edges.near(rng)
    elif band < 0.72:
        length = rng.randint(edges.budget, edges.budget * 2)
    elif band < 0.92:
        length = rng.randint(edges.budget * 2, max(edges.budget * 2, longest // 3))
    else:
        length = rng.randint(max(1, longest * 3 // 4), longest)
    return max(1, min(length, longest))


def output_length(rng: random.Random, edges: Edges, prompt: int) -> int:
    """Mostly short answers; a third end on an edge of prompt plus output."""
    if rng.random() < 0.33:
        total = edges.near(rng)
        if prompt < total <= prompt + 96:
            return total - prompt
    return rng.choice((1, 2, rng.randint(3, 24), rng.randint(24, 96)))


def draw_interrupt(rng: random.Random, stream: bool, prompt: int) -> tuple[Interrupt | None, int]:
    """One request in six is interrupted: aborts need a stream (its rid is sent first)."""
    if rng.random() >= 1 / 6:
        return None, 0
    if not stream:
        return "disconnect-waiting", rng.randint(50, 1500)
    kind = rng.choice(("abort-prefill", "abort-decode", "disconnect-decode") if prompt > 512 else INTERRUPTS[1:3])
    return kind, rng.randint(20, 400) if kind == "abort-prefill" else rng.randint(1, 40)


def build_mix(settings: MixSettings, edges: Edges) -> list[SoakRequest]:
    """`settings.requests` requests, the same for the same settings and edges."""
    if settings.max_prompt_tokens >= edges.context_len:
        raise ValueError(
            f"max_prompt_tokens {settings.max_prompt_tokens} must be below the context {edges.context_len}"
        )
    if settings.text_tokens < settings.max_prompt_tokens * 2:
        raise ValueError(f"the text has {settings.text_tokens} tokens; prompts need twice the longest")
    rng = random.Random(settings.seed)
    longest = settings.max_prompt_tokens
    group_prefix = [
        rng.randint(edges.budget // 2, max(edges.budget, longest // 4)) for _ in range(settings.prefix_groups)
    ]
    mix = []
    for index in range(settings.requests):
        endpoint = rng.choice(ENDPOINTS)
        group = rng.randrange(settings.prefix_groups) if rng.random() < 0.2 else None
        prompt = prompt_length(rng, edges, longest)
        if group is not None:
            prompt = max(prompt, group_prefix[group] + rng.randint(1, 64))
            prompt = min(prompt, longest)
        stream = rng.random() < 0.5
        interrupt, after = draw_interrupt(rng, stream, prompt)
        greedy = rng.random() < 0.6
        max_new = output_length(rng, edges, prompt)
        if interrupt in ("abort-decode", "disconnect-decode"):
            max_new = max(max_new, after + 64)
        max_new = max(1, min(max_new, edges.context_len - prompt - 1))
        follow_ups = rng.randint(1, 3) if endpoint == "chat" and interrupt is None and rng.random() < 0.25 else 0
        mix.append(
            SoakRequest(
                index=index,
                endpoint=endpoint,
                prompt_tokens=prompt,
                prompt_offset=0 if group is not None else rng.randrange(settings.text_tokens - prompt),
                prefix_group=group,
                prefix_tokens=group_prefix[group] if group is not None else 0,
                max_new_tokens=max_new,
                greedy=greedy,
                n=1 if greedy or interrupt in ABORTS or rng.random() < 0.6 else rng.randint(2, 3),
                logprobs=rng.random() < 0.25,
                stop=tuple(rng.sample(STOP_STRINGS, rng.randint(1, 2))) if rng.random() < 0.2 else (),
                stream=stream,
                interrupt=interrupt,
                interrupt_after=after,
                follow_ups=follow_ups,
            )
        )
    return mix


def prompt_ids(request: SoakRequest, text_ids: list[int], group_offsets: dict[int, int]) -> list[int]:
    """The request's prompt: a group's shared prefix then a part of its own, or a slice of the text."""
    if request.prefix_group is None:
        return text_ids[request.prompt_offset : request.prompt_offset + request.prompt_tokens]
    start = group_offsets[request.prefix_group]
    shared = text_ids[start : start + request.prefix_tokens]
    own_start = (start + request.prefix_tokens + 997 * (request.index + 1)) % (len(text_ids) - request.prompt_tokens)
    return (shared + text_ids[own_start : own_start + request.prompt_tokens])[: request.prompt_tokens]


def group_offsets(settings: MixSettings) -> dict[int, int]:
    """Where each prefix group's shared prompt starts in the text (seeded)."""
    rng = random.Random(settings.seed + 1)
    return {g: rng.randrange(settings.text_tokens - settings.max_prompt_tokens) for g in range(settings.prefix_groups)}
