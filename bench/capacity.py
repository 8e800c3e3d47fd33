"""Capacity benchmark: at a fixed KV budget, how many requests run at once, at several lengths.

Why: sparsity keeps fewer KV entries per request, so the same memory should admit more requests,
and with one KV heap it should never admit fewer than stock SGLang at any length. For each
system (stock SGLang, then each project variant) this starts the server once with the same
``--max-total-tokens``, and for each workload sends more requests at once than stock can hold
(SGLang's own client; a workload of several parts runs one client per part at the same time),
then reads the most requests that ran at once from the server's ``#running-req`` log lines, and
the KV bytes per request from ``GET /kvsparse/stats`` where the server answers it. Beside each
measured ratio it shows the equal-bytes bound: what the project's heap layout admits per stock
request at that length (`sglang_kvsparse.state.layout.capacity_ratio`, scores included), and that
bound while one more prompt is at its prefill's peak (`free_at_prefill_peak`). A system
may keep its KV cache in FP8 (`--kv-cache-dtype`): it then gets the same KV bytes as the others,
so as many more dense tokens as its values are smaller, and every system is compared with every
stock one (stock in the model's dtype, stock FP8).
Writes ``<out-dir>/capacity-<profile>-<date>.json``, ``.md`` and ``.png``; logs in ``...-logs/``.

Usage: .venv/bin/python bench/capacity.py --profile NAME [--out-dir DIR]   (names: PROFILES)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import requests
from common.client import ClientError, KvStatsPoller, Workload, run_client
from common.models import DTYPE_BYTES, kv_bytes_per_token, kv_value_bytes, tokens_at_equal_bytes
from common.report import ReportPaths, provenance_line, write_json
from common.systems import (
    STOCK,
    ServerSettings,
    args_for_report,
    launcher_of,
    machine,
    prepare_model,
    server_for,
    shared_server_args,
)
from serving_profiles import PROJECT_BUDGET_256, PROJECT_DEFAULT, PROJECT_GUIDED, PROJECT_OFF, Variant

from kvsparse_testbed.server import (
    ServerProcess,
    ServerStartError,
    mean_decoding_requests,
    peak_running_requests,
    pool_settings,
    retracted_requests,
)
from sglang_kvsparse.config import ResolvedSparsity
from sglang_kvsparse.server.model_support import resolve_for_model
from sglang_kvsparse.server.options import add_sparsity_arguments, sparsity_from_args
from sglang_kvsparse.state.admission import prefill_extra_rows, waits_for_guide
from sglang_kvsparse.state.layout import HeapLayout, capacity_ratio, scores_per_row
from sglang_kvsparse.state.prefix_store import PrefixStore

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class Part:
    """`count` requests of `input_len` + `output_len` tokens, sent at once; with `range_ratio` < 1
    each length is drawn uniformly from [range_ratio x length, length] (the same draws, from the
    same seed, for every system)."""

    input_len: int
    output_len: int
    count: int
    range_ratio: float = 1.0


@dataclass(frozen=True)
class CapacityWorkload:
    """Requests sent together: one length, or (range ratio < 1) a mix of lengths."""

    name: str
    parts: tuple[Part, ...]

    @property
    def length(self) -> int | None:
        """The requests' final length when they all have one (None for a mix)."""
        lengths = {part.input_len + part.output_len for part in self.parts}
        mixed = any(part.range_ratio < 1 for part in self.parts)
        return lengths.pop() if len(lengths) == 1 and not mixed else None


@dataclass(frozen=True)
class System:
    """One server measured: stock SGLang, or the project's launcher with its `--kvsparse-*` flags;
    its KV cache in the model's dtype or FP8 (`kv_dtype`, a `--kv-cache-dtype` value)."""

    name: str
    flags: tuple[str, ...] = ()
    stock: bool = False
    kv_dtype: str | None = None
    #: Requests sent in each one-part workload in place of the part's count (None: the part's):
    #: a few more than a system can hold show its peak, and a 16k prefill costs minutes here.
    requests: int | None = None


STOCK_SYSTEM = System(STOCK, stock=True)


