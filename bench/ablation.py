"""What each knob of the default earns on the frozen suite: the default, and the default with one
knob at its neutral value, on prompts none of them was chosen on.

Prompts: `kvsparse_testbed.frozen_suite` (its name and hash in the report), a subset by seed, task
and length. Systems: the full cache (the launcher with `--kvsparse-preset off`), then one server
with the default preset, where every variant of a policy knob is a request's own policy
(`custom_params`: `span` with every default knob but one) at each budget, and a server per
variant of a server-level knob (the guide). Each prompt is asked once per variant and budget,
greedy, through the chat endpoint (`common.frozen.ask`). A budget counts only the prompts the
full cache answers and that are longer than it.

Writes `<out-dir>/<stem>.json` (every answer), `.md` (answered prompts per variant and budget, and
each variant's difference from the default) and `.png`.

    .venv/bin/python bench/ablation.py --tasks multikey,uuid   # seeds 3-5, 2-3k tokens, budgets 128 and 256: ~30 min
    # Gemma 3 270M (a base model), the default against no full layer; a prompt's prefix reused across budgets
    .venv/bin/python bench/ablation.py --model gemma-3-270m --completion --prefix-cache \
        --budgets 64,128,256,512,1024 --variants "" --no-server-variants \
        --server-variant 'no full layer (full_layers [])={"full_layers": []}' --stem ablation-gemma-<date>
    # another frozen suite (`RETRIEVAL_SUITES`), the default beside its policy with a knob changed
    .venv/bin/python bench/ablation.py --suite tight-choose-2026-12-06 --budgets 64,128 --variants "" \
        --no-server-variants --variant 'long_follow 16={"long_follow": 16}' --stem ablation-tight-<date>
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

from common.checkout import ROOT, importable
from common.frozen import SERVER_FLAGS, SERVER_SETTINGS, add_selection_arguments, ask, selection
from common.report import ReportPaths, provenance, provenance_line, write_json
from common.systems import args_for_report, machine, prepare_model, server_for, shared_server_args

importable()

from kvsparse_testbed.frozen_suite import FROZEN_SUITE, RETRIEVAL_SUITES  # noqa: E402
from sglang_kvsparse.config import PRESETS  # noqa: E402

DEFAULT = PRESETS["default"]
#: A policy knob of the default at its neutral value: the default without what the knob adds.
POLICY_VARIANTS: dict[str, dict[str, Any]] = {
    "no long follow (long_follow 0)": {"long_follow": 0},
    "no sentences (sentence 0)": {"sentence": 0.0},
}
#: Server-level knobs: a server each, with this JSON configuration over the default preset's.
SERVER_VARIANTS: dict[str, dict[str, Any]] = {
    "no guide (guide_from null)": {"guide_from": None},
    "guide at every budget (guide_below null)": {"guide_below": None},
    "two full layers (full_layers [0, 1])": {"full_layers": [0, 1]},
    "SnapKV's window (window 32)": {"window": 32},
    "no sink (sink 0)": {"sink": 0},
    "evict every token (evict_page 1)": {"evict_page": 1},
}
DEFAULT_LABEL = "default"
KVPRESS_BEST = "kvpress, best press per budget"


def policy_setting(budget: int, knobs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's setting: the budget, and the default policy with `knobs` changed (None: the
    server's policy)."""
    if knobs is None:
        return {"budget": budget}
    policy = {"name": DEFAULT.policy.name, **DEFAULT.policy.options(), **knobs}
    return {"budget": budget, "policy": policy}


