"""The fidelity benchmark's report (`bench/fidelity.py`): accuracy over the prompts both full
caches answer (this server's and kvpress's), the language-model table, the markdown and the plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import teacher_forced
from common.report import ReportPaths, provenance_line, write_json
from kvsparse_testbed import continuations, ruler

#: The full-cache system's name in a report.
FULL = "full"


def say(message: str) -> None:
    print(f"[fidelity] {message}", flush=True)


def load_kvpress(path: Path, prompts: list, strict: bool = True) -> dict[str, Any] | None:
    """kvpress's answers by prompt id and its presses' labels; a report built from other prompts
    is refused (`strict`) or, for the RULER-style suite, left out with a message."""
    report = json.loads(path.read_text())
    by_id = {p["prompt_id"]: p for p in report["prompts"]}
    for prompt in prompts:
        theirs = by_id.get(prompt.prompt_id)
        if theirs is None or theirs["answer"] != prompt.answer:
            message = f"{path} was not built from these prompts ({prompt.prompt_id}); rerun bench/fidelity_kvpress.py"
            if strict:
                raise SystemExit(message)
            say(f"{message}: no kvpress rows in that table")
            return None
    methods = list(report["settings"]["press_parameters"])
    return {"path": path.name, "kvpress": report["settings"]["kvpress"], "methods": methods, "prompts": by_id}


def accuracy(report: dict[str, Any], kvpress: dict[str, Any] | None, prompt_ids: list[str]) -> dict[str, Any]:
    """Correct / evaluated per (method, budget) over those of `prompt_ids` that both full caches
    solve (only this server's when `kvpress` is None)."""
    ids = set(prompt_ids)
    systems = {
        s["name"]: {**s, "answers": {pid: a for pid, a in s["answers"].items() if pid in ids}}
        for s in report["systems"]
        if s["error"] is None
    }
    full = systems.get(FULL)
    if full is None or not full["answers"]:
        return {}
    solved = {pid for pid, a in full["answers"].items() if a["correct"]}
    if kvpress is not None:
        solved &= {pid for pid, p in kvpress["prompts"].items() if p["full"]["correct"]}
    rows: dict[str, dict[str, dict[str, int]]] = {}
    for system in systems.values():
        if system["budget"] is None:
            continue
        variant = system["name"].rsplit("-", 1)[0]
        runs = [a for pid, a in system["answers"].items() if pid in solved]
        rows.setdefault(f"project {variant}", {})[str(system["budget"])] = {
            "correct": sum(a["correct"] for a in runs),
            "evaluated": len(runs),
        }
    if kvpress is not None:
        for method in kvpress["methods"]:
            for budget in report["settings"]["budgets"]:
                runs = [kvpress["prompts"][pid]["methods"].get(method, {}).get(str(budget)) for pid in solved]
                runs = [r for r in runs if r is not None]
                if runs:
                    rows.setdefault(f"kvpress {method}", {})[str(budget)] = {
                        "correct": sum(r["correct"] for r in runs),
                        "evaluated": len(runs),
                    }
        if len(kvpress["methods"]) > 1:
            rows["kvpress best"] = best_per_budget({k: v for k, v in rows.items() if k.startswith("kvpress ")})
    return {
        "solved_by_both_full_caches": sorted(solved),
        "rows": rows,
        "full_cache_solved": sum(a["correct"] for a in full["answers"].values()),
        "prompts": len(full["answers"]),
    }


def best_per_budget(rows: dict[str, dict[str, dict[str, int]]]) -> dict[str, dict[str, Any]]:
    """Per budget, the row with the most correct answers (the first listed on a tie), named."""
    best: dict[str, dict[str, Any]] = {}
    for name, cells in rows.items():
        for budget, cell in cells.items():
            if budget not in best or cell["correct"] > best[budget]["correct"]:
                best[budget] = {**cell, "method": name.removeprefix("kvpress ")}
    return best


def language_model(report: dict[str, Any], kvpress_lm: dict[str, Any] | None) -> dict[str, Any]:
    """Per system, token-weighted over the passages: perplexity and top-1 accuracy on the real
    text, agreement with the full cache's greedy continuation, and perplexity relative to the
    full cache's; then kvpress's rows from its own run on the same passages."""
    systems = [s for s in report["systems"] if s["error"] is None and s["lm"]]
    full = next((s for s in systems if s["name"] == FULL), None)
    if full is None:
        return {}
    rows = [_lm_row(system["name"], system["budget"], system["lm"], full["lm"]) for system in systems]
    if kvpress_lm is not None:
        theirs = kvpress_lm["systems"]
        rows += [
            _lm_row(f"kvpress {name}", int(name.rsplit("-", 1)[1]), per_passage, theirs[FULL])
            for name, per_passage in theirs.items()
            if name != FULL and int(name.rsplit("-", 1)[1]) in report["settings"]["budgets"]
        ]
    return {"passages": len(full["lm"]), "rows": rows}


def _lm_row(name: str, budget: int | None, per_passage: dict[str, Any], full: dict[str, Any]) -> dict[str, Any]:
    """One system's totals; its perplexity ratio is to `full` (that run's full cache) on the same
    passages (kvpress skips passages no longer than its budget)."""
    real = teacher_forced.summarize(per_passage, "real")
    greedy = teacher_forced.summarize(per_passage, "full_greedy")
    full_ppl = teacher_forced.summarize({pid: full[pid] for pid in per_passage}, "real").perplexity
    return {
        "system": name,
        "budget": budget,
        "tokens": real.tokens,
        "perplexity": real.perplexity,
        "perplexity_ratio": real.perplexity / full_ppl,
        "top1_real": real.top1_rate,
        "agreement_with_full": greedy.top1_rate,
    }


def load_kvpress_lm(path: Path, passages: list[continuations.Passage]) -> dict[str, Any] | None:
    """kvpress's teacher-forced scores of these passages, by system then passage; None (said
    why) when its report did not score all of them."""
    report = json.loads(path.read_text())
    by_id = {p["passage_id"]: p for p in report["passages"]}
    same = all(
        p.passage_id in by_id and by_id[p.passage_id]["context_tokens"] == len(p.context_ids) for p in passages
    ) and report["settings"]["continuation_len"] == len(passages[0].continuation_ids)
    if not same:
        say(f"{path.name} scored other passages: no kvpress rows in the language-model table")
        return None
    systems: dict[str, dict[str, Any]] = {}
    for passage in passages:
        for name, scores in by_id[passage.passage_id]["scores"].items():
            systems.setdefault(name, {})[passage.passage_id] = scores
    return {"path": path.name, "systems": systems}


def markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        f"# Fidelity through the server — {report['date']}",
        provenance_line(report),
        "",
        f"- Machine: {report['machine']}",
        f"- Server arguments (all systems): `{' '.join(report['server_args'])}`",
        f"- Suites: {', '.join(settings['suites'])}",
        "",
    ]
    if "retrieval" in settings["suites"]:
        lines += retrieval_markdown(report)
    if "ruler" in settings["suites"]:
        lines += ruler_markdown(report)
    if "lm" in settings["suites"]:
        lines += lm_markdown(report)
    return "\n".join(lines) + "\n"


