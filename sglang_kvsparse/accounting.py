"""KV-cache byte accounting across full and sparse layers.

Units: `bytes_per_token` is the K+V bytes of one token in one layer (kv_bytes_per_token); a
"layer-token" is one token's K+V in one layer. All layers of the supported models have the same
KV shape, so bytes are layer-tokens times bytes_per_token.

What a request holds (the bound admission must use so nothing is over-committed):
  full layer   every token of the sequence, rounded up to pages;
  sparse layer min(seq_len, budget + evict_page) entries (ResolvedSparsity.max_entries: at most
               one eviction page above the budget), rounded up to pages.
This is the steady state after prefill compaction; where the uncompressed prompt of a sparse
layer lives during prefill is the integration's business and is not counted here.

Padding pages: each pool (SGLang's full pool and every sparse pool) reserves one padding page
per layer, as stock SGLang does for every layer, so counting usable tokens on both sides compares
equal bytes.

This module must not import SGLang.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sglang_kvsparse.config import ResolvedSparsity
from sglang_kvsparse.index_map import round_up

#: Sequence lengths shown in the startup footprint table (those above the context length drop).
FOOTPRINT_LENGTHS: tuple[int, ...] = (1024, 4096, 16384, 32768)


def kv_bytes_per_token(num_kv_heads: int, head_dim: int, dtype_bytes: int) -> int:
    """K and V bytes of one token in one layer: 2 * num_kv_heads * head_dim * dtype_bytes."""
    return 2 * num_kv_heads * head_dim * dtype_bytes


def held_tokens(resolved: ResolvedSparsity, layer: int, seq_len: int, page_size: int = 1) -> int:
    """Most slots a request of `seq_len` tokens holds in `layer` (see module doc)."""
    if resolved.is_sparse(layer):
        seq_len = min(seq_len, resolved.max_entries(layer))
    return round_up(seq_len, page_size)


def request_kv_bytes(seq_len: int, resolved: ResolvedSparsity, bytes_per_token: int, page_size: int = 1) -> int:
    """Bytes a request of `seq_len` tokens holds across all layers, at most."""
    layer_tokens = sum(held_tokens(resolved, layer, seq_len, page_size) for layer in range(resolved.num_layers))
    return layer_tokens * bytes_per_token


def dense_kv_bytes(seq_len: int, num_layers: int, bytes_per_token: int, page_size: int = 1) -> int:
    """Bytes stock SGLang holds for a request of `seq_len` tokens: every token in every layer."""
    return round_up(seq_len, page_size) * num_layers * bytes_per_token


def kv_bytes_in_use(
    full_tokens_in_use: int,
    sparse_slots_in_use: Mapping[int, int],
    resolved: ResolvedSparsity,
    bytes_per_token: int,
    sparse_slot_bytes: int | None = None,
) -> int:
    """Bytes in use now: full-pool tokens (one slot serves every full layer) and sparse slots
    (each costing sparse_slot_bytes, default bytes_per_token)."""
    slot_bytes = bytes_per_token if sparse_slot_bytes is None else sparse_slot_bytes
    full = full_tokens_in_use * len(resolved.full_layers) * bytes_per_token
    return full + sum(sparse_slots_in_use.values()) * slot_bytes


@dataclass(frozen=True)
class PoolSplit:
    """How split_pool divided a KV byte budget.

    full_tokens: tokens of the full-layer pool (each full layer stores that many);
    sparse_slots: usable slots per sparse layer, each costing sparse_slot_bytes; dense_tokens: what stock SGLang's pool would
    hold with the same bytes; requests_at_target / dense_requests_at_target: how many requests
    of target_len tokens fit here and in stock SGLang.
    """

    total_kv_bytes: int
    bytes_per_token: int
    sparse_slot_bytes: int
    target_len: int
    num_full_layers: int
    full_tokens: int
    sparse_slots: dict[int, int]
    dense_tokens: int
    requests_at_target: int
    dense_requests_at_target: int

    @property
    def used_bytes(self) -> int:
        """Bytes the split's pools occupy (<= total_kv_bytes; the rest is page rounding)."""
        full = self.full_tokens * self.num_full_layers * self.bytes_per_token
        return full + sum(self.sparse_slots.values()) * self.sparse_slot_bytes

    def describe(self) -> str:
        """One line for the startup log."""
        sparse = self.sparse_slots.values()
        slots = f"{min(sparse)}..{max(sparse)}" if sparse else "0"
        return (
            f"KV {_human_bytes(self.total_kv_bytes)}: full pool {self.full_tokens} tokens x "
            f"{self.num_full_layers} layers, sparse pools {slots} slots x {len(self.sparse_slots)} layers; "
            f"{self.requests_at_target} requests of {self.target_len} tokens fit "
            f"(stock SGLang: {self.dense_tokens} tokens, {self.dense_requests_at_target} requests)"
        )


