"""Past one device: each CPU rank's cores, and the stats of several ranks and
replicas combined (counts that must agree over TP ranks, bytes that add up, replicas summed)."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from sglang_kvsparse.server.parallelism import cpu_thread_binding
from sglang_kvsparse.server.stats import (
    REPLICA_COUNTS,
    GroupStats,
    HeapStats,
    LayerStats,
    SparseStats,
    combine_replicas,
    combine_tp_ranks,
)


@pytest.mark.parametrize(
    ("ranks", "cores", "binding"),
    [(2, [0, 1], "0|1"), (2, [3, 0, 1, 2], "0,1|2,3"), (2, [0, 1, 2], "0|1"), (1, [0, 1], "0,1")],
)
def test_each_rank_gets_an_equal_disjoint_share_of_the_cores(ranks, cores, binding):
    assert cpu_thread_binding(ranks, cores) == binding


def test_more_ranks_than_cores_is_refused():
    with pytest.raises(ValueError, match="2 ranks need at least 2 CPU cores"):
        cpu_thread_binding(2, [0])


def _rank(requests: int, free: int, kv_bytes: int) -> dict:
    """A rank's wire-format stats, reduced to the fields combining reads or copies."""
    return {
        "enabled": True,
        "config": {"budget": 256},
        "layout": "2 lanes",
        "kv_bytes_in_use": kv_bytes,
        "kv_bytes_if_dense": 2 * kv_bytes,
        **{name: requests for name in ("prefix_hits", "prefix_tokens_reused", "chunks_stored")},
        **{name: requests for name in ("store_entries_adopted", "requests_running", "requests_running_peak")},
        "forward_plans": 10,
        "evictions": requests,
        **{name: 0 for name in ("host_syncs", "decode_refills", "release_waits")},
        "setting_waits": 0,
        "guide_waits": requests,
        "heap_refills": requests,
        "prefill_sentence_ends": 4 * requests,
        "requests_by_setting": {"server": requests, f"budget {requests}": 1},
        "heap": {
            "rows_total": 1000,
            "lanes": 2,
            "free": free,
            **{name: 1 for name in ("full_running", "full_cached", "sparse", "prefix_store", "evicting", "releasing")},
            "groups": [{"budget": 256, "max_entries": 272, "columns": 3, "layers": [2, 3], "rows": 5, "score_rows": 1}],
        },
        "layers": [
            {"layer": 0, "kind": "full", "budget": None, "slots_in_use": 7, "slots_total": 1000},
            {"layer": 2, "kind": "sparse", "budget": 256, "slots_in_use": 4, "slots_total": 1000},
        ],
    }


def test_tp_ranks_in_step_keep_their_counts_and_add_their_bytes():
    ranks = [_rank(3, 900, 100), _rank(3, 900, 60)]
    replica = combine_tp_ranks(ranks)
    assert replica["in_step"] and replica["differences"] == []
    assert replica["tp_size"] == 2 and replica["tp_ranks"] == ranks
    assert replica["kv_bytes_in_use"] == 160 and replica["kv_bytes_if_dense"] == 320
    assert replica["requests_running"] == 3 and replica["heap"]["free"] == 900


def test_tp_ranks_whose_counts_differ_are_reported():
    replica = combine_tp_ranks([_rank(3, 900, 100), _rank(3, 899, 100)])
    assert not replica["in_step"]
    assert replica["differences"] == ["tp rank 1: heap.free: 900 != 899"]


def test_replicas_add_up_every_count_and_keep_their_own_stats():
    first, second = combine_tp_ranks([_rank(3, 900, 100)]), combine_tp_ranks([_rank(2, 700, 40)])
    total = combine_replicas([copy.deepcopy(first), copy.deepcopy(second)])
    assert total["dp_size"] == 2 and total["in_step"] and total["replicas"] == [first, second]
    assert total["requests_running"] == 5 and total["evictions"] == 5 and total["forward_plans"] == 20
    assert total["guide_waits"] == 5
    assert total["kv_bytes_in_use"] == 140
    assert total["requests_by_setting"] == {"server": 5, "budget 3": 1, "budget 2": 1}
    assert total["heap"]["rows_total"] == 2000 and total["heap"]["free"] == 1600 and total["heap"]["lanes"] == 2
    assert total["heap"]["groups"] == [
        {"budget": 256, "max_entries": 272, "columns": 3, "layers": [2, 3], "rows": 10, "score_rows": 2}
    ]
    assert [layer["slots_in_use"] for layer in total["layers"]] == [14, 8]
    assert [layer["budget"] for layer in total["layers"]] == [None, 256]
    assert "tp_ranks" not in total


def test_every_summed_field_is_an_int_of_the_wire_format():
    """Each path of `REPLICA_COUNTS` names an int field of the records `SparseStats` is made of."""
    records = {"heap": HeapStats, "groups": GroupStats, "layers": LayerStats}
    for path in REPLICA_COUNTS:
        record = SparseStats
        for key in path[:-1]:
            record = records[key]
        types = {field.name: field.type for field in dataclasses.fields(record)}
        assert types[path[-1]] == "int", path


def test_a_server_with_sparsity_off_reports_it_unchanged():
    assert combine_replicas([combine_tp_ranks([{"enabled": False}, {"enabled": False}])]) == {"enabled": False}
