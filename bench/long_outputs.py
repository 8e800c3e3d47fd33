"""Long outputs: how close decode-time eviction stays to the full cache over thousands of tokens.

Prompts: a frozen long-output suite (`kvsparse_testbed.long_outputs`: copy a passage, write out a
sentence per record of a list, count, continue an essay; plain text continued, its name and hash in
the report), each asked for exactly its suite's 1,024, 4,096 or 8,000 new tokens (EOS ignored),
greedy. One server with the default preset answers every system as a request's own setting
(`custom_params`): the full cache (`{"enabled": false}`: every token in every layer, as stock
SGLang), the default at each budget, and the baselines (random eviction, StreamingLLM, H2O, TOVA) at
theirs. One system at a time, its prompts at once: the full cache first, so that every other
system's prefill reuses its prompt from the radix cache (exact: the prefix store), and a batch pays
one eviction pass per step, not one per setting. The full cache is asked twice, the second time
beside the next system: how far two runs in other batches drift apart is the noise floor (float32
sums in another order); `--no-noise-floor` asks it once, where a second run costs too long.

Per system, against the full cache's output of the same prompt: the first position where the
tokens differ, the share of positions with the same token, the task score (copy: the passage's
sentences written verbatim; records: records written with their name, city and score; count: the
numbers counted right from 1), and loops (an output whose repeated 16-grams exceed the full
cache's by 20% of it). kvpress's decoding-time compression: `bench/long_outputs_kvpress.py`.

Writes `<out-dir>/<stem>.json` (every output), `.md` and `.png`.

    .venv/bin/python bench/long_outputs.py --lengths 1024   # the 1k outputs, every system: about 40 min here
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import requests
from common.checkout import ROOT, importable
from common.frozen import SERVER_SETTINGS
from common.report import ReportPaths, provenance, provenance_line, write_json
from common.systems import args_for_report, machine, prepare_model, server_for, shared_server_args

importable()

from common.long_output_tables import METRICS, length_tables, summary  # noqa: E402

from kvsparse_testbed.long_outputs import (  # noqa: E402
    LONG_OUTPUT_SUITE,
    LONG_OUTPUT_SUITES,
    TASKS,
    LongOutputPrompt,
    measure,
)

FULL = "full"
FULL_AGAIN = "full (again)"
DEFAULT_LABEL = "default"
#: Eviction baselines: a request's own policy at the same budget.
BASELINES = ("random", "streamingllm", "h2o", "tova")


@dataclasses.dataclass(frozen=True)
class System:
    """One way of answering: a label and a request's `custom_params.kvsparse` setting."""

    label: str
    setting: dict[str, Any]
    budget: int | None = None
    policy: str | None = None


def systems_for(
    budgets: list[int], baselines: list[str], baseline_budgets: list[int], noise_floor: bool = True
) -> list[System]:
    """The full cache twice (once without `noise_floor`), the default at `budgets`, each baseline
    at `baseline_budgets`."""
    chosen = [System(FULL, {"enabled": False})]
    chosen += [System(FULL_AGAIN, {"enabled": False})] if noise_floor else []
    chosen += [System(f"{DEFAULT_LABEL}@{b}", {"budget": b}, b, DEFAULT_LABEL) for b in budgets]
    chosen += [System(f"{p}@{b}", {"policy": p, "budget": b}, b, p) for p in baselines for b in baseline_budgets]
    return chosen


