"""The score a new key starts with, by kind: what a scoring policy declares (`first_score`), so
that a decode step can give every request's new key its policy's first score inside one kernel
launch (`write_entries`), whichever policy each request has, a captured CUDA graph included.

"zero": the attention-based policies (the key's own attention then scores it); "minus_key_norm":
minus the key's L2 norm per KV head; "position": the key's position in its sequence;
"position_hash": a fixed pseudo-random number per position and KV head. These torch functions are
the references; the write kernel computes the same in registers.
"""

from __future__ import annotations

from typing import Literal

import torch

FirstScore = Literal["zero", "minus_key_norm", "position", "position_hash"]
FIRST_SCORES: tuple[FirstScore, ...] = ("zero", "minus_key_norm", "position", "position_hash")

_MASK = 0xFFFFFFFF
#: The integer hash's multiplier (below 2**31, so every product of a masked value fits in int64).
HASH_MIX = 0x045D9F3B


def minus_key_norm(keys: torch.Tensor) -> torch.Tensor:
    """-||k|| per key and KV head, in float32: [..., H_kv, D] -> [..., H_kv]."""
    return -torch.linalg.vector_norm(keys.float(), dim=-1)


def position_hash(positions: torch.Tensor, heads: int) -> torch.Tensor:
    """[N, heads] float32 in [0, 1): a fixed pseudo-random number per sequence position and KV
    head (xor-shift 16 and multiply, twice, then xor-shift 16, of position x heads + head + 1,
    over 2**32). A hash, not a generator: the same key gets the same number in every run, batch
    and replayed graph, with no state."""
    head = torch.arange(heads, device=positions.device, dtype=torch.int64)
    x = (positions.to(torch.int64)[:, None] * heads + head[None, :] + 1) & _MASK
    for _ in range(2):
        x = (((x >> 16) ^ x) * HASH_MIX) & _MASK
    x = (x >> 16) ^ x
    return x.to(torch.float32) / float(1 << 32)


def first_scores(kind: FirstScore, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[N, H_kv] float32: the first scores of keys `k` [N, H_kv, D] (real values, not an FP8
    lane's stored ones) at sequence `positions` [N], all of one kind."""
    n, heads = k.shape[:2]
    if kind == "zero":
        return torch.zeros((n, heads), dtype=torch.float32, device=k.device)
    if kind == "minus_key_norm":
        return minus_key_norm(k)
    if kind == "position":
        return positions.to(torch.float32)[:, None].expand(n, heads).contiguous()
    if kind == "position_hash":
        return position_hash(positions, heads)
    raise ValueError(f"first score must be one of {', '.join(FIRST_SCORES)}; got {kind!r}")


def first_scores_by_row(kinds: torch.Tensor, k: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """As `first_scores`, each key its own kind: `kinds` [N] indices into `FIRST_SCORES`. Every
    kind is computed for every key and one picked per key: no value is read back."""
    every = torch.stack([first_scores(kind, k, positions) for kind in FIRST_SCORES])  # [kinds, N, H_kv]
    pick = kinds.to(torch.int64)[None, :, None].expand(1, *every.shape[1:])
    return every.gather(0, pick)[0]


def first_score_index(kind: str) -> int:
    """The kind's index in `FIRST_SCORES` (a kernel's constant); ValueError for an unknown one."""
    if kind not in FIRST_SCORES:
        raise ValueError(f"first score must be one of {', '.join(FIRST_SCORES)}; got {kind!r}")
    return FIRST_SCORES.index(kind)
