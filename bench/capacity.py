"""Capacity benchmark: at a fixed KV pool, how many requests of one length run at once.

Why: sparsity keeps fewer KV entries per request, so the same memory should admit more requests.
For each system (stock SGLang, then each project variant) this starts the server with the same
``--max-total-tokens``, sends more requests at once than the dense pool can hold (SGLang's own
client, all at one max concurrency), and reports the most requests that ran at once (the
server's ``#running-req`` log lines), the dense pool's own limit for comparison, and the KV bytes
per request and per layer: from the server's ``GET /kvsparse/stats`` when it answers, else dense.
Writes ``<out-dir>/capacity-<profile>-<date>.json`` and ``.md``; logs in ``...-logs/``.

Usage: .venv/bin/python bench/capacity.py --profile NAME [--out-dir DIR]   (names: PROFILES)
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.client import ClientError, KvStatsPoller, Workload, run_client
from common.models import kv_bytes_per_token
from common.report import ReportPaths, write_json
from common.server import ServerStartError, peak_running_requests
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
from serving_profiles import PROJECT_BUDGET_256, PROJECT_DEFAULT, PROJECT_OFF, Variant

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass(frozen=True)
class CapacityProfile:
    """A fixed pool and request length; ``num_requests`` should exceed the dense pool's limit."""

    name: str
    description: str
    server: ServerSettings
    input_len: int
    output_len: int
    num_requests: int
    variants: tuple[Variant, ...]
    client_timeout_s: float
    seed: int = 1

    @property
    def dense_limit(self) -> int:
        """Requests a dense pool can hold at their final length (before SGLang's reserves)."""
        return self.server.max_total_tokens // (self.input_len + self.output_len)


def _cpu_server(max_total_tokens: int) -> ServerSettings:
    return ServerSettings(model="default", device="cpu", dtype="float32",
                          max_total_tokens=max_total_tokens, mem_fraction_static=None,
                          decode_log_interval=1, startup_timeout_s=900.0)


PROFILES: dict[str, CapacityProfile] = {
    profile.name: profile
    for profile in (
        CapacityProfile(
            name="smoke",
            description="Tiny capacity check: 10 requests of 300 + 32 tokens into a "
            "2,048-token pool.",
            server=_cpu_server(2048),
            input_len=300,
            output_len=32,
            num_requests=10,
            variants=(Variant("project", PROJECT_OFF),),
            client_timeout_s=600.0,
        ),
        CapacityProfile(
            name="sparse-4k",
            description="Sparse capacity check (run by the test suite): 8 requests of 4,000 + "
            "32 tokens into the KV bytes of an 8,192-token dense pool (2 dense requests).",
            server=_cpu_server(8192),
            input_len=4000,
            output_len=32,
            num_requests=8,
            variants=(Variant("budget-256", PROJECT_BUDGET_256),),
            client_timeout_s=1200.0,
        ),
        CapacityProfile(
            name="cpu",
            description="Default model on the CPU: 24 requests of 2,000 + 128 tokens into the KV "
            "bytes of a 16,384-token dense pool (7 dense requests).",
            server=_cpu_server(16384),
            input_len=2000,
            output_len=128,
            num_requests=24,
            variants=(Variant("default", PROJECT_DEFAULT), Variant("budget-256", PROJECT_BUDGET_256)),
            client_timeout_s=3600.0,
        ),
    )
}


def say(message: str) -> None:
    print(f"[capacity] {message}", flush=True)


