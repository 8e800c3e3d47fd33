"""Long prompts and conversations, project against stock SGLang with the same chunked prefill.

Two workloads, each run on stock SGLang and on the project's launcher started with the same shared
arguments (model, KV pool, `--chunked-prefill-size`, `--enable-mixed-chunk`, `--enable-cache-report`):

* ``multi-turn``: several users at once, each holding a conversation of several turns through
  ``/v1/chat/completions`` (streamed, greedy): turn 1 is a long document and a question, every
  later turn's prompt is the whole history plus a new question. Reported: throughput (output and
  total tokens/s over the run), TTFT per turn, and SGLang's ``cached_tokens`` per turn beside the
  previous turn's prompt length (how much of the conversation was reused).
* ``long-beside-decoders``: several requests decoding (streamed) when a prompt near the context
  length arrives; its prefill runs in chunks beside their decode steps. Reported: the decoders'
  inter-token latencies (median, P99, max) and the long prompt's TTFT.

Writes ``<out-dir>/conversations-<profile>-<date>.json`` and ``.md``; logs in ``...-logs/``.

Usage: .venv/bin/python bench/conversations.py [--profile cpu|smoke] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
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
from serving_profiles import PROJECT_DEFAULT

from kvsparse_testbed.server import ServerProcess, ServerStartError
from kvsparse_testbed.texts import essay_text

RESULTS_DIR = Path(__file__).resolve().parent / "results"
QUESTIONS = (
    "Summarise the text above in two sentences.",
    "Which claim in it is the most surprising, and why?",
    "Give the text a title.",
    "What would the author say to a sceptic?",
    "List three words that describe its tone.",
)


@dataclass(frozen=True)
class Profile:
    """Sizes of both workloads; the rest is shared by the two systems."""

    name: str
    chunk: int
    max_total_tokens: int
    users: int
    turns: int
    document_chars: int
    answer_tokens: int
    decoders: int
    decoder_prompt_chars: int
    decoder_tokens: int
    long_prompt_chars: int
    long_delay_s: float


PROFILES = {
    "cpu": Profile("cpu", 512, 16384, 4, 4, 5000, 48, 4, 800, 192, 31000, 3.0),
    "smoke": Profile("smoke", 512, 8192, 2, 2, 2500, 8, 2, 400, 16, 3000, 0.5),
}


def say(message: str) -> None:
    print(f"[conversations] {message}", file=sys.stderr, flush=True)


def stream_chat(base_url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed, greedy chat completion: its text, token arrival times, usage and TTFT."""
    start = time.perf_counter()
    arrivals: list[float] = []
    text, usage = [], {}
    with requests.post(
        f"{base_url}/v1/chat/completions",
        json={
            "model": "default",
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        stream=True,
        timeout=1800,
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                delta = choice.get("delta", {}).get("content")
                if delta:
                    arrivals.append(time.perf_counter())
                    text.append(delta)
    return {
        "text": "".join(text),
        "ttft_s": (arrivals[0] - start) if arrivals else None,
        "itl_s": [b - a for a, b in zip(arrivals, arrivals[1:])],
        "prompt_tokens": usage.get("prompt_tokens", 0),
        "completion_tokens": usage.get("completion_tokens", 0),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
    }


def multi_turn(base_url: str, profile: Profile) -> dict[str, Any]:
    """Every user's conversation, users concurrently; per-turn TTFT and reuse, throughput."""
    essays = essay_text(profile.document_chars * (profile.users + 1))

    def conversation(user: int) -> list[dict[str, Any]]:
        document = essays[user * profile.document_chars : (user + 1) * profile.document_chars]
        messages = [{"role": "user", "content": f"{document}\n\n{QUESTIONS[0]}"}]
        turns = []
        for turn in range(profile.turns):
            result = stream_chat(base_url, messages, profile.answer_tokens)
            turns.append({k: v for k, v in result.items() if k not in ("text", "itl_s")})
            messages.append({"role": "assistant", "content": result["text"]})
            messages.append({"role": "user", "content": QUESTIONS[(turn + 1) % len(QUESTIONS)]})
        return turns

    start = time.perf_counter()
    with ThreadPoolExecutor(profile.users) as pool:
        users = list(pool.map(conversation, range(profile.users)))
    duration = time.perf_counter() - start
    output = sum(t["completion_tokens"] for turns in users for t in turns)
    prompt = sum(t["prompt_tokens"] for turns in users for t in turns)
    per_turn = []
    for k in range(profile.turns):
        turns = [user[k] for user in users]
        previous = [user[k - 1]["prompt_tokens"] for user in users] if k else [0] * len(users)
        per_turn.append(
            {
                "turn": k + 1,
                "ttft_median_ms": 1000 * statistics.median(t["ttft_s"] for t in turns),
                "prompt_tokens_mean": statistics.mean(t["prompt_tokens"] for t in turns),
                "cached_tokens_mean": statistics.mean(t["cached_tokens"] for t in turns),
                "previous_prompt_mean": statistics.mean(previous),
                "reused_previous_prompt": all(t["cached_tokens"] >= p for t, p in zip(turns, previous)),
            }
        )
    return {
        "duration_s": duration,
        "output_tok_s": output / duration,
        "total_tok_s": (output + prompt) / duration,
        "ttft_median_ms": 1000 * statistics.median(t["ttft_s"] for turns in users for t in turns),
        "turns": per_turn,
        "users": users,
    }


def long_beside_decoders(base_url: str, profile: Profile) -> dict[str, Any]:
    """Decoders streaming while a long prompt arrives; their ITLs and its TTFT."""
    essays = essay_text(profile.long_prompt_chars + profile.decoder_prompt_chars * profile.decoders)
    long_result: dict[str, Any] = {}

    def decoder(i: int) -> dict[str, Any]:
        start = profile.long_prompt_chars + i * profile.decoder_prompt_chars
        text = essays[start : start + profile.decoder_prompt_chars]
        return stream_chat(base_url, [{"role": "user", "content": f"{text}\n\nContinue."}], profile.decoder_tokens)

    def long_prompt() -> None:
        time.sleep(profile.long_delay_s)
        content = essays[: profile.long_prompt_chars] + "\n\nWhat is this about?"
        long_result.update(stream_chat(base_url, [{"role": "user", "content": content}], 8))

    arrival = threading.Thread(target=long_prompt)
    arrival.start()
    with ThreadPoolExecutor(profile.decoders) as pool:
        decoders = list(pool.map(decoder, range(profile.decoders)))
    arrival.join()
    itl = sorted(x for d in decoders for x in d["itl_s"])
    return {
        "decoder_itl_median_ms": 1000 * statistics.median(itl),
        "decoder_itl_p99_ms": 1000 * itl[min(len(itl) - 1, int(0.99 * len(itl)))],
        "decoder_itl_max_ms": 1000 * itl[-1],
        "decoder_tokens": sum(d["completion_tokens"] for d in decoders),
        "long_prompt_tokens": long_result.get("prompt_tokens"),
        "long_ttft_ms": None if long_result.get("ttft_s") is None else 1000 * long_result["ttft_s"],
    }


def run_system(
    name: str, flags: tuple[str, ...], shared: list[str], settings: ServerSettings, profile: Profile, log_dir: Path
) -> dict[str, Any]:
    server: ServerProcess = server_for(name, flags, shared, settings, log_dir, say)
    system: dict[str, Any] = {"name": name, "flags": list(flags), "error": None}
    try:
        with server:
            say(f"[{name}] multi-turn: {profile.users} users x {profile.turns} turns")
            system["multi_turn"] = multi_turn(server.base_url, profile)
            server.flush_cache()
            say(f"[{name}] long prompt beside {profile.decoders} decoders")
            system["long_beside_decoders"] = long_beside_decoders(server.base_url, profile)
    except (ServerStartError, requests.RequestException) as exc:
        say(f"[{name}] failed: {exc}")
        system["error"] = str(exc).splitlines()[0]
    return system


def ratios(stock: dict[str, Any], project: dict[str, Any]) -> dict[str, float | None]:
    """Project over stock for each headline figure (None where either system failed)."""
    if stock.get("error") or project.get("error"):
        return {}
    mt_s, mt_p = stock["multi_turn"], project["multi_turn"]
    lb_s, lb_p = stock["long_beside_decoders"], project["long_beside_decoders"]
    return {
        "multi_turn_output_tok_s": mt_p["output_tok_s"] / mt_s["output_tok_s"],
        "multi_turn_total_tok_s": mt_p["total_tok_s"] / mt_s["total_tok_s"],
        "multi_turn_ttft_median": mt_p["ttft_median_ms"] / mt_s["ttft_median_ms"],
        "decoder_itl_median": lb_p["decoder_itl_median_ms"] / lb_s["decoder_itl_median_ms"],
        "decoder_itl_p99": lb_p["decoder_itl_p99_ms"] / lb_s["decoder_itl_p99_ms"],
        "long_ttft": lb_p["long_ttft_ms"] / lb_s["long_ttft_ms"],
    }


def markdown(report: dict[str, Any]) -> str:
    lines = [
        f"# Conversations and long prompts: {report['profile']} ({report['date']})",
        provenance_line(report),
        "",
        f"Machine: {report['machine']}. Shared arguments: `{' '.join(report['shared_args'])}`.",
        f"Project flags: `{' '.join(report['project_flags'])}`. Workloads: `bench/conversations.py` docstring.",
        "",
        "## Project / stock",
        "",
        "| figure | ratio |",
        "|---|---|",
        *[f"| {k} | {v:.2f} |" for k, v in report["ratios"].items()],
        "",
    ]
    for system in report["systems"]:
        lines += [f"## {system['name']}", ""]
        if system["error"]:
            lines += [f"failed: {system['error']}", ""]
            continue
        mt, lb = system["multi_turn"], system["long_beside_decoders"]
        lines += [
            f"Multi-turn: {mt['output_tok_s']:.1f} output tok/s, {mt['total_tok_s']:.1f} total tok/s, "
            f"median TTFT {mt['ttft_median_ms']:.0f} ms.",
            "",
            "| turn | prompt tokens | cached tokens | previous prompt | reused it all | median TTFT ms |",
            "|---|---|---|---|---|---|",
            *[
                f"| {t['turn']} | {t['prompt_tokens_mean']:.0f} | {t['cached_tokens_mean']:.0f} | "
                f"{t['previous_prompt_mean']:.0f} | {t['reused_previous_prompt']} | {t['ttft_median_ms']:.0f} |"
                for t in mt["turns"]
            ],
            "",
            f"Long prompt beside decoders: decoders' ITL median {lb['decoder_itl_median_ms']:.1f} ms, "
            f"P99 {lb['decoder_itl_p99_ms']:.1f} ms, max {lb['decoder_itl_max_ms']:.1f} ms; the "
            f"{lb['long_prompt_tokens']}-token prompt's TTFT {lb['long_ttft_ms']:.0f} ms.",
            "",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", choices=sorted(PROFILES), default="cpu")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    profile = PROFILES[args.profile]
    date = dt.date.today().isoformat()
    paths = ReportPaths(args.out_dir, f"conversations-{profile.name}-{date}")
    log_dir = args.out_dir / f"conversations-{profile.name}-{date}-logs"
    log_dir.mkdir(parents=True, exist_ok=True)
    settings = ServerSettings("default", "auto", "float32", profile.max_total_tokens, None, 1, 900.0)
    model_dir, load_args = prepare_model(settings, log_dir)
    chunking = ["--chunked-prefill-size", str(profile.chunk), "--enable-mixed-chunk", "--enable-cache-report"]
    shared = [*shared_server_args(settings, model_dir, load_args), *chunking]
    systems = [run_system(name, PROJECT_DEFAULT, shared, settings, profile, log_dir) for name in (STOCK, "project")]
    report = {
        "profile": profile.name,
        "date": date,
        "machine": machine(),
        "settings": asdict(profile),
        "shared_args": args_for_report(shared, model_dir),
        "project_flags": list(PROJECT_DEFAULT),
        "ratios": ratios(*systems),
        "systems": systems,
    }
    write_json(paths, report)
    paths.markdown.write_text(markdown(report))
    say(f"wrote {paths.json} and {paths.markdown}")
    return 0 if not any(s["error"] for s in systems) else 1


if __name__ == "__main__":
    raise SystemExit(main())
