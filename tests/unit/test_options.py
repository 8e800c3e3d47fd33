"""What the launcher and engine add or refuse for a sparse server (no SGLang, no model)."""

import pytest

from sglang_kvsparse.config import PRESETS, SparsityConfig
from sglang_kvsparse.options import (
    CPU_SPARSE_MEM_FRACTION,
    GPU_SPARSE_OPTIONS,
    sparse_sglang_defaults,
    validate_for_model,
)
from sglang_kvsparse.serving_defaults import LaunchError, ModelShape

SHAPE = ModelShape(num_layers=30, context_len=8192, num_kv_heads=3, head_dim=64)
LOSSLESS = SparsityConfig(full_layers=(0, 1), budget=8192)


def test_every_preset_fits_the_model_and_bad_layers_are_refused_in_one_line():
    for config in (LOSSLESS, *PRESETS.values()):
        validate_for_model(config, SHAPE)
    with pytest.raises(LaunchError, match="layer 30 is outside the model"):
        validate_for_model(SparsityConfig(full_layers=(0, 30), budget=512), SHAPE)


def test_sparse_servers_keep_sglangs_chunking_get_no_overlap_and_a_memory_fraction_on_the_cpu():
    assert sparse_sglang_defaults(PRESETS["off"], {}, cpu=True) == {}
    no_overlap = {"disable_overlap_schedule": True}
    assert sparse_sglang_defaults(LOSSLESS, {}, cpu=True) == {
        "mem_fraction_static": CPU_SPARSE_MEM_FRACTION,
        **no_overlap,
    }
    given = {"mem_fraction_static": 0.5}
    assert sparse_sglang_defaults(LOSSLESS, given, cpu=True) == no_overlap
    assert sparse_sglang_defaults(LOSSLESS, {}, cpu=False) == {**no_overlap, **GPU_SPARSE_OPTIONS}