def split_pool(
    total_kv_bytes: int,
    resolved: ResolvedSparsity,
    bytes_per_token: int,
    *,
    page_size: int = 1,
    target_len: int | None = None,
    sparse_slot_bytes: int | None = None,
) -> PoolSplit:
    """Divide the KV bytes stock SGLang would use between the full pool and the sparse pools.

    total_kv_bytes: usable KV bytes of stock SGLang, e.g. max_total_tokens * num_layers *
    bytes_per_token. sparse_slot_bytes: what one sparse slot costs (K+V plus its fp32 score per
    KV head; default bytes_per_token), so the comparison with stock is at equal bytes. Rule: each
    pool gets bytes in proportion to what one request of `target_len` tokens holds in it
    (held_tokens), so with every request at target_len all pools fill together and the number of
    concurrent requests is maximal. Shorter requests leave full pool room unused (the sparse
    pools bind); longer ones leave sparse room unused. Erring long costs less than erring short,
    hence the default: config.pool_target_len, else the context length. Pool sizes are rounded
    down to whole pages.
    """
    if bytes_per_token < 1 or total_kv_bytes < 0:
        raise ValueError(f"need bytes_per_token >= 1 and total_kv_bytes >= 0, got {bytes_per_token}, {total_kv_bytes}")
    if target_len is not None and target_len < 1:
        raise ValueError(f"target_len must be >= 1, got {target_len}")
    slot_bytes = bytes_per_token if sparse_slot_bytes is None else sparse_slot_bytes
    if slot_bytes < bytes_per_token:
        raise ValueError(f"sparse_slot_bytes ({slot_bytes}) is below bytes_per_token ({bytes_per_token})")
    target = target_len or resolved.config.pool_target_len or resolved.context_len
    target = min(target, resolved.context_len)
    full_need = round_up(target, page_size)
    sparse_need = {layer: held_tokens(resolved, layer, target, page_size) for layer in resolved.sparse_layers}
    num_full = len(resolved.full_layers)
    request_bytes = full_need * num_full * bytes_per_token + sum(sparse_need.values()) * slot_bytes

    def share(need: int) -> int:  # a pool's bytes are need * its unit bytes / request_bytes of the total
        return total_kv_bytes * need // request_bytes // page_size * page_size

    full_tokens = share(full_need) if num_full else 0
    sparse_slots = {layer: share(need) for layer, need in sparse_need.items()}
    fits = [full_tokens // full_need] if num_full else []
    fits += [sparse_slots[layer] // need for layer, need in sparse_need.items()]
    dense_tokens = total_kv_bytes // bytes_per_token // resolved.num_layers // page_size * page_size
    return PoolSplit(
        total_kv_bytes=total_kv_bytes,
        bytes_per_token=bytes_per_token,
        sparse_slot_bytes=slot_bytes,
        target_len=target,
        num_full_layers=num_full,
        full_tokens=full_tokens,
        sparse_slots=sparse_slots,
        dense_tokens=dense_tokens,
        requests_at_target=min(fits),
        dense_requests_at_target=dense_tokens // full_need,
    )


@dataclass(frozen=True)
class FootprintRow:
    """Bytes one request of seq_len tokens holds, with sparsity and in stock SGLang."""

    seq_len: int
    kv_bytes: int
    dense_bytes: int

    @property
    def ratio(self) -> float:
        return self.kv_bytes / self.dense_bytes


def footprint_table(
    resolved: ResolvedSparsity,
    bytes_per_token: int,
    lengths: Sequence[int] = FOOTPRINT_LENGTHS,
    page_size: int = 1,
) -> list[FootprintRow]:
    """Per-request bytes at each length up to the context length (the context length itself is
    added when some lengths were beyond it)."""
    shown = [n for n in lengths if n <= resolved.context_len]
    if len(shown) < len(lengths) and resolved.context_len not in shown:
        shown.append(resolved.context_len)
    return [
        FootprintRow(
            n,
            request_kv_bytes(n, resolved, bytes_per_token, page_size),
            dense_kv_bytes(n, resolved.num_layers, bytes_per_token, page_size),
        )
        for n in shown
    ]


def format_footprint_table(rows: Sequence[FootprintRow]) -> str:
    """Startup-log text: one line per length, e.g. '4096 tokens: 55.3 MiB vs 180.0 MiB dense (30.7%)'."""
    return "\n".join(
        f"{row.seq_len} tokens: {_human_bytes(row.kv_bytes)} vs {_human_bytes(row.dense_bytes)} dense "
        f"({row.ratio:.1%})"
        for row in rows
    )


def _human_bytes(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value = n / 1024
    for unit in ("KiB", "MiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"
