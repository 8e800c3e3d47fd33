"""A plain request beside the most expensive requests the server allows, against the same request
alone: what one client's per-request settings can cost another (issue 37).

One project server (the default preset, the embedded model; a GPU if this machine has one). Each
round sends, in turn:
- the plain request alone;
- the plain request with `--neighbours` plain requests beside it (the load alone);
- the plain request with as many neighbours, each with its own most expensive allowed setting:
  the smallest budget (sink + window: every prefill compresses, a guided one where the preset
  guides), and the policies a request may choose by default with every knob at its upper bound
  (`sglang_kvsparse.policies`), each distinct, up to the server's `max_distinct_settings`
  (those with knobs first, then tova, which scores with attention, then the rest).
The plain request's latency (end to end) per scenario is the median over rounds; the report gives
its ratios to alone (target at most 3x) and to beside-plain (what the settings add to the load),
and the server's counts of what the settings cost (scoring passes per prefill, evictions per
decode step, admissions put off). Writes `<out-dir>/<stem>.json` and `.md`.

    .venv/bin/python bench/request_bounds.py            # ~3 min on 2 CPU cores
    .venv/bin/python bench/request_bounds.py --small    # the test's size
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
from common.checkout import ROOT, importable
from common.report import ReportPaths, provenance, provenance_line, write_json
from common.systems import (
    ServerSettings,
    args_for_report,
    machine,
    prepare_model,
    server_for,
    shared_server_args,
)

importable()

from kvsparse_testbed.texts import essay_text  # noqa: E402
from sglang_kvsparse.config import PRESETS  # noqa: E402
from sglang_kvsparse.policies.snapkv import WIDEST_POOL  # noqa: E402
from sglang_kvsparse.policies.span import LONGEST_FOLLOW  # noqa: E402

#: Characters per token of the essays in SmolLM2's tokenizer, roughly: prompt sizes are given in tokens.
CHARS_PER_TOKEN = 4.4


def expensive_settings(preset: str) -> list[dict[str, Any]]:
    """The most expensive own settings a request may give on a server of `preset`, distinct, as
    many as it runs at once: the smallest budget, each allowed policy with its knobs at their
    upper bounds."""
    config = PRESETS[preset]
    knobs = {
        "snapkv": {"pool_kind": "avg", "pool_kernel": WIDEST_POOL},
        "span": {"long_follow": LONGEST_FOLLOW},
    }
    dearest_first = sorted(config.request_policies, key=lambda name: (name not in knobs, name != "tova", name))
    settings = [{"budget": config.protected, "policy": {"name": name, **knobs.get(name, {})}} for name in dearest_first]
    return settings[: config.max_distinct_settings]


def prompt(tokens: int, offset: int) -> str:
    """About `tokens` tokens of essay text starting `offset` characters in (distinct prompts
    share no prefix), and a question."""
    chars = int(tokens * CHARS_PER_TOKEN)
    text = essay_text(offset + chars)[offset : offset + chars]
    return text + "\n\nQuestion: what is the text above about?\nAnswer:"


def timed_generate(url: str, text: str, new_tokens: int, custom_params: dict[str, Any] | None) -> dict[str, Any]:
    sampling: dict[str, Any] = {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}
    if custom_params is not None:
        sampling["custom_params"] = custom_params
    start = time.monotonic()
    response = requests.post(f"{url}/generate", json={"text": text, "sampling_params": sampling}, timeout=1800)
    seconds = time.monotonic() - start
    response.raise_for_status()
    return {"seconds": seconds, "prompt_tokens": response.json()["meta_info"]["prompt_tokens"]}


def scenario(url: str, plain: str, neighbours: list[tuple[str, dict[str, Any] | None]], new_tokens: int) -> float:
    """The plain request's latency with `neighbours` (text, custom_params) sent at the same time."""
    with ThreadPoolExecutor(1 + len(neighbours)) as pool:
        mine = pool.submit(timed_generate, url, plain, new_tokens, None)
        others = [pool.submit(timed_generate, url, text, new_tokens, custom) for text, custom in neighbours]
        for other in others:
            other.result()
        return mine.result()["seconds"]


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = ServerSettings("default", "auto", "float32", None, None, 1, 900.0)
    expensive = expensive_settings(args.preset)
    plain_text = prompt(args.plain_tokens, 0)
    texts = [prompt(args.neighbour_tokens, 20_000 * (i + 1)) for i in range(len(expensive))]
    with tempfile.TemporaryDirectory() as work:
        model_dir, load_args = prepare_model(settings, Path(work))
        shared = shared_server_args(settings, model_dir, load_args)
        flags = ("--kvsparse-preset", args.preset)
        with server_for("project", flags, shared, settings, Path(work), print) as server:
            url = server.base_url
            timed_generate(url, plain_text, 2, None)  # warm-up
            before = requests.get(f"{url}/kvsparse/stats", timeout=60).json()
            rounds: dict[str, list[float]] = {"alone": [], "beside_plain": [], "beside_expensive": []}
            for number in range(args.rounds):
                rounds["alone"].append(scenario(url, plain_text, [], args.new_tokens))
                plain_neighbours = [(text, None) for text in texts]
                rounds["beside_plain"].append(scenario(url, plain_text, plain_neighbours, args.new_tokens))
                costly = [(text, {"kvsparse": setting}) for text, setting in zip(texts, expensive)]
                rounds["beside_expensive"].append(scenario(url, plain_text, costly, args.new_tokens))
                latest = ", ".join(f"{name} {values[-1]:.2f} s" for name, values in rounds.items())
                print(f"round {number + 1}/{args.rounds}: {latest}")
            after = requests.get(f"{url}/kvsparse/stats", timeout=60).json()
    median = {name: statistics.median(values) for name, values in rounds.items()}
    return {
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "provenance": provenance(sys.argv),
        "settings": {
            "preset": args.preset,
            "plain_tokens": args.plain_tokens,
            "neighbour_tokens": args.neighbour_tokens,
            "new_tokens": args.new_tokens,
            "rounds": args.rounds,
            "server_args": [*flags, *args_for_report(shared, model_dir)],
            "expensive_settings": expensive,
            "max_distinct_settings": PRESETS[args.preset].max_distinct_settings,
        },
        "seconds": rounds,
        "median_seconds": median,
        "ratio_to_alone": {
            "beside_plain": median["beside_plain"] / median["alone"],
            "beside_expensive": median["beside_expensive"] / median["alone"],
        },
        "ratio_expensive_to_plain_neighbours": median["beside_expensive"] / median["beside_plain"],
        "server_counts": {
            "scoring_passes_peak": after["scoring_passes_peak"],
            "evictions_per_step_peak": after["evictions_per_step_peak"],
            "setting_waits": after["setting_waits"] - before["setting_waits"],
        },
    }


