"""Serving benchmark: stock SGLang vs the project, same model, KV memory and workload, one run.

For each system in turn (stock first, then each variant of the profile: the project's launcher,
or stock with another KV cache): start its server, wait for /health, run
``python -m sglang.benchmark.serving`` once per max concurrency, read the peak of running requests
from the server's log, stop the server and all its processes. Then write
``<out-dir>/<profile>-<date>.json``, ``.md`` and ``.png`` with the ratio to stock for every
metric (and to each other stock system of the profile). The report is rewritten after each
system, so a failure late in the run keeps what was measured. Server and client logs go to
``<profile>-<date>-logs/``.

Usage:
  .venv/bin/python bench/serving.py --profile cpu-quick
  .venv/bin/python bench/serving.py --profile gpu-novita [--dry-run]
  .venv/bin/python bench/serving.py --profile cpu-quick --project-flags "--kvsparse-preset default"
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import os
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

from common.client import ClientError, KvStatsPoller, Workload, run_client
from common.models import DTYPE_BYTES, kv_bytes_per_token, kv_value_bytes, tokens_at_equal_bytes
from common.report import (
    ReportPaths,
    ratio_rows,
    write_json,
    write_markdown,
    write_plot,
)
from common.systems import (
    STOCK,
    args_for_report,
    launcher_of,
    machine,
    prepare_model,
    server_for,
    shared_server_args,
)
from serving_profiles import PROFILES, Profile, Variant

from kvsparse_testbed.server import ServerProcess, ServerStartError, peak_running_requests

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def say(message: str) -> None:
    print(f"[bench] {message}", flush=True)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", required=True, choices=sorted(PROFILES))
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--dry-run", action="store_true", help="run the profile at tiny sizes on the CPU (checks the script)"
    )
    parser.add_argument(
        "--project-flags",
        metavar="FLAGS",
        help="replace the profile's project variants with one, using these "
        '--kvsparse-* flags (quoted, e.g. "--kvsparse-preset default")',
    )
    return parser.parse_args(argv)


def resolve_profile(args: argparse.Namespace) -> Profile:
    profile = PROFILES[args.profile]
    if args.dry_run:
        profile = profile.dry_run()
    if args.project_flags is not None:
        variant = Variant("project", tuple(shlex.split(args.project_flags)))
        profile = dataclasses.replace(profile, variants=(variant,))
    return profile


def measure(
    server: ServerProcess, profile: Profile, concurrency: int, log_dir: Path, dense_bytes_per_request: int
) -> dict[str, Any]:
    """One client run at one concurrency, as a report row."""
    workload = Workload(
        profile.input_len,
        profile.output_len,
        profile.num_prompts(concurrency),
        concurrency,
        profile.seed,
        profile.shared_prefix,
    )
    say(
        f"[{server.name}] concurrency {concurrency}: {workload.num_prompts} prompts of "
        f"{profile.prompt_len} in / {workload.output_len} out"
    )
    bookmark = server.log_size()
    load_before = os.getloadavg()[0]
    with KvStatsPoller(server.base_url) as poller:
        result = run_client(
            server.base_url,
            workload,
            result_file=log_dir / f"client-{server.name}.jsonl",
            log_path=log_dir / f"client-{server.name}-c{concurrency}.log",
            timeout_s=profile.client_timeout_s,
        )
    kv_bytes, kv_source = poller.bytes_per_request(dense_bytes_per_request)
    return {
        "concurrency": concurrency,
        "num_prompts": workload.num_prompts,
        "completed": result["completed"],
        "duration_s": result["duration"],
        "output_tok_s": result["output_throughput"],
        "total_tok_s": result["total_throughput"],
        "ttft_median_ms": result["median_ttft_ms"],
        "ttft_p99_ms": result["p99_ttft_ms"],
        "itl_median_ms": result["median_itl_ms"],
        "peak_running": peak_running_requests(server.log_since(bookmark)),
        "kv_bytes_per_request": kv_bytes,
        "kv_bytes_source": kv_source,
        # Other work on the machine (1-minute load average at start and end of the level):
        # above the number of cores means something else competed for the CPU.
        "load_avg": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "client": result,
    }


def run_system(
    variant: Variant, model_dir: Path, load_args: list[str], profile: Profile, log_dir: Path, bytes_per_token: int
) -> dict[str, Any]:
    """Start one system (its KV cache at the profile's KV bytes), sweep the concurrencies, stop it;
    errors are recorded, not raised."""
    base = profile.server_settings()
    settings = dataclasses.replace(
        base,
        kv_cache_dtype=variant.kv_dtype,
        max_total_tokens=tokens_at_equal_bytes(base.max_total_tokens, base.dtype, variant.kv_dtype),
    )
    dense_per_token = bytes_per_token * kv_value_bytes(base.dtype, variant.kv_dtype) // DTYPE_BYTES[base.dtype]
    dense_per_request = (profile.prompt_len + profile.output_len) * dense_per_token
    system: dict[str, Any] = {
        "name": variant.name,
        "launcher": launcher_of(variant.name, variant.stock),
        "flags": list(variant.flags),
        "kv_dtype": variant.kv_dtype,
        "max_total_tokens": settings.max_total_tokens,
        "startup_s": None,
        "error": None,
        "runs": [],
    }
    shared = shared_server_args(settings, model_dir, load_args)
    server = server_for(variant.name, variant.flags, shared, settings, log_dir, say, stock=variant.stock)
    try:
        with server:
            system["startup_s"] = server.startup_s
            for concurrency in profile.concurrencies:
                system["runs"].append(measure(server, profile, concurrency, log_dir, dense_per_request))
    except (ServerStartError, ClientError) as exc:
        say(f"[{variant.name}] failed: {exc}")
        system["error"] = str(exc).splitlines()[0]
    return system


def stock_systems(profile: Profile) -> list[str]:
    """The stock systems of a run, the baselines of its ratios: stock, then the profile's own."""
    return [STOCK, *(variant.name for variant in profile.variants if variant.stock)]


def build_report(
    profile: Profile, date: str, model_dir: Path, shared: list[str], bytes_per_token: int, systems: list[dict[str, Any]]
) -> dict[str, Any]:
    baselines = stock_systems(profile)
    return {
        "profile": profile.name,
        "date": date,
        "description": profile.description,
        "machine": machine(),
        "settings": {
            "model": profile.model if profile.model != "default" else model_dir.name,
            "dtype": profile.dtype,
            "kv_bytes_per_token": bytes_per_token,
            "input_len": profile.input_len,
            "output_len": profile.output_len,
            "shared_prefix": dataclasses.asdict(profile.shared_prefix) if profile.shared_prefix else None,
            "seed": profile.seed,
            "server_args": args_for_report(shared, model_dir),
        },
        "baseline": STOCK,
        "systems": systems,
        "ratios": [
            row | {"baseline": baseline}
            for baseline in baselines
            for row in ratio_rows(systems, baseline)
            if baseline == STOCK or row["system"] not in baselines
        ],
        "notes": [
            "Peak running requests: the most requests holding KV at once in the server's "
            "scheduler log during that run (decode lines; prefill lines count the batch's new "
            "sequences too).",
            "KV bytes/request: from the project server's GET /kvsparse/stats (largest "
            "kv_bytes_in_use / requests_running seen, polled every second) when it answers; "
            "otherwise, and always for stock, the dense figure (input + output tokens) × "
            "dense bytes per token. The KV source column says which.",
            "The systems ran in turn on the same machine in this run; the benchmark client "
            "shares the machine with the server.",
        ],
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    profile = resolve_profile(args)
    # SIGTERM must unwind through the servers' context managers like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    date = dt.date.today().isoformat()
    paths = ReportPaths(args.out_dir, f"{profile.name}-{date}")
    log_dir = args.out_dir / f"{paths.stem}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)

    settings = profile.server_settings()
    model_dir, load_args = prepare_model(settings, log_dir)
    shared = shared_server_args(settings, model_dir, load_args)
    bytes_per_token = kv_bytes_per_token(model_dir, profile.dtype)
    say(
        f"profile {profile.name}: {len(profile.variants) + 1} systems × "
        f"{len(profile.concurrencies)} concurrencies; logs in {log_dir}"
    )

    systems: list[dict[str, Any]] = []
    for variant in (Variant(STOCK, stock=True), *profile.variants):
        (log_dir / f"client-{variant.name}.jsonl").unlink(missing_ok=True)
        systems.append(run_system(variant, model_dir, load_args, profile, log_dir, bytes_per_token))
        report = build_report(profile, date, model_dir, shared, bytes_per_token, systems)
        write_json(paths, report)
        write_markdown(paths, report)
    write_plot(paths, report)
    print(paths.markdown.read_text(), flush=True)
    say(f"wrote {paths.json}, {paths.markdown}, {paths.png}")
    return 0 if all(system["error"] is None for system in systems) else 1


if __name__ == "__main__":
    sys.exit(main())
