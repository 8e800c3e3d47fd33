"""Pure helpers of the serving benchmark: reading the scheduler log and computing ratios.

The log lines are copied from a real SGLang 0.5.23 CPU run, so a format change in SGLang shows
up here rather than as a silently empty column in a benchmark report.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvsparse_testbed import server

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(relative: str) -> ModuleType:
    """Load a bench/ module by path: bench/ is a folder of scripts, not a package."""
    name = "bench_" + relative.replace("/", "_").removesuffix(".py")
    spec = importlib.util.spec_from_file_location(name, BENCH / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


report = _load("common/report.py")

LOG = """\
[2026-11-29 09:28:33] Prefill batch, #new-seq: 1, #new-token: 200, #cached-token: 0, token usage: 0.10, #running-req: 0, #queue-req: 0, #pending-token: 0, cpu graph: False, input throughput (token/s): 19.13
[2026-11-29 09:28:34] Prefill batch, #new-seq: 2, #new-token: 400, #cached-token: 0, token usage: 0.10, #running-req: 1, #queue-req: 0, #pending-token: 0, cpu graph: False, input throughput (token/s): 140.20
[2026-11-29 09:28:35] Decode batch, #running-req: 2, #token: 404, token usage: 0.10, cpu graph: False, gen throughput (token/s): 0.20, #queue-req: 0
"""


def test_peak_counts_new_sequences_of_a_prefill_batch() -> None:
    assert server.peak_running_requests(LOG) == 3


def test_peak_is_none_without_scheduler_lines() -> None:
    assert server.peak_running_requests("INFO: 127.0.0.1 - POST /generate 200\n") is None


RETRACTING_LOG = (
    LOG
    + """\
[2026-11-29 09:28:36] Decode batch, #running-req: 4, #token: 804, token usage: 1.00, cpu graph: False, gen throughput (token/s): 0.20, #queue-req: 0
[2026-11-29 09:28:37] KV cache pool is full. Retract requests. #retracted_reqs: 1, #new_tokens_gained: 250, #new_token_ratio: 0.7000 -> 0.9000
[2026-11-29 09:28:37] Decode batch, #running-req: 3, #token: 700, token usage: 0.90, cpu graph: False, gen throughput (token/s): 0.20, #queue-req: 1
"""
)


def test_mean_decoding_requests_averages_the_decode_lines_only() -> None:
    assert server.mean_decoding_requests(RETRACTING_LOG) == (2 + 4 + 3) / 3
    assert server.mean_decoding_requests("INFO: 127.0.0.1 - POST /generate 200\n") is None


def test_retracted_requests_sums_sglangs_warnings() -> None:
    assert server.retracted_requests(RETRACTING_LOG) == 1
    assert server.retracted_requests(LOG) == 0


def _system(name: str, tok_s: float, ttft: float | None) -> dict:
    run = {key: None for key, _ in report.METRICS}
    run.update(concurrency=1, output_tok_s=tok_s, ttft_median_ms=ttft)
    return {"name": name, "runs": [run]}


def test_ratio_is_project_over_stock_and_none_when_unmeasured() -> None:
    [row] = report.ratio_rows([_system("stock", 10.0, 100.0), _system("p", 15.0, None)], "stock")
    assert row["system"] == "p" and row["output_tok_s"] == 1.5
    assert row["ttft_median_ms"] is None and row["peak_running"] is None


def test_no_ratios_when_the_baseline_did_not_run() -> None:
    assert report.ratio_rows([_system("p", 15.0, 1.0)], "stock") == []


# What uvicorn printed when another process held SGLang's port; the server then hung.
_PORT_TAKEN_SERVER = """
import sys, time
print("ERROR:    [Errno 98] error while attempting to bind on address ('127.0.0.1', %s): "
      "address already in use" % sys.argv[sys.argv.index("--port") + 1], flush=True)