def retrieval_markdown(report: dict[str, Any]) -> list[str]:
    acc = report["accuracy"]
    lines = [
        "## Retrieval",
        "",
        f"{len(report['prompt_ids'])} prompts (passkey and needle-in-essays, "
        f"{token_range(report, report['prompt_ids'])} tokens), greedy, "
        f"{report['settings']['max_new_tokens']} new tokens, OpenAI chat endpoint; "
        f"kvpress reference: {report['kvpress']['path'] if report.get('kvpress') else 'none'}.",
        "",
    ]
    if not acc:
        return lines + ["The full-cache run failed; no accuracy.", ""]
    solved = len(acc["solved_by_both_full_caches"])
    return lines + [
        f"Full cache through the server: {acc['full_cache_solved']}/{acc['prompts']} correct. Each "
        f"cell: correct / evaluated over the {solved} prompts that both full caches (this server's "
        "and kvpress's) answer correctly; a budget is evaluated on prompts longer than it.",
        "",
        *accuracy_table(report, acc, report["prompt_ids"]),
    ]


def token_range(report: dict[str, Any], prompt_ids: list[str]) -> str:
    """The shortest and longest of these prompts as the server counted them."""
    tokens = [report["prompt_tokens"][pid] for pid in prompt_ids if pid in report["prompt_tokens"]]
    return f"{min(tokens):,}–{max(tokens):,}" if tokens else "—"