@dataclass(frozen=True)
class CapacityProfile:
    """A fixed KV budget (`server.max_total_tokens` dense tokens in the model's dtype), the
    workloads sent to it, and the project's variants (`systems`, when given, replaces stock
    and the variants)."""

    name: str
    description: str
    server: ServerSettings
    workloads: tuple[CapacityWorkload, ...]
    variants: tuple[Variant, ...]
    client_timeout_s: float
    seed: int = 1
    systems: tuple[System, ...] = ()

    def all_systems(self) -> tuple[System, ...]:
        return self.systems or (STOCK_SYSTEM, *(System(v.name, v.flags) for v in self.variants))


def _cpu_server(max_total_tokens: int, model: str = "default", shape: str = "full") -> ServerSettings:
    return ServerSettings(
        model=model,
        device="cpu",
        dtype="float32",
        max_total_tokens=max_total_tokens,
        mem_fraction_static=None,
        decode_log_interval=1,
        startup_timeout_s=900.0,
        shape=shape,
    )


def _one(input_len: int, output_len: int, count: int) -> CapacityWorkload:
    return CapacityWorkload(f"{input_len}", (Part(input_len, output_len, count),))


def _sparse_check(input_len: int, pool: int, count: int, note: str = "") -> CapacityProfile:
    """`count` requests of `input_len` + 32 tokens, budget 256, in the KV bytes of a `pool`-token
    dense pool (two dense requests)."""
    return CapacityProfile(
        name=f"sparse-{input_len // 1000}k",
        description=f"Sparse capacity check{note}: {count} requests of {input_len:,} + 32 tokens into the KV "
        f"bytes of a {pool:,}-token dense pool (2 dense requests).",
        server=_cpu_server(pool),
        workloads=(_one(input_len, 32, count),),
        variants=(Variant("budget-256", PROJECT_BUDGET_256),),
        client_timeout_s=1200.0,
    )


def _long_out(name: str, server: ServerSettings, model: str) -> CapacityProfile:
    """Long outputs, where decode-time eviction runs: requests of 1,000 + 4,000 tokens in the KV
    bytes of a 16,384-token dense pool (3 stock requests at their final length), sent 4 to stock
    and 14 to the default."""
    return CapacityProfile(
        name=name,
        description=f"Long outputs, where decode-time eviction runs ({model}): requests of 1,000 + 4,000 "
        "tokens into the KV bytes of a 16,384-token dense pool (3 stock requests at their final length), "
        "sent 4 to stock and 14 to the default (budget 1,024: every sparse layer evicts about 3,000 of each "
        "request's keys while it decodes).",
        server=server,
        workloads=(_one(1000, 4000, 14),),
        variants=(),
        client_timeout_s=5400.0,
        systems=(System(STOCK, stock=True, requests=4), System("default", PROJECT_DEFAULT)),
    )


def _fp8_llama(input_len: int, counts: tuple[int, int, int]) -> CapacityProfile:
    """FP8 stacked with sparsity at Llama-3.1-8B's KV shape: requests of `input_len` + 32 tokens in
    the KV bytes of a 16,384-token float32 pool, stock in float32 and in FP8 against the default in
    FP8, sent `counts` requests (in that order: a few more than each can hold). Prefill chunks of
    8,192 tokens, SGLang's on an H100 or H200: a prompt's earlier chunks wait in the sparse layers'
    prefix store until its last chunk scores them, and this small pool feels that far more than a
    GPU's."""
    stock, stock_fp8, default = counts
    return CapacityProfile(
        name=f"fp8-llama-{input_len // 1000}k",
        description="An FP8 KV cache stacked with sparsity at Llama-3.1-8B's KV shape (32 layers, 8 KV "
        "heads, head dim 128, 131,072-token context; dummy weights, tiny hidden size): requests of "
        f"{input_len:,} + 32 tokens in the KV bytes of a 16,384-token float32 pool, sent {stock} to stock "
        f"in float32, {stock_fp8} to stock in FP8 (e4m3; on this CPU through the FP8 reference, "
        f"`patches/cpu_fp8.py`) and {default} to the default preset in FP8, all at once; prefill chunks "
        "of 8,192 tokens (SGLang's on an H100 or H200).",
        server=replace(_cpu_server(16384, model="llama-3.1-8b", shape="kv"), chunked_prefill_size=8192),
        workloads=(_one(input_len, 32, max(counts)),),
        variants=(),
        client_timeout_s=7200.0,
        systems=(
            System(STOCK, stock=True, requests=stock),
            System("stock-fp8", stock=True, kv_dtype="fp8_e4m3", requests=stock_fp8),
            System("default-fp8", PROJECT_DEFAULT, kv_dtype="fp8_e4m3", requests=default),
        ),
    )