def measure_system(name: str, flags: tuple[str, ...], shared: list[str],
                   profile: CapacityProfile, log_dir: Path, bytes_per_token: int,
                   num_layers: int) -> dict[str, Any]:
    """One system: start, send every request at once, read the peak, stop."""
    row: dict[str, Any] = {"name": name, "launcher": launcher_of(name), "flags": list(flags),
                           "error": None}
    workload = Workload(profile.input_len, profile.output_len, profile.num_requests,
                        profile.num_requests, profile.seed)
    dense_bytes = (profile.input_len + profile.output_len) * bytes_per_token
    try:
        with server_for(name, flags, shared, profile.server, log_dir, say) as server:
            bookmark = server.log_size()
            with KvStatsPoller(server.base_url) as poller:
                result = run_client(server.base_url, workload,
                                    result_file=log_dir / f"client-{name}.jsonl",
                                    log_path=log_dir / f"client-{name}.log",
                                    timeout_s=profile.client_timeout_s)
            kv_bytes, source = poller.bytes_per_request(dense_bytes)
            layer_token_bytes = bytes_per_token / num_layers
            per_layer = {kind: slots * layer_token_bytes
                         for kind, slots in poller.layer_slots_per_request.items()}
            row.update(
                completed=result["completed"],
                peak_running=peak_running_requests(server.log_since(bookmark)),
                kv_bytes_per_request=kv_bytes,
                kv_bytes_per_request_per_layer=per_layer or {"every": kv_bytes / num_layers},
                kv_bytes_source=source,
            )
    except (ServerStartError, ClientError) as exc:
        say(f"[{name}] failed: {exc}")
        row["error"] = str(exc).splitlines()[0]
    return row


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Capacity `{report['profile']}` — {report['date']}",
        "",
        report["description"],
        "",
        f"- Machine: {report['machine']}",
        f"- Server arguments (all systems): `{' '.join(report['server_args'])}`",
        f"- {report['num_requests']} requests of {report['input_len']:,} + "
        f"{report['output_len']:,} tokens sent at once; a dense pool holds "
        f"{report['dense_limit']} at their final length",
        "",
        "| system | flags | peak running req | ratio to stock | KV bytes/req | "
        "KV bytes/req per layer (by kind) | KV source |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    stock_peak = next((s.get("peak_running") for s in report["systems"] if s["name"] == STOCK),
                      None)
    for system in report["systems"]:
        if system["error"]:
            lines.append(f"| {system['name']} | {' '.join(system['flags'])} | "
                         f"failed: {system['error']} | | | | |")
            continue
        peak = system["peak_running"]
        ratio = f"{peak / stock_peak:.2f}" if peak is not None and stock_peak else "—"
        per_layer = ", ".join(f"{kind} {value:,.0f}"
                              for kind, value in system["kv_bytes_per_request_per_layer"].items())
        lines.append(
            f"| {system['name']} | {' '.join(system['flags']) or '(stock)'} | "
            f"{peak if peak is not None else '—'} | {ratio} | "
            f"{system['kv_bytes_per_request']:,.0f} | {per_layer} | {system['kv_bytes_source']} |")
    lines += [
        "",
        "Peak running requests: the most requests holding KV at once in the server's scheduler "
        "log. SGLang may admit fewer than the dense limit: it reserves room for the running "
        "requests' future tokens. KV bytes per request are measured at the moment they peaked "
        "(K+V, and the sparse slots' scores); per layer, the mean over the layers of each kind. "
        "Sparse servers get the same KV bytes as stock (--max-total-tokens counts dense tokens).",
    ]
    return "\n".join(lines) + "\n"


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
    num_layers = json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]

    systems = []
    for name, flags in [(STOCK, ()), *((v.name, v.flags) for v in profile.variants)]:
        (log_dir / f"client-{name}.jsonl").unlink(missing_ok=True)
        systems.append(measure_system(name, flags, shared, profile, log_dir, bytes_per_token,
                                      num_layers))
    report = {
        "profile": profile.name,
        "date": date,
        "description": profile.description,
        "machine": machine(),
        "server_args": args_for_report(shared, model_dir),
        "input_len": profile.input_len,
        "output_len": profile.output_len,
        "num_requests": profile.num_requests,
        "dense_limit": profile.dense_limit,
        "kv_bytes_per_token": bytes_per_token,
        "systems": systems,
    }
    write_json(paths, report)
    paths.markdown.write_text(markdown(report))
    print(paths.markdown.read_text(), flush=True)
    say(f"wrote {paths.json}, {paths.markdown}")
    return 0 if all(system["error"] is None for system in systems) else 1


if __name__ == "__main__":
    sys.exit(main())