time.sleep(600)
"""


def test_a_taken_port_is_detected_and_retried_on_fresh_ports(tmp_path: Path) -> None:
    lines: list[str] = []
    proc = server.ServerProcess(
        name="fake",
        command=[sys.executable, "-c", _PORT_TAKEN_SERVER, "--port", "1"],
        env={},
        port=1,
        log_path=tmp_path / "fake.log",
        startup_timeout_s=60,
        progress=lines.append,
    )
    try:
        proc.start()
    except server.PortTaken as exc:
        assert "could not bind port" in str(exc)
    else:
        raise AssertionError("the fake server never serves")
    retries = [line for line in lines if "retrying" in line]
    assert len(retries) == server.PORT_ATTEMPTS - 1 and proc.port != 1
    assert proc.command[-1] == str(proc.port)


def test_a_custom_fidelity_variant_is_the_default_recipe_with_its_config() -> None:
    fidelity = _fidelity_module()
    label, recipe = fidelity.custom_variant('span.w16={"window": 16, "policy": "span"}')
    flags = recipe(128)
    assert label == "span.w16"
    assert flags[:4] == ("--kvsparse-preset", "default", "--kvsparse-budget", "128")
    assert flags[4] == "--kvsparse-config" and json.loads(flags[5]) == {"window": 16, "policy": "span"}
    for spec, message in [
        ("a-b={}", "LABEL of letters"),
        ("x={", "not JSON"),
        ("x=[1]", "a JSON object"),
        ("x", "LABEL=JSON"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=message):
            fidelity.custom_variant(spec)


def _fidelity_module(script: str = "fidelity.py") -> ModuleType:
    """A bench script that imports its siblings, loaded by path."""
    sys.path.insert(0, str(BENCH))  # the scripts import their siblings as `common.*`
    try:
        return _load(script)
    finally:
        sys.path.remove(str(BENCH))


def test_ablation_beside_kvpress_counts_prompts_both_full_caches_answer() -> None:
    ablation = _fidelity_module("ablation.py")
    ok, wrong = {"correct": True}, {"correct": False}
    data = {
        "suite": {"name": "frozen", "sha256": "abc"},
        "budgets": [64, 128],
        "policy_variants": {"no follow": {"follow": 0}},
        "server_variants": {},
        "answers": {
            "a": {"full": ok, "default@64": ok, "default@128": ok, "no follow@64": wrong, "no follow@128": ok},
            "b": {"full": ok, "default@64": wrong, "default@128": ok, "no follow@64": wrong, "no follow@128": ok},
            "c": {"full": ok, "default@64": ok, "default@128": ok},  # kvpress's full cache misses it
            "d": {"full": wrong},
        },
    }

    def prompt(pid: str, full: bool, snap: tuple[bool, ...], ada: tuple[bool, ...]) -> dict:
        methods = {
            "snapkv": {str(b): {"correct": c} for b, c in zip((64, 128), snap)},
            "adakv": {str(b): {"correct": c} for b, c in zip((64, 128), ada)},
        }
        return {"prompt_id": pid, "full": {"correct": full}, "methods": methods if full else {}}

    kvpress = {
        "settings": {
            "frozen_suite": {"sha256": "abc"},
            "kvpress": "0.5.5",
            "press_parameters": {"snapkv": {}, "adakv": {}},
        },
        "prompts": [
            prompt("a", True, (True, False), (False, True)),
            prompt("b", True, (False, False), (False, True)),
            prompt("c", False, (), ()),
            prompt("e", True, (True, True), (True, True)),  # not asked by the ablation
        ],
    }
    data["kvpress"] = ablation.kvpress_answers(kvpress, "kvpress.json", data)
    both, rows = ablation.kvpress_rows(data)
    assert both == ["a", "b"]
    assert rows["default"] == {64: (1, 2), 128: (2, 2)}
    assert rows["no follow"] == {64: (0, 2), 128: (2, 2)}
    assert rows["kvpress snapkv"] == {64: (1, 2), 128: (0, 2)}
    assert rows["kvpress adakv"] == {64: (0, 2), 128: (2, 2)}
    assert rows[ablation.KVPRESS_BEST] == {64: (1, 2), 128: (2, 2)}
    table = "\n".join(ablation.against_kvpress(data))
    assert "| default | 1 of 2 | 2 of 2 | 3 |" in table
    kvpress["settings"]["frozen_suite"]["sha256"] = "other"
    with pytest.raises(SystemExit, match="not a run of the frozen suite"):
        ablation.kvpress_answers(kvpress, "kvpress.json", data)


def test_kvpress_rows_count_prompts_both_full_caches_solve_and_name_the_best_press() -> None:
    fidelity = _fidelity_module("common/fidelity_report.py")

    def answers(*correct: bool) -> dict:
        return {f"p{i}": {"correct": c, "prompt_tokens": 3000} for i, c in enumerate(correct)}

    report = {
        "settings": {"budgets": [64, 128]},
        "systems": [
            {"name": "full", "budget": None, "error": None, "answers": answers(True, True, True, False)},
            {"name": "span-64", "budget": 64, "error": None, "answers": answers(True, False, True, True)},
            {"name": "span-128", "budget": 128, "error": None, "answers": answers(True, True, False, True)},
        ],
    }

    def press(*correct: bool) -> dict:
        return {"64": {"correct": correct[0]}, "128": {"correct": correct[1]}}

    kvpress = {
        "methods": ["snapkv", "snapkv.w16"],
        "prompts": {
            "p0": {
                "full": {"correct": True},
                "methods": {"snapkv": press(False, True), "snapkv.w16": press(True, True)},
            },
            "p1": {
                "full": {"correct": True},
                "methods": {"snapkv": press(True, True), "snapkv.w16": press(True, False)},
            },
            "p2": {
                "full": {"correct": False},
                "methods": {"snapkv": press(True, True), "snapkv.w16": press(True, True)},
            },
            "p3": {
                "full": {"correct": True},
                "methods": {"snapkv": press(True, True), "snapkv.w16": press(True, True)},
            },
        },
    }
    acc = fidelity.accuracy(report, kvpress, ["p0", "p1", "p2", "p3"])
    assert acc["solved_by_both_full_caches"] == ["p0", "p1"]  # p2: kvpress's full misses, p3: ours
    rows = acc["rows"]
    assert rows["project span"] == {"64": {"correct": 1, "evaluated": 2}, "128": {"correct": 2, "evaluated": 2}}
    assert rows["kvpress snapkv"] == {"64": {"correct": 1, "evaluated": 2}, "128": {"correct": 2, "evaluated": 2}}
    assert rows["kvpress snapkv.w16"] == {"64": {"correct": 2, "evaluated": 2}, "128": {"correct": 1, "evaluated": 2}}
    assert rows["kvpress best"] == {
        "64": {"correct": 2, "evaluated": 2, "method": "snapkv.w16"},
        "128": {"correct": 2, "evaluated": 2, "method": "snapkv"},
    }
    assert fidelity.cell_text(rows["kvpress best"]["64"]) == "2/2 (snapkv.w16)"


def test_sparse_systems_are_asked_only_what_the_full_cache_answered() -> None:
    fidelity = _fidelity_module()
    prompts = [argparse.Namespace(prompt_id=pid) for pid in ("a", "b", "c")]
    report = {"systems": []}
    assert fidelity.prompts_to_ask(report, prompts, all_prompts=False) == prompts  # the full cache asks all
    report["systems"].append({"name": "full", "answers": {"a": {"correct": True}, "b": {"correct": False}}})
    assert [p.prompt_id for p in fidelity.prompts_to_ask(report, prompts, all_prompts=False)] == ["a"]
    assert fidelity.prompts_to_ask(report, prompts, all_prompts=True) == prompts


def test_a_resumed_run_asks_kept_systems_only_the_prompts_of_added_seeds(tmp_path: Path) -> None:
    fidelity = _fidelity_module()
    prompts = [argparse.Namespace(prompt_id=pid) for pid in ("s0-a", "s0-short", "s1-a", "s1-short")]
    full = {"name": "full", "budget": None, "answers": {"s0-a": {"prompt_tokens": 3000}}, "seconds": 9, "error": None}
    assert [p.prompt_id for p in fidelity.not_yet_asked(full, prompts, {"systems": []})] == [
        "s0-short",
        "s1-a",
        "s1-short",
    ]
    full["answers"].update({pid: {"prompt_tokens": 3000 if pid.endswith("a") else 100} for pid in ("s1-a", "s1-short")})
    full["answers"]["s0-short"] = {"prompt_tokens": 100}
    report = {"systems": [full]}
    sparse = {"name": "d-256", "budget": 256, "answers": {"s0-a": {"correct": True}}, "seconds": 5, "error": None}
    assert [p.prompt_id for p in fidelity.not_yet_asked(sparse, prompts, report)] == ["s1-a"]  # short ones skipped
    more = {"name": "d-256", "budget": 256, "answers": {"s1-a": {"correct": False}}, "seconds": 2, "error": None}
    merged = fidelity.extend(sparse, more)
    assert merged["answers"].keys() == {"s0-a", "s1-a"} and merged["error"] is None

    paths = fidelity.ReportPaths(tmp_path, "fidelity-x")
    earlier = {
        "settings": {"budgets": [256], "ruler_seeds": [0], "ruler_per_length": 8},
        "server_args": ["--x"],
        "prompt_ids": [],
        "passage_ids": [],
        "ruler_prompt_ids": ["s0-a"],
        "ruler_answers": ["123"],
        "full_greedy_continuations": {},
        "systems": [full, sparse, {**sparse, "name": "d-512", "error": "boom"}],
    }
    paths.json.write_text(json.dumps(earlier))
    grown = {**earlier, "settings": {**earlier["settings"], "ruler_seeds": [0, 1]}, "systems": []}
    grown.update(ruler_prompt_ids=["s0-a", "s1-a"], ruler_answers=["123", "456"])
    assert set(fidelity.resumable(paths, grown)) == {"full", "d-256"}  # a failed system runs again
    for changed in (
        {"ruler_answers": ["999", "456"]},  # seed 0's prompt is not the one measured
        {"settings": {**grown["settings"], "ruler_per_length": 9}},
    ):
        with pytest.raises(SystemExit, match="other settings"):
            fidelity.resumable(paths, {**grown, **changed})


def test_an_ablation_variant_is_a_label_and_a_json_object() -> None:
    ablation = _fidelity_module("ablation.py")
    assert ablation.labelled_json('no full layer (full_layers [])={"full_layers": []}') == (
        "no full layer (full_layers [])",
        {"full_layers": []},
    )
    for spec in ("x={", "x=[1]", "x", '={"a": 1}'):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL=JSON object"):
            ablation.labelled_json(spec)


def test_a_capacity_system_sent_fewer_requests_is_said_in_the_report() -> None:
    capacity = _fidelity_module("capacity.py")
    profile = capacity.PROFILES["gemma-16k"]
    assert [s.requests for s in profile.all_systems()] == [4, 11, 23]
    report = {
        "workloads": [{"name": "16000", "parts": [{"count": 23}]}],
        "systems": [{"runs": [{"workload": "16000", "sent": 4}]}, {"runs": [{"workload": "16000", "sent": 23}]}],
    }
    assert capacity.sent_fewer(report)
    report["systems"] = report["systems"][1:]
    assert not capacity.sent_fewer(report)


def test_the_fp8_llama_profiles_give_every_system_the_same_bytes_in_h100_sized_chunks() -> None:
    """fp8-llama-4k/16k: stock in float32 and FP8 against the default in FP8, the FP8 systems at four
    times the float32 pool's tokens, prefill chunks of 8,192 passed to every server."""
    capacity = _fidelity_module("capacity.py")
    systems = _fidelity_module("common/systems.py")
    for name in ("fp8-llama-4k", "fp8-llama-16k"):
        profile = capacity.PROFILES[name]
        assert [(s.name, s.kv_dtype) for s in profile.all_systems()] == [
            ("stock", None),
            ("stock-fp8", "fp8_e4m3"),
            ("default-fp8", "fp8_e4m3"),
        ]
        tokens = [capacity.system_tokens(s, profile.server) for s in profile.all_systems()]
        assert tokens == [16384, 65536, 65536]
        args = systems.shared_server_args(profile.server, Path("/m"), [])
        assert args[args.index("--chunked-prefill-size") + 1] == "8192"
    plain = systems.shared_server_args(capacity.PROFILES["fp8"].server, Path("/m"), [])
    assert "--chunked-prefill-size" not in plain