def markdown(report: dict[str, Any]) -> str:
    s, median, ratio = report["settings"], report["median_seconds"], report["ratio_to_alone"]
    counts = report["server_counts"]
    lines = [
        f"# A plain request beside the most expensive allowed requests ({report['date']})",
        "",
        provenance_line(report),
        f"- Machine: {report['machine']}",
        f"- Server: preset `{s['preset']}`, `{' '.join(s['server_args'])}`",
        f"- Plain request: ~{s['plain_tokens']} tokens in, {s['new_tokens']} out; "
        f"{len(s['expensive_settings'])} neighbours of ~{s['neighbour_tokens']} tokens; median of {s['rounds']} rounds",
        "- Expensive neighbours' settings: " + "; ".join(f"`{x}`" for x in s["expensive_settings"]),
        "",
        "| plain request | latency s (median) | ratio to alone |",
        "|---|---:|---:|",
        f"| alone | {median['alone']:.2f} | 1.00 |",
        f"| beside plain neighbours | {median['beside_plain']:.2f} | {ratio['beside_plain']:.2f} |",
        f"| beside the most expensive allowed neighbours | {median['beside_expensive']:.2f} | "
        f"{ratio['beside_expensive']:.2f} |",
        "",
        f"Expensive neighbours against plain ones: {report['ratio_expensive_to_plain_neighbours']:.2f}x "
        "(what their settings add to their load). Target: at most 3x alone.",
        "",
        f"Server counts: at most {counts['scoring_passes_peak']} scoring passes in one prefill, "
        f"{counts['evictions_per_step_peak']} evictions in one decode step; "
        f"{counts['setting_waits']} admissions put off for a setting one too many "
        f"(limit {s['max_distinct_settings']} distinct own settings).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="default")
    parser.add_argument("--plain-tokens", type=int, default=1500)
    parser.add_argument("--neighbour-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="one round of short prompts (the test's size)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--stem", default=f"request-bounds-{dt.date.today().isoformat()}")
    args = parser.parse_args()
    if args.small:
        args.plain_tokens, args.neighbour_tokens, args.new_tokens, args.rounds = 300, 120, 8, 1
    report = run(args)
    paths = ReportPaths(args.out_dir, args.stem)
    write_json(paths, report)
    paths.markdown.write_text(markdown(report))
    ratio = report["ratio_to_alone"]["beside_expensive"]
    print(f"plain request beside the most expensive allowed: {ratio:.2f}x alone; report {paths.markdown}")


if __name__ == "__main__":
    main()