#: Gemma 3 270M with its three global layers full: its sliding layers keep their window, lossless.
GEMMA_GLOBALS_FULL = ("--kvsparse-full-layers", "5,11,17")


def _gemma(input_len: int, pool: int, counts: tuple[int, int, int], dummy: bool = False) -> CapacityProfile:
    """Gemma 3 270M: requests of `input_len` + 32 tokens in the KV bytes of a `pool`-token dense
    pool, stock against the global layers full and the default, sent `counts` requests (in that
    order). Real weights, or (`dummy`) dummy weights of its exact KV shape with one query head,
    so that stock's prefill of a long prompt costs less on this machine."""
    weights = "dummy weights of its KV shape (one query head)" if dummy else "real weights"
    model = ("gemma-3-270m-dummy", "kv-one-head") if dummy else ("gemma-3-270m", "full")
    stock, globals_full, default = counts
    return CapacityProfile(
        name=f"gemma-{input_len // 1000}k",
        description=f"Gemma 3 270M, {weights} (15 sliding-window layers of 512, 3 global): requests "
        f"of {input_len:,} + 32 tokens in the KV bytes of a {pool:,}-token dense pool "
        f"({pool // (input_len + 32)} stock request(s)), sent {stock} to stock, {globals_full} to "
        f"`globals-full` and {default} to `default`, all at once. The sliding layers keep their window; "
        "`globals-full` keeps the global layers whole (lossless); `default` is the default preset (its "
        "full layer 0 slides, so the first global layer, 5, is full instead; 11 and 17 are sparse).",
        server=_cpu_server(pool, model=model[0], shape=model[1]),
        workloads=(_one(input_len, 32, max(counts)),),
        variants=(),
        client_timeout_s=5400.0,
        systems=(
            System(STOCK, stock=True, requests=stock),
            System("globals-full", GEMMA_GLOBALS_FULL, requests=globals_full),
            System("default", PROJECT_DEFAULT, requests=default),
        ),
    )


