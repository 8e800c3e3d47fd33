"""Soak: one sparse server under a seeded mix of every kind of request, then checked at rest.

Drives a server with `bench/soak_mix.py`'s requests from concurrent clients (loopback only,
bounded in count and time, a progress bar), then checks what a production server must hold to:

* **nothing lost**: every request ends in an answer, an abort or disconnect the client caused, or
  an HTTP error with a message; a request with no answer by its deadline, or a stream that stops
  without a finish, is *lost*;
* **healthy at the end**: `/health` answers and a fresh request is served;
* **back at rest**: once idle, no heap row is held by a request (`/kvsparse/stats`: every row free
  or cached, every sparse layer's slots empty); after `/flush_cache`, every row free;
* **retractions counted** (SGLang's `sglang:num_retracted_requests_total`, `--enable-metrics`);
* **outputs against stock SGLang**: the greedy single-answer requests that nothing evicted
  (prompt + output within the budget) are sent again, same payload, to a stock server; the
  agreement is reported and each difference traced: the request is re-run alone on both servers
  (agreeing alone means the batch it ran in changed a float reduction), and for token-id prompts
  with stock's top-2 logprobs at the first differing token (a near-tie flips on rounding).

Without `--url` it starts both servers itself: the project's launcher with the default preset at
budget 256 (below the default's 1,024, so that more requests evict), and stock SGLang, with the
same shared arguments (default model, float32, an 8,192-token KV pool so a prompt near the
context length fits, chunked prefill of 512 with mixed chunks, `--enable-metrics`), SGLang's
admission made optimistic (`SGLANG_INIT_NEW_TOKEN_RATIO=0.05`) on the project's so that decoding
requests can outgrow the pool and SGLang retract (how often depends on the heap's rows per byte:
counted, not required).

Writes `<out-dir>/soak-<date>.json` and `.md`; logs in `soak-<date>-logs/`.

Usage: .venv/bin/python bench/soak.py [--requests 500] [--concurrency 32] [--seed 0]
       [--url URL --stock-url URL] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests
from common.report import ReportPaths, provenance_line, write_json
from common.systems import (
    STOCK,
    ServerSettings,
    args_for_report,
    machine,
    prepare_model,
    server_for,
    shared_server_args,
)
from serving_profiles import PROJECT_BUDGET_256
from soak_client import PATHS, REQUEST_TIMEOUT_S, Client, Outcome, parse_whole
from soak_mix import Edges, MixSettings, SoakRequest, build_mix, group_offsets
from tqdm import tqdm

from kvsparse_testbed.texts import essay_text

RESULTS_DIR = Path(__file__).resolve().parent / "results"
SHARED_FLAGS = ("--chunked-prefill-size", "512", "--enable-mixed-chunk", "--enable-metrics")
RETRACTING_ENV = {"SGLANG_INIT_NEW_TOKEN_RATIO": "0.05"}
#: Stock's top-2 logprob gap below which a differing greedy token is a near-tie (nats).
NEAR_TIE = 0.05


def say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class SoakSettings:
    mix: MixSettings
    concurrency: int
    time_limit_s: float


def run_soak(url: str, stock_url: str | None, settings: SoakSettings, tokenizer: Any) -> dict[str, Any]:
    """Drive the server at `url` with the mix, check it at rest, compare with `stock_url`."""
    stats = get_stats(url)
    group = min(stats["heap"]["groups"], key=lambda g: g["budget"])
    model = requests.get(f"{url}/v1/models", timeout=60).json()["data"][0]
    edges = Edges(group["budget"], group["max_entries"], model["max_model_len"])
    text_ids = tokenizer.encode(essay_text(settings.mix.text_tokens * 6))[: settings.mix.text_tokens]
    mix = build_mix(dataclasses.replace(settings.mix, text_tokens=len(text_ids)), edges)
    client = Client(url, model["id"], text_ids, group_offsets(settings.mix), tokenizer)
    retracted_before = retractions(url)
    started = time.monotonic()
    deadline = started + settings.time_limit_s
    outcomes: list[Outcome] = []
    not_sent = 0
    with ThreadPoolExecutor(settings.concurrency) as pool, tqdm(total=len(mix), desc="soak", unit="req") as bar:

        def one(request: SoakRequest) -> list[Outcome] | None:
            try:
                return None if time.monotonic() > deadline else client.run(request)
            finally:
                bar.update()

        for result in pool.map(one, mix):
            if result is None:
                not_sent += 1
            else:
                outcomes.extend(result)
    soak_s = time.monotonic() - started
    rest = check_rest(url)
    rest["retractions"] = retractions(url) - retracted_before
    comparison = None
    if stock_url:
        comparison = compare_with_stock(mix, outcomes, edges, url, stock_url, settings.concurrency, tokenizer)
    for outcome in outcomes:
        outcome.payload = None
    return {
        "edges": dataclasses.asdict(edges) | {"step": edges.step},
        "requests": len(mix),
        "not_sent": not_sent,
        "soak_s": soak_s,
        "mix": describe_mix(mix),
        "outcomes": summarize(outcomes),
        "rest": rest,
        "comparison": comparison,
        "failures": [dataclasses.asdict(o) for o in outcomes if o.status in ("lost", "error")],
    }


def describe_mix(mix: list[SoakRequest]) -> dict[str, Any]:
    lengths = [r.prompt_tokens for r in mix]
    return {
        "kinds": dict(Counter(r.kind for r in mix).most_common()),
        "prompt_tokens_min": min(lengths),
        "prompt_tokens_max": max(lengths),
        "prompt_tokens_mean": sum(lengths) / len(lengths),
        "shared_prefix": sum(r.prefix_group is not None for r in mix),
        "conversation_turns": sum(r.follow_ups for r in mix),
        "n_above_1": sum(r.n > 1 for r in mix),
        "logprobs": sum(r.logprobs for r in mix),
        "stop_strings": sum(bool(r.stop) for r in mix),
        "greedy": sum(r.greedy for r in mix),
    }


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    by_kind: dict[str, Counter] = {}
    for o in outcomes:
        by_kind.setdefault(o.kind, Counter())[o.status] += 1
    return {
        "total": len(outcomes),
        "by_status": dict(Counter(o.status for o in outcomes)),
        "by_kind": {kind: dict(counts) for kind, counts in sorted(by_kind.items())},
        "seconds_max": max((o.seconds for o in outcomes), default=0.0),
    }


def get_stats(url: str) -> dict[str, Any]:
    response = requests.get(f"{url}/kvsparse/stats", timeout=120)
    response.raise_for_status()
    return response.json()


def retractions(url: str) -> int:
    """SGLang's count of retracted requests (0 without `--enable-metrics`)."""
    text = requests.get(f"{url}/metrics", timeout=60).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("sglang:num_retracted_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return int(total)


def check_rest(url: str, idle_timeout_s: float = 300) -> dict[str, Any]:
    """Idle with no heap row held by a request; every row free after a cache flush; healthy."""
    deadline = time.monotonic() + idle_timeout_s
    while (idle := get_stats(url))["requests_running"] and time.monotonic() < deadline:
        time.sleep(1)
    heap = idle["heap"]
    held = {k: heap[k] for k in ("full_running", "sparse", "evicting")}
    idle_ok = (
        idle["requests_running"] == 0
        and not any(held.values())
        and heap["free"] + heap["full_cached"] + heap["prefix_store"] == heap["rows_total"]
        and all(layer["slots_in_use"] == 0 for layer in idle["layers"])
    )
    flush_deadline = time.monotonic() + 60
    while requests.post(f"{url}/flush_cache", timeout=120).status_code == 400 and time.monotonic() < flush_deadline:
        time.sleep(0.5)
    flushed = get_stats(url)["heap"]
    healthy = requests.get(f"{url}/health", timeout=60).status_code == 200
    probe = requests.post(
        f"{url}/generate",
        json={"text": "The capital of France is", "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        timeout=300,
    )
    return {
        "idle_heap": {
            k: heap[k]
            for k in ("rows_total", "free", "full_running", "full_cached", "sparse", "prefix_store", "evicting")
        },
        "requests_running_at_end": idle["requests_running"],
        "idle_ok": idle_ok,
        "flushed_heap_free": flushed["free"],
        "flushed_ok": flushed["free"] == flushed["rows_total"],
        "healthy": healthy and probe.status_code == 200,
        "evictions": idle["evictions"],
        "prefix_hits": idle["prefix_hits"],
        "requests_running_peak": idle["requests_running_peak"],
    }


def comparable(request: SoakRequest, outcome: Outcome, edges: Edges) -> bool:
    """A greedy single answer that nothing evicted: stock's output is the expected one."""
    return (
        outcome.status == "ok"
        and request.greedy
        and request.n == 1
        and outcome.prompt_tokens is not None
        and outcome.prompt_tokens + request.max_new_tokens <= edges.budget
    )


def compare_with_stock(
    mix: list[SoakRequest],
    outcomes: list[Outcome],
    edges: Edges,
    url: str,
    stock_url: str,
    concurrency: int,
    tokenizer: Any,
) -> dict[str, Any]:
    """Send the comparable requests to stock (concurrently, as they ran here) and trace differences."""
    chosen = [o for o in outcomes if comparable(mix[o.index], o, edges)]
    say(f"comparing {len(chosen)} greedy requests within the budget with stock SGLang")
    with ThreadPoolExecutor(concurrency) as pool:
        stock = list(pool.map(lambda o: answer_of(stock_url, mix[o.index].endpoint, o.payload), chosen))
    differences = [
        trace(mix[o.index], o, theirs, url, stock_url, tokenizer)
        for o, theirs in zip(chosen, stock)
        if theirs != o.texts[0]
    ]
    return {
        "compared": len(chosen),
        "agree": len(chosen) - len(differences),
        "differences": differences,
        "causes": dict(Counter(d["cause"] for d in differences)),
    }


def answer_of(url: str, endpoint: str, payload: dict[str, Any]) -> str:
    """The one answer's text of a non-streamed replay of `payload`."""
    body = {**payload, "stream": False}
    body.pop("rid", None)
    body.pop("stream_options", None)
    response = requests.post(url + PATHS[endpoint], json=body, timeout=REQUEST_TIMEOUT_S)
    response.raise_for_status()
    return parse_whole(endpoint, response.json())[0][0]


def trace(request: SoakRequest, ours: Outcome, stock: str, url: str, stock_url: str, tokenizer: Any) -> dict[str, Any]:
    """Why an output differs from stock's: re-run alone on both; if they still differ, find the
    first differing token (the prompt as token ids, a chat's through the model's chat template)
    and stock's top-2 logprob gap there."""
    payload = ours.payload or {}
    alone = [answer_of(u, request.endpoint, payload) for u in (url, stock_url)]
    found: dict[str, Any] = {"index": request.index, "turn": ours.turn, "kind": request.kind}
    found |= {"prompt_tokens": ours.prompt_tokens, "ours": ours.texts[0][:200], "stock": stock[:200]}
    if alone[0] == alone[1]:
        return found | {"cause": "batch composition: equal when each runs alone"}
    position, gap = first_difference(url, stock_url, payload, prompt_token_ids(payload, tokenizer))
    found |= {"first_differing_token": position, "stock_top2_gap": gap}
    near = gap is not None and gap < NEAR_TIE
    return found | {"cause": "near-tie: a rounding difference flips it" if near else "differs alone: a defect"}


def prompt_token_ids(payload: dict[str, Any], tokenizer: Any) -> list[int]:
    """The prompt of a request as the model sees it."""
    if "messages" in payload:
        text = tokenizer.apply_chat_template(payload["messages"], add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    return payload.get("input_ids") or payload["prompt"]


def first_difference(
    url: str, stock_url: str, payload: dict[str, Any], ids: list[int]
) -> tuple[int | None, float | None]:
    """The first output token where the two servers differ, and stock's top-2 gap there."""
    max_new = payload.get("max_tokens") or payload.get("sampling_params", {}).get("max_new_tokens")
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": max_new, "temperature": 0},
        "return_logprob": True,
        "top_logprobs_num": 2,
    }
    runs = [
        requests.post(f"{u}/generate", json=body, timeout=REQUEST_TIMEOUT_S).json()["meta_info"]
        for u in (url, stock_url)
    ]
    ours, theirs = (meta["output_token_logprobs"] for meta in runs)
    for position, (a, b) in enumerate(zip(ours, theirs)):
        if a[1] != b[1]:
            top = runs[1]["output_top_logprobs"][position]
            return position, (top[0][0] - top[1][0]) if len(top) > 1 else None
    return None, None


def markdown(report: dict[str, Any]) -> str:
    soak, rest, cmp_ = report["soak"], report["soak"]["rest"], report["soak"]["comparison"]
    statuses = soak["outcomes"]["by_status"]
    mix = soak["mix"]
    lines = [
        f"# Soak ({report['date']})",
        provenance_line(report),
        "",
        f"Machine: {report['machine']}. Server: `{report['server']}`.",
        f"Mix: {soak['requests']} requests (seed {report['settings']['seed']}), {report['settings']['concurrency']} "
        f"concurrent clients, prompts {mix['prompt_tokens_min']}-{mix['prompt_tokens_max']} tokens (mean "
        f"{mix['prompt_tokens_mean']:.0f}); edges {soak['edges']}. {mix['shared_prefix']} share a prefix, "
        f"{mix['conversation_turns']} conversation follow-ups, {mix['n_above_1']} with n > 1, {mix['logprobs']} with "
        f"logprobs, {mix['stop_strings']} with stop strings, {mix['greedy']} greedy. Ran {soak['soak_s']:.0f} s; "
        f"{soak['not_sent']} not sent (time limit).",
        "",
        "## Outcomes",
        "",
        f"{soak['outcomes']['total']} answers (requests and conversation turns): "
        + ", ".join(f"{count} {status}" for status, count in sorted(statuses.items()))
        + f"; slowest {soak['outcomes']['seconds_max']:.0f} s.",
        "",
        "| kind | " + " | ".join(("ok", "aborted", "disconnected", "error", "lost")) + " |",
        "|---|---|---|---|---|---|",
        *[
            f"| {kind} | "
            + " | ".join(str(c.get(s, 0)) for s in ("ok", "aborted", "disconnected", "error", "lost"))
            + " |"
            for kind, c in soak["outcomes"]["by_kind"].items()
        ],
        "",
        "## At rest",
        "",
        f"Idle: {rest['requests_running_at_end']} running, heap {rest['idle_heap']} -> "
        f"{'every row free or cached' if rest['idle_ok'] else 'ROWS STILL HELD'}; after `/flush_cache` "
        f"{rest['flushed_heap_free']} of {rest['idle_heap']['rows_total']} rows free "
        f"({'all' if rest['flushed_ok'] else 'NOT ALL'}). Healthy: {rest['healthy']}. Retractions: "
        f"{rest['retractions']}; evictions {rest['evictions']}; prefix hits {rest['prefix_hits']}; peak "
        f"{rest['requests_running_peak']} running.",
        "",
    ]
    if cmp_ is not None:
        lines += [
            "## Against stock SGLang",
            "",
            f"{cmp_['agree']} of {cmp_['compared']} greedy requests within the budget gave stock's output. "
            f"Causes of the differences: {cmp_['causes'] or 'none'}.",
            "",
        ]
        lines += [
            f"- request {d['index']} turn {d['turn']} ({d['kind']}, {d['prompt_tokens']} prompt tokens): {d['cause']}"
            + (
                f"; first differing token {d['first_differing_token']}, stock's top-2 gap {d['stock_top2_gap']}"
                if "stock_top2_gap" in d
                else ""
            )
            for d in cmp_["differences"]
        ]
    if soak["failures"]:
        lines += ["", "## Errors and lost requests", ""]
        lines += [
            f"- request {f['index']} turn {f['turn']} ({f['kind']}): {f['status']} {f['http_status']} {f['message']}"
            for f in soak["failures"]
        ]
    return "\n".join(lines) + "\n"


def soak_passed(soak: dict[str, Any]) -> bool:
    """Nothing lost, at rest, healthy, and no difference from stock that is a defect."""
    rest, comparison = soak["rest"], soak["comparison"] or {"differences": []}
    defects = [d for d in comparison["differences"] if d["cause"].startswith("differs alone")]
    return (
        not soak["outcomes"]["by_status"].get("lost")
        and rest["idle_ok"]
        and rest["flushed_ok"]
        and rest["healthy"]
        and not defects
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-prompt-tokens", type=int, default=7800)
    parser.add_argument("--max-total-tokens", type=int, default=8192)
    parser.add_argument("--time-limit-s", type=float, default=3600)
    parser.add_argument("--url", help="a running sparse server (with --enable-metrics); default: start one")
    parser.add_argument("--stock-url", help="a running stock server to compare with; default: start one")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    date = dt.date.today().isoformat()
    paths = ReportPaths(args.out_dir, f"soak-{date}")
    log_dir = args.out_dir / f"soak-{date}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = ServerSettings("default", "auto", "float32", args.max_total_tokens, None, 40, 900.0)
    model_dir, load_args = prepare_model(settings, log_dir)
    shared = [*shared_server_args(settings, model_dir, load_args), *SHARED_FLAGS]
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    mix = MixSettings(args.requests, args.max_prompt_tokens, text_tokens=args.max_prompt_tokens * 3, seed=args.seed)
    soak_settings = SoakSettings(mix, args.concurrency, args.time_limit_s)
    command = " ".join(
        ["python -m sglang_kvsparse.launch_server", *args_for_report(shared, model_dir), *PROJECT_BUDGET_256]
    )
    served_by = command if args.url is None else f"the server at {args.url} (given)"
    with ExitStack() as stack:
        url, stock_url = args.url, args.stock_url
        if url is None or stock_url is None:
            project = server_for("project", PROJECT_BUDGET_256, shared, settings, log_dir, say)
            project = dataclasses.replace(project, env={**project.env, **RETRACTING_ENV})
            stock = server_for(STOCK, (), shared, settings, log_dir, say)
            started = [s for s, given in ((project, url), (stock, stock_url)) if given is None]
            for process in started:
                process.launch()
                stack.callback(process.stop)
            for process in started:
                process.wait_ready()
            url, stock_url = url or project.base_url, stock_url or stock.base_url
        soak = run_soak(url, stock_url, soak_settings, tokenizer)
    report = {
        "date": date,
        "machine": machine(),
        "server": served_by,
        "env": RETRACTING_ENV if args.url is None else {},
        "settings": {"seed": args.seed, "concurrency": args.concurrency, "max_prompt_tokens": args.max_prompt_tokens},
        "soak": soak,
        "passed": soak_passed(soak),
    }
    write_json(paths, report)
    paths.markdown.write_text(markdown(report))
    say(f"wrote {paths.json} and {paths.markdown}; passed: {report['passed']}")
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