def ruler_markdown(report: dict[str, Any]) -> list[str]:
    acc = report["ruler_accuracy"]
    lines = [
        "## Harder retrieval (RULER-style)",
        "",
        f"{len(report['ruler_prompt_ids'])} prompts of `kvsparse_testbed.ruler` "
        f"({', '.join(report['settings']['ruler_tasks'])}; "
        f"{report['settings']['ruler_per_length']} per task and length and seed "
        f"{', '.join(map(str, report['settings']['ruler_seeds']))}, haystacks of "
        f"{', '.join(f'{n:,}' for n in report['settings']['ruler_lengths'])} tokens; prompts of "
        f"{token_range(report, report['ruler_prompt_ids'])} tokens), greedy, {ruler.MAX_NEW_TOKENS} "
        "new tokens; an answer counts when it holds every expected value.",
        "",
    ]
    if not acc:
        return lines + ["The full-cache run failed; no accuracy.", ""]
    return lines + [
        f"Full cache through the server: {acc['full_cache_solved']}/{acc['prompts']} correct. Each cell: "
        f"correct / evaluated over the {len(acc['solved_by_both_full_caches'])} prompts the full cache "
        + (
            f"and kvpress's (`{report['kvpress_ruler']['path']}`, every press of its sweep, then its best "
            "per budget) answer correctly"
            if report.get("kvpress_ruler")
            else "answers correctly"
        )
        + "; a budget is evaluated on prompts longer than it. By task:",
        "",
        *task_table(report, acc),
        "",
        *accuracy_table(report, acc, report["ruler_prompt_ids"]),
    ]


def task_table(report: dict[str, Any], acc: dict[str, Any]) -> list[str]:
    """Correct / evaluated per system and task, over the prompts the full cache solves."""
    solved = set(acc["solved_by_both_full_caches"])
    tasks = report["settings"]["ruler_tasks"]
    lines = ["| system | " + " | ".join(tasks) + " |", "|---|" + "---|" * len(tasks)]
    for system in report["systems"]:
        cells = []
        for task in tasks:
            runs = [a for pid, a in system["answers"].items() if pid in solved and ruler.task_of(pid) == task]
            cells.append(f"{sum(a['correct'] for a in runs)}/{len(runs)}" if runs else "—")
        lines.append(f"| {system['name']} | " + " | ".join(cells) + " |")
    return lines


def cell_text(cell: dict[str, Any]) -> str:
    """correct/evaluated, and for a best-of row the press that scored it."""
    text = f"{cell['correct']}/{cell['evaluated']}"
    return f"{text} ({cell['method']})" if "method" in cell else text


def accuracy_table(report: dict[str, Any], acc: dict[str, Any], prompt_ids: list[str]) -> list[str]:
    """The per-method table by budget, then every prompt's mark per system."""
    budgets = report["settings"]["budgets"]
    lines = ["| method | " + " | ".join(f"{b:,}" for b in budgets) + " |", "|---|" + "---|" * len(budgets)]
    for method, cells in acc["rows"].items():
        shown = [cells.get(str(b)) for b in budgets]
        lines.append(f"| {method} | " + " | ".join("—" if c is None else cell_text(c) for c in shown) + " |")
    lines += [
        "",
        "### Per prompt",
        "",
        "| prompt | tokens | answer | " + " | ".join(s["name"] for s in report["systems"]) + " |",
        "|---|---|---|" + "---|" * len(report["systems"]),
    ]
    tokens = report["prompt_tokens"]
    answers = dict(zip(report["prompt_ids"] + report["ruler_prompt_ids"], report["answers"] + report["ruler_answers"]))
    for pid in prompt_ids:
        marks = []
        for system in report["systems"]:
            run = system["answers"].get(pid)
            marks.append("—" if run is None else ("✓" if run["correct"] else "✗"))
        lines.append(f"| {pid} | {tokens.get(pid, '—')} | {answers[pid]} | " + " | ".join(marks) + " |")
    return lines + [""]