PROFILES: dict[str, CapacityProfile] = {
    profile.name: profile
    for profile in (
        CapacityProfile(
            name="smoke",
            description="Tiny capacity check: 10 requests of 300 + 32 tokens into a 2,048-token pool.",
            server=_cpu_server(2048),
            workloads=(_one(300, 32, 10),),
            variants=(Variant("project", PROJECT_OFF),),
            client_timeout_s=600.0,
        ),
        # Six: one more than the five (2.5x stock's two) the test asserts, in the least time.
        _sparse_check(2000, 4096, 6, note=" (run by the test suite)"),
        _sparse_check(4000, 8192, 8),
        CapacityProfile(
            name="heap",
            description="The one KV heap against stock at every length (default model, the KV bytes "
            "of an 8,192-token dense pool): 256, 1,000 and 4,000-token prompts with 32 output "
            "tokens, and a mix of chats and documents (prompts drawn from 256 to 4,000 tokens, "
            "outputs from 2 to 32, the same draws for both systems).",
            server=_cpu_server(8192),
            workloads=(
                _one(256, 32, 40),
                _one(1000, 32, 12),
                _one(4000, 32, 8),
                CapacityWorkload("mixed", (Part(4000, 32, 24, range_ratio=0.064),)),
            ),
            variants=(Variant("default", PROJECT_DEFAULT),),
            client_timeout_s=2400.0,
        ),
        CapacityProfile(
            name="heap-llama",
            description="Llama-3.1-8B's KV shape (32 layers, 8 KV heads, head dim 128, 131,072-token "
            "context; dummy weights, tiny hidden size) in the KV bytes of a 16,384-token dense pool: "
            "512 and 4,000-token prompts, 32 output tokens each.",
            server=_cpu_server(16384, model="llama-3.1-8b", shape="kv"),
            workloads=(_one(512, 32, 40), _one(4000, 32, 16)),
            variants=(Variant("default", PROJECT_DEFAULT),),
            client_timeout_s=3600.0,
        ),
        CapacityProfile(
            name="guide-4k",
            description="What `guide_below` saves: 8 requests of 4,000 + 32 tokens in the KV bytes of an "
            "8,192-token dense pool (2 dense requests), the default (budget 1,024 is 0.25 of the "
            "prompt: each layer selects by its own scores) against the default guided at every budget "
            "(a guided prefill holds a row per sparse column and prompt token for its forward).",
            server=_cpu_server(8192),
            workloads=(_one(4000, 32, 8),),
            variants=(Variant("default", PROJECT_DEFAULT), Variant("guided", PROJECT_GUIDED)),
            client_timeout_s=1800.0,
        ),
        CapacityProfile(
            name="fp8",
            description="An FP8 KV cache stacked with sparsity (default model, the KV bytes of an 8,192-token "
            "float32 pool): 4,000-token prompts with 32 output tokens, stock SGLang in float32 and in FP8 "
            "(e4m3; on this CPU through the FP8 reference, `patches/cpu_fp8.py`) against the default preset "
            "in FP8. The model's context (8,192) rules out 16,000-token prompts here.",
            server=_cpu_server(8192),
            workloads=(_one(4000, 32, 32),),
            variants=(),
            client_timeout_s=5400.0,
            systems=(
                STOCK_SYSTEM,
                System("stock-fp8", stock=True, kv_dtype="fp8_e4m3"),
                System("default-fp8", PROJECT_DEFAULT, kv_dtype="fp8_e4m3"),
            ),
        ),
        _long_out("long-out", _cpu_server(16384), "default model"),
        _long_out(
            "long-out-llama",
            _cpu_server(16384, model="llama-3.1-8b", shape="kv"),
            "Llama-3.1-8B's KV shape: 32 layers, 8 KV heads, head dim 128; dummy weights, tiny hidden size",
        ),
        # Each system is sent a few more requests than its equal-bytes bound.
        _fp8_llama(4000, (6, 20, 60)),
        _fp8_llama(16000, (2, 5, 34)),
        _gemma(4000, 16384, (6, 20, 20)),
        _gemma(16000, 32768, (4, 11, 23), dummy=True),
        CapacityProfile(
            name="cpu",
            description="Default model on the CPU: 24 requests of 2,000 + 128 tokens into the KV bytes "
            "of a 16,384-token dense pool (7 dense requests).",
            server=_cpu_server(16384),
            workloads=(_one(2000, 128, 24),),
            variants=(Variant("default", PROJECT_DEFAULT), Variant("budget-256", PROJECT_BUDGET_256)),
            client_timeout_s=3600.0,
        ),
    )
}


def say(message: str) -> None:
    print(f"[capacity] {message}", flush=True)


