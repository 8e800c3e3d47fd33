"""Scoring policies, one per module, kvpress-style; the configuration names one (`policy`)."""

from __future__ import annotations

from sglang_kvsparse.policies.base import PrefillScoringInputs, ScoringPolicy
from sglang_kvsparse.policies.h2o import H2OPolicy
from sglang_kvsparse.policies.keynorm import KeyNormPolicy
from sglang_kvsparse.policies.random_eviction import RandomPolicy
from sglang_kvsparse.policies.snapkv import SnapKVPolicy
from sglang_kvsparse.policies.span import SpanPolicy
from sglang_kvsparse.policies.streamingllm import StreamingLLMPolicy
from sglang_kvsparse.policies.tova import TOVAPolicy

#: Every policy by its configuration name: the one registry.
POLICIES: dict[str, type[ScoringPolicy]] = {
    cls.name: cls
    for cls in (
        SnapKVPolicy,
        SpanPolicy,
        H2OPolicy,
        TOVAPolicy,
        StreamingLLMPolicy,
        KeyNormPolicy,
        RandomPolicy,
    )
}

__all__ = [
    "POLICIES",
    "H2OPolicy",
    "KeyNormPolicy",
    "PrefillScoringInputs",
    "RandomPolicy",
    "ScoringPolicy",
    "SnapKVPolicy",
    "SpanPolicy",
    "StreamingLLMPolicy",
    "TOVAPolicy",
]