def chosen_variants(labels: str | None, variants: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The `variants` these labels (separated by ';') name, all without any (None), none for an
    empty string; exits naming an unknown label."""
    if labels is None:
        return variants
    chosen = [label.strip() for label in labels.split(";") if label.strip()]
    unknown = [label for label in chosen if label not in variants]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; known: {list(variants)}")
    return {label: variants[label] for label in chosen}


def labelled_json(spec: str) -> tuple[str, dict[str, Any]]:
    """`--server-variant` or `--variant` 'LABEL=JSON': a label and its JSON object (the server's
    `--kvsparse-config` over the default preset's, or the policy knobs changed)."""
    label, sep, text = spec.partition("=")
    try:
        changes = json.loads(text) if sep and label.strip() else None
    except json.JSONDecodeError:
        changes = None
    if not isinstance(changes, dict):
        raise argparse.ArgumentTypeError(f"expected 'LABEL=JSON object', got {spec!r}")
    return label.strip(), changes


def server_config(changes: dict[str, Any]) -> str:
    """`changes` to the default preset, as `--kvsparse-config` JSON."""
    return json.dumps(changes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--suite", default=FROZEN_SUITE.name, choices=sorted(RETRIEVAL_SUITES), help="the frozen suite asked"
    )
    add_selection_arguments(parser, seeds=None)
    parser.add_argument("--no-server-variants", action="store_true", help="only the request-level variants")
    parser.add_argument(
        "--server-variants",
        help=f"only these server variants, labels separated by ';' (of: {'; '.join(SERVER_VARIANTS)})",
    )
    parser.add_argument(
        "--server-variant",
        type=labelled_json,
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="also a server of the default preset with this --kvsparse-config (repeatable)",
    )
    parser.add_argument(
        "--variants", help=f"only these policy variants, labels separated by ';' (of: {'; '.join(POLICY_VARIANTS)})"
    )
    parser.add_argument(
        "--variant",
        type=labelled_json,
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="also the default policy with these knobs changed, as a request's own policy (repeatable)",
    )
    parser.add_argument("--model", default="default", help="the model served (a name of `sglang_kvsparse.models`)")
    parser.add_argument(
        "--prefix-cache",
        action="store_true",
        help="keep SGLang's radix cache: a prompt asked again at another budget reuses all but its last window "
        "(exact: the prefix store); default: every prompt prefilled whole",
    )
    parser.add_argument(
        "--completion",
        action="store_true",
        help="a base model: ask through the completions endpoint, the prompt's text and an answer cue",
    )
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--stem", default=f"ablation-{dt.date.today().isoformat()}")
    parser.add_argument(
        "--kvpress", type=Path, help="a bench/fidelity_kvpress.py report of the frozen suite: its presses beside"
    )
    parser.add_argument(
        "--render", action="store_true", help="rewrite the report of --stem (with --kvpress's rows), asking nothing"
    )
    parser.add_argument(
        "--kv-cache-dtype", help="both servers' KV cache (fp8_e4m3, fp8_e5m2; default: the model's dtype)"
    )
    args = parser.parse_args()
    settings = dataclasses.replace(SERVER_SETTINGS, model=args.model, kv_cache_dtype=args.kv_cache_dtype)
    if args.render:
        render(ReportPaths(args.out_dir, args.stem), args.kvpress)
        return
    suite = RETRIEVAL_SUITES[args.suite]
    prompts, budgets = selection(args, suite)
    server_flags = () if args.prefix_cache else SERVER_FLAGS
    made = provenance(sys.argv)
    server_variants = {} if args.no_server_variants else chosen_variants(args.server_variants, SERVER_VARIANTS)
    server_variants |= dict(args.server_variant)
    policy_variants = chosen_variants(args.variants, POLICY_VARIANTS) | dict(args.variant)
    answers: dict[str, dict[str, Any]] = {p.prompt_id: {} for p in prompts}
    paths = ReportPaths(args.out_dir, args.stem)

    def report() -> dict[str, Any]:
        return {
            "benchmark": "ablation",
            "date": dt.date.today().isoformat(),
            "machine": machine(),
            "provenance": made,
            "suite": {"name": suite.name, "sha256": suite.sha256},
            "model": args.model,
            "asked": "completions, the prompt and an answer cue" if args.completion else "chat",
            "server_args": [*server_flags, *args_for_report(shared, model_dir)],
            "budgets": budgets,
            "policy_variants": policy_variants,
            "server_variants": server_variants,
            "default": dataclasses.asdict(DEFAULT.policy) | {"name": DEFAULT.policy.name},
            "lengths": {p.prompt_id: p.target_tokens for p in prompts},
            "expected": {p.prompt_id: p.answer for p in prompts},
            "answers": answers,
        }

    def save() -> None:
        data = report()
        write_json(paths, data)
        paths.markdown.write_text(markdown(data))

    with tempfile.TemporaryDirectory() as work:
        model_dir, load_args = prepare_model(settings, Path(work))
        shared = shared_server_args(settings, model_dir, load_args)
        off = ("--kvsparse-preset", "off", *server_flags)
        with server_for("full-cache", off, shared, settings, Path(work), print) as server:
            for number, prompt in enumerate(prompts, 1):
                answers[prompt.prompt_id]["full"] = ask(server.base_url, prompt, None, args.completion)
                print(
                    f"[full {number}/{len(prompts)}] {prompt.prompt_id} {answers[prompt.prompt_id]['full']['correct']}"
                )
        save()
        asked = [p for p in prompts if answers[p.prompt_id]["full"]["correct"]]
        variants = {DEFAULT_LABEL: None, **policy_variants}
        with server_for("project", server_flags, shared, settings, Path(work), print) as server:
            for label, knobs in variants.items():
                for prompt in asked:
                    for budget in budgets:
                        if prompt.target_tokens > budget:
                            got = ask(server.base_url, prompt, policy_setting(budget, knobs), args.completion)
                            answers[prompt.prompt_id][f"{label}@{budget}"] = got
                print(f"[{label}] done", flush=True)
                save()
        for label, changes in server_variants.items():
            flags = ("--kvsparse-config", server_config(changes), *server_flags)
            with server_for("project", flags, shared, settings, Path(work), print) as server:
                for prompt in asked:
                    for budget in budgets:
                        if prompt.target_tokens > budget:
                            got = ask(server.base_url, prompt, {"budget": budget}, args.completion)
                            answers[prompt.prompt_id][f"{label}@{budget}"] = got
            print(f"[{label}] done", flush=True)
            save()
    save()
    render(paths, args.kvpress)


def render(paths: ReportPaths, kvpress: Path | None) -> None:
    """Write the markdown and the plot of the report at `paths`, with kvpress's answers from the
    report at `kvpress` (which must be of the same suite) added to it."""
    data = json.loads(paths.json.read_text())
    if kvpress is not None:
        data["kvpress"] = kvpress_answers(json.loads(kvpress.read_text()), kvpress.name, data)
        write_json(paths, data)
    paths.markdown.write_text(markdown(data))
    plot(data, paths.png)
    print(paths.markdown.read_text())


def kvpress_answers(report: dict[str, Any], name: str, data: dict[str, Any]) -> dict[str, Any]:
    """kvpress's full-cache answer and each press's per budget, for the prompts `data` asked."""
    if (report["settings"].get("frozen_suite") or {}).get("sha256") != data["suite"]["sha256"]:
        raise SystemExit(f"{name} is not a run of the frozen suite {data['suite']['name']}")
    by_id = {p["prompt_id"]: p for p in report["prompts"] if p["prompt_id"] in data["answers"]}
    presses = {
        label: {
            str(budget): {
                pid: p["methods"][label][str(budget)]["correct"]
                for pid, p in by_id.items()
                if str(budget) in p["methods"].get(label, {})
            }
            for budget in data["budgets"]
        }
        for label in report["settings"]["press_parameters"]
    }
    return {
        "report": name,
        "kvpress": report["settings"]["kvpress"],
        "full": {pid: p["full"]["correct"] for pid, p in by_id.items()},
        "presses": presses,
    }


def kvpress_rows(data: dict[str, Any]) -> tuple[list[str], dict[str, dict[int, tuple[int, int]]]]:
    """The prompts both full caches answer (kvpress runs a press only where its full cache
    answers), and per system (the default, the variants, every press and kvpress's best) and
    budget: (answered, asked) of them."""
    theirs = data["kvpress"]
    both = [pid for pid, by in data["answers"].items() if by.get("full", {}).get("correct") and theirs["full"].get(pid)]
    budgets = data["budgets"]
    rows: dict[str, dict[int, tuple[int, int]]] = {}
    for label in [DEFAULT_LABEL, *data["policy_variants"], *data["server_variants"]]:
        rows[label] = {}
        for budget in budgets:
            cells = [data["answers"][pid].get(f"{label}@{budget}") for pid in both]
            cells = [c for c in cells if c is not None]
            rows[label][budget] = (sum(c["correct"] for c in cells), len(cells))
    presses = [f"kvpress {label}" for label in theirs["presses"]]
    for label, per_budget in theirs["presses"].items():
        rows[f"kvpress {label}"] = {
            b: (sum(per_budget[str(b)].get(pid, False) for pid in both), sum(pid in per_budget[str(b)] for pid in both))
            for b in budgets
        }
    rows[KVPRESS_BEST] = {b: max((rows[p][b] for p in presses), default=(0, 0)) for b in budgets}
    return both, rows


def against_kvpress(data: dict[str, Any]) -> list[str]:
    """Markdown: `kvpress_rows` as a table."""
    theirs = data["kvpress"]
    budgets = data["budgets"]
    both, rows = kvpress_rows(data)
    lines = [
        "",
        f"## Beside NVIDIA kvpress {theirs['kvpress']} (`{theirs['report']}`)",
        "",
        f"On the {len(both)} prompts both full caches answer (this server's and Hugging Face's under kvpress); "
        "kvpress compresses the whole prompt at the end of prefill, every layer at the budget.",
        "",
        "| system | " + " | ".join(f"budget {b}" for b in budgets) + " | all budgets |",
        "|---|" + "---:|" * (len(budgets) + 1),
    ]
    for label, per_budget in rows.items():
        cells = [f"{per_budget[b][0]} of {per_budget[b][1]}" if per_budget[b][1] else "—" for b in budgets]
        total = sum(per_budget[b][0] for b in budgets)
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {total} |")
    return lines


def task_of(prompt_id: str) -> str:
    """`ruler-s<seed>-<task>-<length>-<i>` -> task."""
    return prompt_id.split("-")[2]


def tally(data: dict[str, Any], task: str | None = None) -> dict[str, dict[int, tuple[int, int]]]:
    """Per variant and budget: (prompts answered, prompts asked) among those the full cache
    answers and longer than the budget (of one task's prompts, or all)."""
    labels = [DEFAULT_LABEL, *data["policy_variants"], *data["server_variants"]]
    answers = [by for pid, by in data["answers"].items() if task in (None, task_of(pid))]
    out: dict[str, dict[int, tuple[int, int]]] = {}
    for label in labels:
        out[label] = {}
        for budget in data["budgets"]:
            cells = [by[f"{label}@{budget}"] for by in answers if f"{label}@{budget}" in by]
            out[label][budget] = (sum(cell["correct"] for cell in cells), len(cells))
    return out


def markdown(data: dict[str, Any]) -> str:
    counts = tally(data)
    full = sum(by.get("full", {}).get("correct", False) for by in data["answers"].values())
    budgets = data["budgets"]
    lines = [
        f"# Ablation of the default on the frozen suite ({data['date']})",
        provenance_line(data),
        f"- Model `{data.get('model', 'default')}`, asked through {data.get('asked', 'chat')}.",
        f"- Suite `{data['suite']['name']}` (sha256 `{data['suite']['sha256'][:16]}`): {len(data['answers'])} prompts; "
        f"the full cache answers {full}. Cells: answered of those (longer than the budget).",
        f"- The default's policy: {data['default']}",
        "",
        "| variant | " + " | ".join(f"budget {b}" for b in budgets) + " | against the default |",
        "|---|" + "---:|" * len(budgets) + "---:|",
    ]
    base = counts[DEFAULT_LABEL]
    for label, by_budget in counts.items():
        cells = [f"{by_budget[b][0]} of {by_budget[b][1]}" if by_budget[b][1] else "—" for b in budgets]
        ran = all(by_budget[b][1] == base[b][1] for b in budgets) and label != DEFAULT_LABEL
        delta = f"{sum(by_budget[b][0] - base[b][0] for b in budgets):+d}" if ran else "—"
        asked = any(by_budget[b][1] for b in budgets)
        lines.append(
            f"| {label}{'' if asked else ' (not run: the run was stopped)'} | " + " | ".join(cells) + f" | {delta} |"
        )
    tasks = sorted({task_of(pid) for pid in data["answers"]})
    if len(tasks) > 1:
        lines += ["", "Per task (answered of asked, over all budgets):", ""]
        lines += ["| variant | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
        by_task = {task: tally(data, task) for task in tasks}
        for label in counts:
            cells = []
            for task in tasks:
                answered, asked = (sum(by_task[task][label][b][i] for b in budgets) for i in (0, 1))
                cells.append(f"{answered} of {asked}" if asked else "—")
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    if "kvpress" in data:
        lines += against_kvpress(data)
    lines += [
        "",
        "A knob earns its place where removing it loses answers (a negative difference); one run "
        "of greedy answers, so a difference of one or two prompts is within what another seed moves.",
        "",
    ]
    return "\n".join(lines)


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = kvpress_rows(data)[1] if "kvpress" in data else tally(data)
    labels = list(counts)
    fig, axis = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(data["budgets"])
    for i, budget in enumerate(data["budgets"]):
        shares = [counts[label][budget][0] / max(counts[label][budget][1], 1) for label in labels]
        axis.bar([x + i * width for x in range(len(labels))], shares, width, label=f"budget {budget}")
    axis.set_xticks(
        [x + width * (len(data["budgets"]) - 1) / 2 for x in range(len(labels))], labels, rotation=25, ha="right"
    )
    axis.set(ylabel="answered, of the full cache's", ylim=(0, 1.05))
    axis.legend()
    beside = ", kvpress beside (prompts both full caches answer)" if "kvpress" in data else ""
    model = "" if data.get("model", "default") == "default" else f", {data['model']}"
    axis.set_title(f"The default with one knob at its neutral value (frozen suite{model}){beside}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