POOL_LINE = (
    "[2026-12-06 22:34:27] max_total_num_tokens=2097152, chunked_prefill_size=8192, max_prefill_tokens=16384, "
    "max_running_requests=2048, context_len=131072, available_cpu_mem=13.84 GB"
)


def test_the_pool_and_its_chunk_are_read_from_the_servers_startup_line() -> None:
    assert server.pool_settings("noise\n" + POOL_LINE + "\n") == (2097152, 8192)
    assert server.pool_settings(POOL_LINE.replace("=8192", "=-1")) == (2097152, None)
    assert server.pool_settings(POOL_LINE.replace("=8192", "=None")) == (2097152, None)
    assert server.pool_settings("Decode batch, #running-req: 2\n") is None


@pytest.mark.parametrize("chunk", [8192, None])
def test_the_bound_at_a_prefills_peak_leaves_out_its_prompt_in_every_sparse_layer(chunk: int | None) -> None:
    """Llama-3.1-8B's shape, the default in FP8 on a pool of 2,097,152 rows (65,536 dense FP8
    tokens): a 16,000-token prompt, chunked (earlier chunks in the prefix store, the last waiting
    for the guide) or whole (all waiting for the guide), holds one row per token in each of the
    31 sparse layers at its peak; a 4,000-token one, kept by each layer's own scores in one chunk,
    holds nothing more. Stock's bound is 1 either way."""
    capacity = _fidelity_module("capacity.py")
    config = json.loads((BENCH / "models" / "llama-3.1-8b" / "config.json").read_text())
    pool = [2097152, chunk]
    systems = [
        {"name": "stock", "stock": True, "flags": [], "kv_dtype": None, "pool": [16384, chunk], "runs": []},
        {
            "name": "default-fp8",
            "stock": False,
            "flags": ["--kvsparse-preset", "default"],
            "kv_dtype": "fp8_e4m3",
            "pool": pool,
            "runs": [],
        },
    ]
    workloads = []
    for prompt, stock_peak, peak in ((16000, 1, 32), (4000, 4, 55)):
        name = f"w{prompt}"
        workloads.append({"name": name, "length": prompt + 32, "parts": [{"input_len": prompt, "output_len": 32}]})
        systems[0]["runs"].append({"workload": name, "peak_running": stock_peak})
        systems[1]["runs"].append({"workload": name, "peak_running": peak})
    report = {"workloads": workloads, "systems": systems}
    capacity.add_ratios(report, config, "float32")
    stock_16k = systems[0]["runs"][0]
    assert stock_16k["bound"] == stock_16k["bound_at_peak"] == 1.0
    long, short = systems[1]["runs"]
    assert long["ratio_to_stock"] == 32.0 and short["ratio_to_stock"] == 55 / 4
    assert long["bound_at_peak"] == pytest.approx(long["bound"] * (1 - 16000 * 31 / 2097152))
    assert short["bound_at_peak"] == short["bound"] > 13
    with_no_pool = {**systems[1], "pool": None, "runs": [{"workload": "w4000", "peak_running": 55}]}
    capacity.add_ratios({"workloads": workloads, "systems": [systems[0], with_no_pool]}, config, "float32")
    assert with_no_pool["runs"][0]["bound_at_peak"] is None and with_no_pool["runs"][0]["bound"] > 13


