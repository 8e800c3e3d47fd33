"""Scoring policies, one per module, chosen by name in the configuration (`policy`)."""

from __future__ import annotations

from sglang_kvsparse.config import SparsityConfig
from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy
from sglang_kvsparse.policies.keynorm import KeyNormPolicy
from sglang_kvsparse.policies.snapkv import SnapKVPolicy
from sglang_kvsparse.policies.streamingllm import StreamingLLMPolicy

POLICY_CLASSES: dict[str, type[ScoringPolicy]] = {
    cls.name: cls for cls in (SnapKVPolicy, StreamingLLMPolicy, KeyNormPolicy)
}


def build_policy(config: SparsityConfig) -> ScoringPolicy:
    """The configured policy with its settings (pooling applies to SnapKV only)."""
    if config.policy == SnapKVPolicy.name:
        return SnapKVPolicy(pool_kind=config.pool_kind, pool_kernel=config.pool_kernel)
    return POLICY_CLASSES[config.policy]()


__all__ = [
    "POLICY_CLASSES",
    "KeyNormPolicy",
    "PrefillScoringInputs",
    "ScoringPolicy",
    "SnapKVPolicy",
    "StreamingLLMPolicy",
    "build_policy",
]