def run_workload(
    server: ServerProcess,
    system: System,
    workload: CapacityWorkload,
    profile: CapacityProfile,
    log_dir: Path,
    bytes_per_token: int,
    num_layers: int,
) -> dict[str, Any]:
    """Send one workload's parts at once; its peak running requests and KV bytes per request."""
    server.flush_cache()
    bookmark = server.log_size()
    together = len(workload.parts) > 1
    if system.requests is not None and not together:
        workload = replace(workload, parts=(replace(workload.parts[0], count=system.requests),))
    clients = [
        Workload(
            part.input_len,
            part.output_len,
            part.count,
            part.count,
            profile.seed + i,
            flush_cache=not together,
            range_ratio=part.range_ratio,
            warmup_requests=0,  # the peak of running requests is counted, not timed
        )
        for i, part in enumerate(workload.parts)
    ]
    tag = f"{system.name}-{workload.name}"
    with KvStatsPoller(server.base_url) as poller, ThreadPoolExecutor(len(clients)) as pool:
        results = list(
            pool.map(
                lambda item: run_client(
                    server.base_url,
                    item[1],
                    result_file=log_dir / f"client-{tag}-{item[0]}.jsonl",
                    log_path=log_dir / f"client-{tag}.log",
                    timeout_s=profile.client_timeout_s,
                ),
                enumerate(clients),
            )
        )
    parts = workload.parts
    # A ranged part's lengths are uniform in [ratio x length, length]: its mean is the estimate.
    mean_len = sum((p.input_len + p.output_len) * (1 + p.range_ratio) / 2 * p.count for p in parts)
    dense_bytes = mean_len / sum(p.count for p in parts)
    kv_bytes, source = poller.bytes_per_request(dense_bytes * bytes_per_token)
    layer_token_bytes = bytes_per_token / num_layers
    log = server.log_since(bookmark)
    return {
        "workload": workload.name,
        "sent": sum(part.count for part in parts),
        "completed": sum(result["completed"] for result in results),
        "peak_running": peak_running_requests(log),
        "mean_decoding": mean_decoding_requests(log),
        "retracted": retracted_requests(log),
        "duration_s": max(result["duration"] for result in results),
        "output_tok_s": sum(result["total_output_tokens"] for result in results)
        / max(result["duration"] for result in results),
        "kv_bytes_per_request": kv_bytes,
        "kv_bytes_per_request_per_layer": {
            kind: slots * layer_token_bytes for kind, slots in poller.layer_slots_per_request.items()
        }
        or {"every": kv_bytes / num_layers},
        "kv_bytes_source": source,
    }


def system_tokens(system: System, settings: ServerSettings) -> int | None:
    """The system's `--max-total-tokens`: the profile's KV bytes, in its own values."""
    return tokens_at_equal_bytes(settings.max_total_tokens, settings.dtype, system.kv_dtype)


def measure_system(
    system: System,
    shared: list[str],
    profile: CapacityProfile,
    log_dir: Path,
    bytes_per_token: int,
    num_layers: int,
) -> dict[str, Any]:
    """One system: start it, run every workload, stop it."""
    flags = system.flags
    row: dict[str, Any] = {
        "name": system.name,
        "launcher": launcher_of(system.name, system.stock),
        "flags": list(flags),
        "stock": system.stock,
        "kv_dtype": system.kv_dtype,
        "max_total_tokens": system_tokens(system, profile.server),
        "error": None,
        "pool": None,
        "runs": [],
    }
    try:
        with server_for(system.name, flags, shared, profile.server, log_dir, say, system.stock) as server:
            row["pool"] = pool_settings(server.log_since(0))
            for workload in profile.workloads:
                say(f"[{system.name}] workload {workload.name}")
                row["runs"].append(
                    run_workload(server, system, workload, profile, log_dir, bytes_per_token, num_layers)
                )
    except (ServerStartError, ClientError, requests.RequestException) as exc:
        say(f"[{system.name}] failed: {exc}")
        row["error"] = str(exc).splitlines()[0]
    return row


def heap_layout(
    flags: tuple[str, ...], model_config: dict[str, Any], value_bytes: int
) -> tuple[ResolvedSparsity, HeapLayout] | None:
    """The variant's sparsity on the model and its heap layout (`value_bytes`: a stored K/V
    value's, which sets a row's scores); None with sparsity off."""
    parser = argparse.ArgumentParser()
    add_sparsity_arguments(parser)
    known, _ = parser.parse_known_args(list(flags))
    config = sparsity_from_args(known)
    if not config.enabled:
        return None
    head_dim = model_config.get("head_dim") or model_config["hidden_size"] // model_config["num_attention_heads"]
    layers, context = model_config["num_hidden_layers"], model_config["max_position_embeddings"]
    resolved = resolve_for_model(config, model_config, layers, context)
    return resolved, HeapLayout.from_resolved(resolved, scores_per_row(head_dim, value_bytes))


def heap_bound(
    flags: tuple[str, ...], model_config: dict[str, Any], length: int | None, value_bytes: int
) -> float | None:
    """Requests of `length` tokens the variant's heap admits per dense request of the same KV
    values, at equal bytes."""
    if length is None:
        return None
    sparse = heap_layout(flags, model_config, value_bytes)
    return 1.0 if sparse is None else capacity_ratio(sparse[1], length)