def lm_markdown(report: dict[str, Any]) -> list[str]:
    lm = report["language_model"]
    settings = report["settings"]
    lines = [
        "## Real text, teacher-forced through the decode path",
        "",
        f"{settings['lm_passages_per_len']} essay passages per context length "
        f"({', '.join(f'{n:,}' for n in settings['lm_context_lens'])} tokens), each followed by "
        f"{settings['lm_continuation_len']} forced tokens (the first predicted by the prefill, the "
        "rest by decode steps over the sparse layers' kept entries, evicting as they grow). "
        "Perplexity and top-1 accuracy are on the essay's real next tokens; agreement is the share "
        "of steps whose top token is the full cache's own greedy token, forced on that continuation. "
        "*vs full* is the perplexity ratio to the full cache of the same run on the same passages.",
        "",
    ]
    if not lm:
        return lines + ["The full-cache run failed; no scores.", ""]
    if report.get("kvpress_lm"):
        lines += [
            f"kvpress rows: `{report['kvpress_lm']}` (Hugging Face transformers, the same passages; "
            "kvpress compresses the context at prefill and never evicts while decoding, and its "
            "agreement is with its own full cache's greedy continuation).",
            "",
        ]
    lines += [
        "| system | budget | tokens | perplexity | vs full | top-1 (real text) | agreement with full |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in lm["rows"]:
        budget = "—" if row["budget"] is None else f"{row['budget']:,}"
        lines.append(
            f"| {row['system']} | {budget} | {row['tokens']} | {row['perplexity']:.3f} | "
            f"{row['perplexity_ratio']:.3f} | {row['top1_real']:.3f} | {row['agreement_with_full']:.3f} |"
        )
    return lines + [""]


def write_plot(paths: ReportPaths, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    accuracies = {"retrieval": report["accuracy"], "ruler": report["ruler_accuracy"]}
    present = (*accuracies.items(), ("lm", report["language_model"]))
    panels = [kind for kind, result in present if result]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(7 * len(panels), 4), squeeze=False)
    budgets = report["settings"]["budgets"]
    for axis, kind in zip(axes[0], panels):
        if kind in accuracies:
            rows = accuracies[kind]["rows"]
            swept = "kvpress best" in rows  # then kvpress's best stands for its sweep
            for method, cells in rows.items():
                if swept and method.startswith("kvpress ") and method != "kvpress best":
                    continue
                xs = sorted(int(b) for b in cells)
                ys = [cells[str(b)]["correct"] / max(cells[str(b)]["evaluated"], 1) for b in xs]
                axis.plot(xs, ys, marker="o", linestyle="-" if method.startswith("project") else "--", label=method)
            title = "Retrieval (prompts both full caches solve)" if kind == "retrieval" else "RULER-style"
            axis.set(ylabel="accuracy", title=title, ylim=(-0.05, 1.05))
        else:
            rows = [r for r in report["language_model"]["rows"] if r["budget"] is not None]
            for variant in dict.fromkeys(r["system"].rsplit("-", 1)[0] for r in rows):
                mine = sorted((r for r in rows if r["system"].rsplit("-", 1)[0] == variant), key=lambda r: r["budget"])
                xs = [r["budget"] for r in mine]
                style = "--" if variant.startswith("kvpress") else "-"
                axis.plot(
                    xs,
                    [r["agreement_with_full"] for r in mine],
                    marker="o",
                    linestyle=style,
                    label=f"{variant}: agreement with full",
                )
            axis.set(ylabel="next-token agreement with the full cache", title="Real text, teacher-forced decode")
        axis.axhline(1.0, color="gray", linewidth=0.8, label="full cache")
        axis.set(xscale="log", xlabel="budget (tokens kept per sparse layer)")
        axis.set_xticks(budgets, [str(b) for b in budgets])
        axis.minorticks_off()
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    fig.suptitle(f"Fidelity through the server — {report['date']}")
    fig.tight_layout()
    fig.savefig(paths.png, dpi=110)
    plt.close(fig)


def write_report(paths: ReportPaths, report: dict[str, Any], references: dict[str, dict[str, Any] | None]) -> None:
    """`references`: kvpress's runs ("retrieval", "ruler", "lm"), each None when absent."""
    tokens = {pid: a["prompt_tokens"] for s in report["systems"] for pid, a in s["answers"].items()}
    report["prompt_tokens"] = tokens
    report["accuracy"] = accuracy(report, references["retrieval"], report["prompt_ids"])
    report["ruler_accuracy"] = accuracy(report, references["ruler"], report["ruler_prompt_ids"])
    report["language_model"] = language_model(report, references["lm"])
    write_json(paths, report)
    paths.markdown.write_text(markdown(report))
    write_plot(paths, report)