def test_a_serving_profile_with_stock_fp8_gives_it_equal_bytes_and_its_own_ratios() -> None:
    """cpu-long-fp8: an FP8 system gets the float32 pool's bytes (four times its tokens); the
    ratios are taken to stock and to stock FP8, not of one stock system to the other; its dry run
    keeps one variant of each kind."""
    serving = _fidelity_module("serving.py")
    models = _fidelity_module("common/models.py")
    assert models.tokens_at_equal_bytes(12288, "float32", "fp8_e4m3") == 49152
    assert models.tokens_at_equal_bytes(12288, "float32", "bf16") == 24576
    assert models.tokens_at_equal_bytes(12288, "bfloat16", None) == 12288
    assert models.tokens_at_equal_bytes(None, "float32", "fp8_e5m2") is None
    profile = serving.PROFILES["cpu-long-fp8"]
    assert serving.stock_systems(profile) == ["stock", "stock-fp8"]
    assert [v.name for v in profile.dry_run().variants] == ["stock-fp8", "default", "default-fp8"]
    systems = [_system(name, 10.0, 1.0) for name in ("stock", "stock-fp8", "default", "default-fp8")]
    rows = serving.build_report(profile, "d", Path("/m"), [], 1, systems)["ratios"]
    pairs = {(row["baseline"], row["system"]) for row in rows}
    assert pairs == {
        ("stock", "stock-fp8"),
        ("stock", "default"),
        ("stock", "default-fp8"),
        ("stock-fp8", "default"),
        ("stock-fp8", "default-fp8"),
    }


@pytest.mark.parametrize(
    ("flags", "vector"), [("fpu avx2 avx512f", "AVX-512"), ("fpu sse2 avx2", "AVX2"), ("fpu sse2", "no AVX2")]
)
def test_reports_name_the_cpu_model_and_its_widest_vector_extension(tmp_path, flags: str, vector: str) -> None:
    systems = _fidelity_module("common/systems.py")
    cpuinfo = tmp_path / "cpuinfo"
    processor = f"processor\t: {{}}\nmodel name\t: AMD EPYC 9554\nflags\t\t: {flags}\n"
    cpuinfo.write_text(processor.format(0) + "\n" + processor.format(1))
    assert systems.cpu_model(cpuinfo) == f"AMD EPYC 9554 ({vector})"
    assert systems.cpu_model(tmp_path / "missing") != ""