def free_at_prefill_peak(
    flags: tuple[str, ...], model_config: dict[str, Any], prompt_len: int, value_bytes: int, pool: list[Any] | None
) -> float | None:
    """Share of the system's pool (`pool`: its size in heap rows and its prefill chunk, as its
    server logged them) left to requests while one more prompt of `prompt_len` tokens is at its
    prefill's peak: what that prefill holds beyond its own request's rows (earlier chunks in the
    prefix store, tokens waiting for the guide: `prefill_extra_rows`) is not free for the
    others. The bound at equal bytes times this share is the most the layout can run at once
    while requests keep arriving. 1.0 for stock, whose prefill holds nothing more."""
    sparse = heap_layout(flags, model_config, value_bytes)
    if sparse is None:
        return 1.0
    if pool is None:
        return None
    resolved, layout = sparse
    rows, chunk = pool
    store = PrefixStore.for_layout(layout, layout.page_size, resolved.config.sink)  # no rows: its arithmetic
    guided = waits_for_guide(resolved, layout, prompt_len)
    return max(1.0 - prefill_extra_rows(layout, store, prompt_len, chunk, guided) / rows, 0.0)


def add_ratios(report: dict[str, Any], model_config: dict[str, Any], dtype: str) -> None:
    """Per run: its peak over each stock system's on the same workload, the equal-bytes bound
    against it (the heap layout's, project systems, times how many more values the same bytes
    hold: an FP8 cache against one in the model's dtype) and that bound while one more prompt is
    at its prefill's peak (`free_at_prefill_peak`). `ratio_to_stock`, `bound` and
    `bound_at_peak` are against stock in the model's dtype."""
    lengths = {w["name"]: w["length"] for w in report["workloads"]}
    prompts = {w["name"]: w["parts"][0]["input_len"] for w in report["workloads"]}
    stocks = [s for s in report["systems"] if s["stock"]]
    peaks = {s["name"]: {run["workload"]: run["peak_running"] for run in s["runs"]} for s in stocks}
    for system in report["systems"]:
        mine = kv_value_bytes(dtype, system.get("kv_dtype"))
        flags = tuple(system["flags"])
        for run in system["runs"]:
            length = lengths[run["workload"]]
            layout, free = 1.0, 1.0
            if not system["stock"]:
                layout = heap_bound(flags, model_config, length, mine)
                free = free_at_prefill_peak(flags, model_config, prompts[run["workload"]], mine, system.get("pool"))
            run["against"] = {}
            for stock in stocks:
                base = peaks[stock["name"]].get(run["workload"])
                bound = None if layout is None else layout * kv_value_bytes(dtype, stock.get("kv_dtype")) / mine
                run["against"][stock["name"]] = {
                    "ratio": run["peak_running"] / base if base and run["peak_running"] else None,
                    "bound": bound,
                    "bound_at_peak": None if bound is None or free is None else bound * free,
                }
            main = run["against"].get(STOCK, {"ratio": None, "bound": None, "bound_at_peak": None})
            run["ratio_to_stock"], run["bound"], run["bound_at_peak"] = (
                main["ratio"],
                main["bound"],
                main["bound_at_peak"],
            )


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Capacity `{report['profile']}` — {report['date']}",
        provenance_line(report),
        "",
        report["description"],
        "",
        f"- Machine: {report['machine']}",
        f"- Server arguments (all systems): `{' '.join(report['server_args'])}`",
        "- Workloads: "
        + "; ".join(
            f"**{w['name']}**: "
            + " + ".join(
                f"{p['count']} x {_span(p['input_len'], p['range_ratio'])} + {_span(p['output_len'], p['range_ratio'])}"
                for p in w["parts"]
            )
            for w in report["workloads"]
        )
        + (" (a system sent fewer: its done/sent)" if sent_fewer(report) else ""),
        "",
        "| system | workload | done/sent | peak running req | ratio to stock | equal-bytes bound | "
        "bound, a prefill at its peak | mean running while decoding | retracted | output tok/s (x stock) | "
        "KV bytes/req | KV bytes/req per layer (by kind) | KV source |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    stock_tok_s = {
        run["workload"]: run["output_tok_s"]
        for system in report["systems"]
        if system["name"] == STOCK
        for run in system["runs"]
    }
    for system in report["systems"]:
        if system["error"]:
            lines.append(f"| {system['name']} | failed: {system['error']} | | | | | | | | | | | |")
        for run in system["runs"]:
            mean = f"{run['mean_decoding']:.1f}" if run["mean_decoding"] is not None else "—"
            base = stock_tok_s.get(run["workload"])
            tok_s = f"{run['output_tok_s']:.1f}" + (f" ({run['output_tok_s'] / base:.2f}x)" if base else "")
            ratio = f"{run['ratio_to_stock']:.2f}" if run["ratio_to_stock"] is not None else "—"
            bound = f"{run['bound']:.2f}" if run["bound"] is not None else "—"
            at_peak = _number(run.get("bound_at_peak"))
            per_layer = ", ".join(
                f"{kind} {value:,.0f}" for kind, value in run["kv_bytes_per_request_per_layer"].items()
            )
            peak = run["peak_running"] if run["peak_running"] is not None else "—"
            lines.append(
                f"| {system['name']} | {run['workload']} | {run['completed']}/{run['sent']} | {peak} | {ratio} | "
                f"{bound} | {at_peak} | {mean} | {run['retracted']} | {tok_s} | "
                f"{run['kv_bytes_per_request']:,.0f} | {per_layer} | {run['kv_bytes_source']} |"
            )
    stocks = [s["name"] for s in report["systems"] if s["stock"]]
    if len(stocks) > 1:
        lines += [
            "",
            "Against every stock system (peak running requests over its; the equal-bytes bound, and "
            "that bound with a prefill at its peak):",
            "",
        ]
        lines += ["| system | workload | " + " | ".join(f"over {name} (bound; at peak)" for name in stocks) + " |"]
        lines += ["|---|---|" + "---:|" * len(stocks)]
        for system in report["systems"]:
            for run in system["runs"]:
                cells = []
                for name in stocks:
                    cell = run["against"][name]
                    ratio = "—" if cell["ratio"] is None else f"{cell['ratio']:.2f}"
                    bound = "—" if cell["bound"] is None else f"{cell['bound']:.2f}"
                    cells.append(f"{ratio} ({bound}; {_number(cell.get('bound_at_peak'))})")
                lines.append(f"| {system['name']} | {run['workload']} | " + " | ".join(cells) + " |")
    lines += ["", "Systems:", ""]
    for system in report["systems"]:
        tokens = f", --max-total-tokens {system['max_total_tokens']:,}" if system.get("max_total_tokens") else ""
        kv = f" (KV {system['kv_dtype']}{tokens})" if system.get("kv_dtype") else ""
        lines.append(f"- **{system['name']}**: `{system['launcher']}` {' '.join(system['flags']) or '(stock)'}{kv}")
    lines += [
        "",
        "Peak running requests: the most requests holding KV at once in the server's scheduler log. "
        "Mean running while decoding: the requests of each logged decode step, averaged (on long outputs "
        "SGLang admits requests that later outgrow the pool and retracts them: the peak counts them, the "
        "mean what ran). Output tok/s: the workload's output tokens over its client's duration. "
        "SGLang admits a request by its full length and keeps room for the running requests' future "
        "tokens, so both systems admit fewer than the memory alone would hold. Equal-bytes bound: "
        "what the heap layout holds per request stock holds at the workload's final length, scores "
        "included (computed from the layout, not measured). Bound, a prefill at its peak: the same "
        "while one more prompt of the workload is at its prefill's peak, whose earlier chunks wait in "
        "the prefix store and whose last chunk's tokens wait for the guide in every sparse layer "
        "(`prefill_extra_rows`, over the pool the server logged): in a pool of few dense requests "
        "that wait is a large share of the memory; computed, not measured. KV bytes per request are measured when "
        "they peaked (K+V and the sparse entries' scores). All systems get the same KV bytes "
        "(--max-total-tokens counts dense tokens: an FP8 system gets as many more as its values are "
        "smaller).",
    ]
    return "\n".join(lines) + "\n"


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}"