def generate(base_url: str, input_ids: list[int], output_len: int, setting: dict[str, Any]) -> dict[str, Any]:
    """One greedy answer of exactly `output_len` tokens with this request setting."""
    sampling = {
        "max_new_tokens": output_len,
        "temperature": 0,
        "ignore_eos": True,
        "custom_params": {"kvsparse": setting},
    }
    response = requests.post(
        f"{base_url}/generate", json={"input_ids": input_ids, "sampling_params": sampling}, timeout=7200
    )
    response.raise_for_status()
    body = response.json()
    return {"output_ids": [int(t) for t in body["output_ids"]], "text": body["text"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default=LONG_OUTPUT_SUITE.name, choices=sorted(LONG_OUTPUT_SUITES))
    parser.add_argument("--lengths", default="1024", help="output lengths, of the suite's")
    parser.add_argument("--tasks", default=",".join(TASKS))
    parser.add_argument("--budgets", default="128,256,512,1024", help="the default's budgets")
    parser.add_argument("--baselines", default=",".join(BASELINES))
    parser.add_argument("--baseline-budgets", default="256", help="the baselines' budgets")
    parser.add_argument("--concurrency", type=int, default=32, help="requests in flight at once")
    parser.add_argument(
        "--no-noise-floor",
        action="store_true",
        help="ask the full cache once: its second run costs as much as the first (at 8,000 tokens over an hour here)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="keep the answers of --stem's report and ask only the missing ones"
    )
    parser.add_argument("--render", action="store_true", help="rewrite --stem's markdown and plot, asking nothing")
    parser.add_argument("--max-total-tokens", type=int, default=98_304)
    parser.add_argument(
        "--kv-cache-dtype", help="the server's KV cache (fp8_e4m3, fp8_e5m2; default: the model's dtype)"
    )
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--stem", default=f"long-outputs-{dt.date.today().isoformat()}")
    args = parser.parse_args()
    paths = ReportPaths(args.out_dir, args.stem)
    if args.render:
        data = json.loads(paths.json.read_text())
        paths.markdown.write_text(markdown(data))
        plot(data, paths.png)
        return
    lengths = [int(n) for n in args.lengths.split(",")]
    tasks = args.tasks.split(",")
    suite = LONG_OUTPUT_SUITES[args.suite]
    prompts = [p for p in suite.prompts(lengths) if p.task in tasks]
    budgets = [int(b) for b in args.budgets.split(",") if b]
    baselines = [p for p in args.baselines.split(",") if p]
    baseline_budgets = [int(b) for b in args.baseline_budgets.split(",") if b]
    systems = systems_for(budgets, baselines, baseline_budgets, noise_floor=not args.no_noise_floor)
    settings = dataclasses.replace(
        SERVER_SETTINGS, max_total_tokens=args.max_total_tokens, kv_cache_dtype=args.kv_cache_dtype
    )
    # A full-cache request holds its prompt (the suite's are under 4,096 tokens) and its output in
    # its sparse rows, which the largest request budget sizes; the model's context is 8,192.
    flags = (
        "--kvsparse-max-request-budget",
        str(min(max(lengths) + 4_096, 8_192)),
        "--kvsparse-request-policies",
        ",".join(baselines) or "none",
        # The row tables are sized by the largest request budget times the running requests.
        "--max-running-requests",
        str(args.concurrency),
    )
    made = provenance(sys.argv)
    answers: dict[str, dict[str, Any]] = {p.prompt_id: {} for p in prompts}
    if args.resume:
        for prompt_id, kept in json.loads(paths.json.read_text())["answers"].items():
            if prompt_id in answers:
                answers[prompt_id] = {label: {k: got[k] for k in ("output_ids", "text")} for label, got in kept.items()}

    def save() -> None:
        asked = {
            prompt.prompt_id: {
                label: {
                    **got,
                    **measure(prompt, got["output_ids"], got["text"], answers[prompt.prompt_id][FULL]["output_ids"]),
                }
                for label, got in answers[prompt.prompt_id].items()
            }
            for prompt in prompts
            if FULL in answers[prompt.prompt_id]
        }
        data = {
            "benchmark": "long-outputs",
            "date": dt.date.today().isoformat(),
            "machine": machine(),
            "provenance": made,
            "suite": {"name": suite.name, "sha256": suite.sha256},
            "server_args": [*flags, *args_for_report(shared, model_dir)],
            "systems": [dataclasses.asdict(s) for s in systems],
            "prompts": {
                p.prompt_id: {"task": p.task, "output_len": p.output_len, "prompt_len": len(ids[p.prompt_id])}
                for p in prompts
            },
            "answers": asked,
        }
        write_json(paths, data)
        paths.markdown.write_text(markdown(data))
        plot(data, paths.png)

    with tempfile.TemporaryDirectory() as work:
        model_dir, load_args = prepare_model(settings, Path(work))
        shared = shared_server_args(settings, model_dir, load_args)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
        ids = {p.prompt_id: list(tokenizer(p.text)["input_ids"]) for p in prompts}
        with server_for("project", flags, shared, settings, Path(work), print) as server:

            def ask(item: tuple[LongOutputPrompt, System]) -> None:
                prompt, system = item
                got = generate(server.base_url, ids[prompt.prompt_id], prompt.output_len, system.setting)
                answers[prompt.prompt_id][system.label] = got  # one key per thread
                print(f"[{system.label}] {prompt.prompt_id}: task score {prompt.score(got['text'])}", flush=True)

            # The second full-cache run shares its round with the next system: another batch.
            rounds = [[s] for s in systems]
            if not args.no_noise_floor:
                rounds = [systems[:1], systems[1:3], *rounds[3:]]
            with ThreadPoolExecutor(args.concurrency) as pool:
                for round_systems in rounds:
                    asking = [(p, s) for s in round_systems for p in prompts if s.label not in answers[p.prompt_id]]
                    list(pool.map(ask, asking))
                    save()
    save()


def noise_floor_line(data: dict[str, Any]) -> str:
    if any(s["label"] == FULL_AGAIN for s in data["systems"]):
        return f"`{FULL_AGAIN}` is the full cache asked again in another batch: the noise floor."
    return "The full cache was asked once (`--no-noise-floor`): no noise floor in this report."


def markdown(data: dict[str, Any]) -> str:
    tasks = [t for t in TASKS if any(p["task"] == t for p in data["prompts"].values())]
    lines = [
        f"# Long outputs — {data['date']}",
        provenance_line(data),
        "",
        f"- Suite: `{data['suite']['name']}` (sha256 `{data['suite']['sha256'][:12]}…`), tasks {', '.join(tasks)}; "
        "greedy, EOS ignored, every answer exactly its output length",
        f"- Machine: {data['machine']}",
        f"- Server: `python -m sglang_kvsparse.launch_server {' '.join(data['server_args'])}` (the default preset; "
        "every system a request's own setting)",
        "",
        f"{METRICS} {noise_floor_line(data)}",
        *length_tables(data),
        "",
        "kvpress's decoding-time compression: `bench/long_outputs_kvpress.py` (a report of its own).",
    ]
    return "\n".join(lines) + "\n"


def plot(data: dict[str, Any], path: Path) -> None:
    """Per output length: agreement and first divergence against the budget, a line per policy,
    the full cache's second run (the noise floor) drawn across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({p["output_len"] for p in data["prompts"].values()})
    policies = list(dict.fromkeys(s["policy"] for s in data["systems"] if s["policy"]))
    fig, axes = plt.subplots(len(lengths), 2, figsize=(11, 4 * len(lengths)), squeeze=False)
    for row, output_len in enumerate(lengths):
        floor = summary(data, FULL_AGAIN, output_len)
        for column, (key, label) in enumerate(
            (("agreement", "token agreement"), ("first_divergence", "first divergence"))
        ):
            axis = axes[row][column]
            for policy in policies:
                points = [
                    (s["budget"], summary(data, s["label"], output_len))
                    for s in data["systems"]
                    if s["policy"] == policy
                ]
                points = [(budget, got[key]) for budget, got in points if got is not None]
                if points:
                    axis.plot(*zip(*points), marker="o", label=policy)
            if floor is not None:
                axis.axhline(floor[key], color="gray", linestyle="--", label=FULL_AGAIN)
            axis.set_xscale("log", base=2)
            axis.set(xlabel="budget (entries per sparse layer)", ylabel=label, title=f"{output_len:,} output tokens")
            axis.grid(True, alpha=0.3)
            axis.legend(fontsize=8)
    fig.suptitle(f"Long outputs against the full cache — {data['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