def sent_fewer(report: dict[str, Any]) -> bool:
    """Whether some system was sent fewer requests than a workload's count (`System.requests`)."""
    counts = {w["name"]: sum(p["count"] for p in w["parts"]) for w in report["workloads"]}
    return any(run["sent"] < counts[run["workload"]] for s in report["systems"] for run in s["runs"])


def _span(length: int, ratio: float) -> str:
    return f"{length:,}" if ratio >= 1 else f"{int(length * ratio):,}..{length:,}"


def write_plot(paths: ReportPaths, report: dict[str, Any]) -> None:
    """Running requests over stock's against prompt length, with the bounds (where a prefill's
    peak lowers one, both) and stock drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4.5))
    axis.axhline(1.0, color="gray", linestyle="--", label="stock SGLang")
    for system in report["systems"]:
        if system["name"] == STOCK:
            continue
        single = [run for run in system["runs"] if run["ratio_to_stock"] is not None and run["bound"] is not None]
        lengths = [int(run["workload"]) for run in single]
        axis.plot(lengths, [run["ratio_to_stock"] for run in single], marker="o", label=f"{system['name']} (measured)")
        axis.plot(
            lengths,
            [run["bound"] for run in single],
            marker="x",
            linestyle=":",
            label=f"{system['name']} equal-bytes bound",
        )
        at_peak = [run.get("bound_at_peak") for run in single]
        if all(value is not None for value in at_peak) and at_peak != [run["bound"] for run in single]:
            axis.plot(
                lengths, at_peak, marker="+", linestyle="--", label=f"{system['name']} bound, a prefill at its peak"
            )
        for run in system["runs"]:
            if run["bound"] is None and run["ratio_to_stock"] is not None:
                axis.axhline(
                    run["ratio_to_stock"],
                    color="tab:green",
                    linestyle="-.",
                    alpha=0.6,
                    label=f"{system['name']} {run['workload']} workload (measured)",
                )
    axis.set_xscale("log", base=2)
    axis.set(
        xlabel="prompt length (tokens)",
        ylabel="peak running requests / stock's",
        title=f"{report['profile']} — {report['date']}",
    )
    axis.grid(True, alpha=0.3)
    axis.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(paths.png, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, choices=sorted(PROFILES))
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))

    date = dt.date.today().isoformat()
    paths = ReportPaths(args.out_dir, f"capacity-{profile.name}-{date}")
    log_dir = args.out_dir / f"{paths.stem}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    model_dir, load_args = prepare_model(profile.server, log_dir)
    shared = shared_server_args(profile.server, model_dir, load_args)
    bytes_per_token = kv_bytes_per_token(model_dir, profile.server.dtype)
    model_config = json.loads((model_dir / "config.json").read_text())
    num_layers = model_config["num_hidden_layers"]

    for stale in log_dir.glob("client-*.jsonl"):
        stale.unlink()
    systems = []
    for system in profile.all_systems():
        tokens = system_tokens(system, profile.server)
        settings = replace(profile.server, max_total_tokens=tokens, kv_cache_dtype=system.kv_dtype)
        mine = kv_value_bytes(profile.server.dtype, system.kv_dtype)
        system_bytes = bytes_per_token * mine // DTYPE_BYTES[profile.server.dtype]
        args = shared_server_args(settings, model_dir, load_args)
        systems.append(measure_system(system, args, profile, log_dir, system_bytes, num_layers))
    report = {
        "profile": profile.name,
        "date": date,
        "description": profile.description,
        "machine": machine(),
        "server_args": args_for_report(shared, model_dir),
        "workloads": [
            {"name": w.name, "length": w.length, "parts": [vars(p) for p in w.parts]} for w in profile.workloads
        ],
        "kv_bytes_per_token": bytes_per_token,
        "systems": systems,
    }
    add_ratios(report, model_config, profile.server.dtype)
    write_json(paths, report)
    paths.markdown.write_text(markdown(report))
    write_plot(paths, report)
    print(paths.markdown.read_text(), flush=True)
    say(f"wrote {paths.json}, {paths.markdown}, {paths.png}")
    return 0 if all(system["error"] is None for system in systems) else 1


if __name__ == "__main__":
    sys.exit(main())
