"""Fidelity through the project's server: full cache against sparsity at several budgets, on
retrieval (beside NVIDIA kvpress on the same prompts) and on real text.

For each system (the full cache: the project's launcher with ``--kvsparse-preset off``; then each
variant at each budget) this starts the server on the default model (fp32, CPU), runs the suites,
and stops the server:

- ``retrieval``: every prompt of ``kvsparse_testbed.retrieval`` (passkey and needle-in-essays)
  through the OpenAI chat endpoint with greedy decoding, scored by the answer;
- ``ruler``: the harder RULER-style prompts of ``kvsparse_testbed.ruler`` (look-alike facts,
  7-digit numbers and UUIDs, several values, variable chains), asked the same way and scored on
  the prompts the full cache answers (and kvpress's full cache, with its report
  ``bench/fidelity_kvpress.py --suites ruler``: every press of its sweep and its best per budget);
- ``lm``: essay passages whose continuation is teacher-forced through the decode path
  (``kvsparse_testbed.continuations``): perplexity and top-1 accuracy on the real text, and
  next-token agreement with the full cache's own greedy continuation.

Variants:

- ``snapkv``: every layer sparse at the budget: kvpress's SnapKV setting, method for method;
- ``default``: the launcher's default recipe, layers 0 and 1 full, the others at the budget;
- ``span``, ``h2o``, ``tova``, ``streamingllm``, ``keynorm``: the default recipe with that
  scoring policy (``docs/config.md``) instead of SnapKV.

As in kvpress's runs, a budget is evaluated only on prompts longer than it. The comparison uses the
prompts that both full caches (this server's and kvpress's) answer correctly, so every cell of a
row counts the same prompts; prompts kvpress's full cache misses cannot count, so they are not
asked, nor are the sparse systems asked the prompts this server's full cache missed, unless
``--all-prompts`` is given (it triples the run time). kvpress's numbers are read from its reports
(``bench/fidelity_kvpress.py``, run in its own environment), matched by prompt id and answer.

Writes ``<out-dir>/fidelity[-<tag>]-<date>.json`` (every answer and score), ``.md`` and ``.png``
(accuracy, agreement and perplexity against budget), rewritten after each system.

Usage: .venv/bin/python bench/fidelity.py [--suites retrieval,ruler,lm] [--budgets 256,512,1024,2048]
       [--variants snapkv,default,span,...] [--variant LABEL=JSON ...]
       [--kvpress bench/results/fidelity-kvpress-<date>.json]
       [--kvpress-ruler bench/results/fidelity-kvpress-ruler-<date>.json]
       [--all-prompts] [--limit N] [--lm-context-lens 2000,4000] [--lm-passages 3] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import requests
from common import teacher_forced
from common.report import ReportPaths, provenance_line, write_json
from common.systems import ServerSettings, args_for_report, machine, prepare_model, server_for, shared_server_args

from kvsparse_testbed import continuations, retrieval, ruler
from kvsparse_testbed.frozen_suite import FROZEN_SUITE
from kvsparse_testbed.server import ServerStartError
from kvsparse_testbed.texts import essay_text

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_BUDGETS = (256, 512, 1024, 2048)
SUITES = ("retrieval", "ruler", "lm")
FULL = "full"
FULL_FLAGS = ("--kvsparse-preset", "off")


def _default_with(config: dict) -> Callable[[int], tuple[str, ...]]:
    """The default recipe (layers 0 and 1 full) with `config` (a `--kvsparse-config` object)."""
    return lambda budget: (
        *("--kvsparse-full-layers", "0,1", "--kvsparse-budget", str(budget)),
        *("--kvsparse-config", json.dumps(config)),
    )


def custom_variant(spec: str) -> tuple[str, Callable[[int], tuple[str, ...]]]:
    """`--variant LABEL=JSON`: the default recipe with a `--kvsparse-config` object, named
    LABEL (letters, digits, `_` and `.`), e.g. `span.w16={"window": 16, "policy": "span"}`."""
    label, sep, text = spec.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z0-9_.]+", label):
        raise argparse.ArgumentTypeError(f"expected LABEL=JSON with LABEL of letters, digits, '_' or '.', got {spec!r}")
    try:
        config = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"{label}: not JSON ({error})") from None
    if not isinstance(config, dict):
        raise argparse.ArgumentTypeError(f"{label}: expected a JSON object, got {text!r}")
    return label, _default_with(config)


VARIANTS: dict[str, Callable[[int], tuple[str, ...]]] = {
    "snapkv": lambda budget: ("--kvsparse-preset", "snapkv", "--kvsparse-budget", str(budget)),
    "default": lambda budget: ("--kvsparse-full-layers", "0,1", "--kvsparse-budget", str(budget)),
    **{policy: _default_with({"policy": policy}) for policy in ("span", "h2o", "tova", "streamingllm", "keynorm")},
}
SETTINGS = ServerSettings(
    model="default",
    device="cpu",
    dtype="float32",
    max_total_tokens=16384,
    mem_fraction_static=None,
    decode_log_interval=40,
    startup_timeout_s=900.0,
)


def say(message: str) -> None:
    print(f"[fidelity] {message}", flush=True)


def build_prompts() -> list[retrieval.RetrievalPrompt]:
    essays = essay_text(retrieval.min_essay_chars())
    return retrieval.passkey_prompts() + retrieval.needle_prompts(essays)


def build_ruler_prompts(
    seeds: list[int], tasks: list[str], lengths: list[int], per_length: int
) -> list[ruler.RulerPrompt]:
    essays = essay_text(ruler.min_essay_chars(lengths))
    return ruler.ruler_suite(essays, seeds, tasks, lengths, per_length)


def ask(base_url: str, prompt: retrieval.RetrievalPrompt | ruler.RulerPrompt, max_new_tokens: int) -> dict[str, Any]:
    """One greedy chat completion; the answer, whether it is right, and the prompt's token count."""
    body = {
        "model": "default",
        "messages": [{"role": "user", "content": prompt.user_message}],
        "temperature": 0,
        "max_tokens": max_new_tokens,
    }
    response = requests.post(f"{base_url}/v1/chat/completions", json=body, timeout=900)
    response.raise_for_status()
    result = response.json()
    output = result["choices"][0]["message"]["content"] or ""
    return {
        "output": output,
        "correct": prompt.correct(output),
        "prompt_tokens": result["usage"]["prompt_tokens"],
    }


def prompts_to_ask(report: dict[str, Any], prompts: list, all_prompts: bool) -> list:
    """The full cache is asked every prompt; a sparse system only those the full cache answered
    (no other counts), unless `all_prompts`."""
    full = next((s for s in report["systems"] if s["name"] == FULL), None)
    if full is None or all_prompts:
        return prompts
    return [p for p in prompts if full["answers"].get(p.prompt_id, {}).get("correct")]


def run_system(
    name: str,
    flags: tuple[str, ...],
    shared: list[str],
    prompts: list,
    passages: list[continuations.Passage],
    references: dict[str, list[int]],
    budget: int | None,
    log_dir: Path,
    max_new_tokens: int,
) -> dict[str, Any]:
    """Start one server, ask every prompt longer than `budget`, score the passages, stop it.

    `references` holds the full cache's greedy continuations; the first system (the full cache)
    fills it."""
    system: dict[str, Any] = {
        "name": name,
        "flags": list(flags),
        "budget": budget,
        "answers": {},
        "lm": {},
        "error": None,
    }
    started = time.monotonic()
    try:
        with server_for(name, flags, shared, SETTINGS, log_dir, say) as server:
            for number, prompt in enumerate(prompts, 1):
                tokens = ruler.MAX_NEW_TOKENS if isinstance(prompt, ruler.RulerPrompt) else max_new_tokens
                answer = ask(server.base_url, prompt, tokens)
                if budget is not None and answer["prompt_tokens"] <= budget:
                    continue
                system["answers"][prompt.prompt_id] = answer
                mark = "✓" if answer["correct"] else "✗"
                say(
                    f"[{name}] {number}/{len(prompts)} {prompt.prompt_id} "
                    f"({answer['prompt_tokens']} tok): {mark} {answer['output'][:40]!r}"
                )
            if passages:
                system["lm"] = teacher_forced.run_lm_suite(
                    server.base_url, passages, references, lambda line: say(f"[{name}] {line}")
                )
    except (ServerStartError, requests.RequestException, RuntimeError) as exc:
        say(f"[{name}] failed: {exc}")
        system["error"] = str(exc).splitlines()[0]
    system["seconds"] = round(time.monotonic() - started)
    return system


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


def latest_report(prefix: str) -> Path | None:
    """The newest `<prefix>-<date>.json` in bench/results."""
    reports = sorted(RESULTS_DIR.glob(f"{prefix}-[0-9]*.json"))
    return reports[-1] if reports else None


#: Report fields that must be equal for `--resume` to reuse an earlier run's systems (of its
#: settings, all but which variants, budgets and RULER seeds run: a kept system must also have the
#: same flags, and asks only the RULER prompts of seeds added since). kvpress's reports are not
#: among them: they are references, read again for every write (the retrieval prompts one selects
#: are in `prompt_ids`), so a resumed run redraws its tables against the latest (a finished run
#: resumed only redraws).
_RUN_IDENTITY = ("server_args", "prompt_ids", "passage_ids")
_PLAN_SETTINGS = ("variants", "budgets", "ruler_seeds")


def resumable(paths: ReportPaths, report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The systems of an earlier run of the same settings that ran without error, by name, and
    its full cache's greedy continuations (into `report`); nothing when there is no such run."""
    if not paths.json.is_file():
        return {}
    earlier = json.loads(paths.json.read_text())

    def measured(settings: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in settings.items() if key not in _PLAN_SETTINGS}

    same_settings = measured(earlier["settings"]) == measured(report["settings"])
    ruler_now = set(zip(report["ruler_prompt_ids"], report["ruler_answers"], strict=True))
    same_ruler = set(zip(earlier["ruler_prompt_ids"], earlier["ruler_answers"], strict=True)) <= ruler_now
    if not (same_settings and same_ruler) or any(earlier.get(key) != report.get(key) for key in _RUN_IDENTITY):
        raise SystemExit(f"--resume: {paths.json} was run with other settings; move it away or drop --resume")
    report["full_greedy_continuations"] = earlier["full_greedy_continuations"]
    return {s["name"]: s for s in earlier["systems"] if s["error"] is None}


def not_yet_asked(system: dict[str, Any], prompts: list, report: dict[str, Any]) -> list:
    """Of `prompts`, those a kept `system` has not answered, nor skipped as no longer than its
    budget (by the full cache's token counts, in `report`): the prompts of RULER seeds added
    since it ran."""
    new = [p for p in prompts if p.prompt_id not in system["answers"]]
    if system["budget"] is None:
        return new
    full = next(s for s in report["systems"] if s["name"] == FULL)["answers"]
    return [p for p in new if full[p.prompt_id]["prompt_tokens"] > system["budget"]]


def extend(kept: dict[str, Any], more: dict[str, Any]) -> dict[str, Any]:
    """A kept system with the answers of its run on the prompts it had not been asked."""
    return {
        **kept,
        "answers": {**kept["answers"], **more["answers"]},
        "error": more["error"],
        "seconds": kept["seconds"] + more["seconds"],
    }


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suites", default=",".join(SUITES), help=f"comma-separated, of {SUITES}")
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    parser.add_argument(
        "--variant",
        type=custom_variant,
        action="append",
        default=[],
        metavar="LABEL=JSON",
        help="also a system of the default recipe with this --kvsparse-config (repeatable)",
    )
    parser.add_argument(
        "--kvpress",
        type=Path,
        default=latest_report("fidelity-kvpress"),
        help="kvpress retrieval report to compare with (default: the latest in bench/results)",
    )
    parser.add_argument(
        "--kvpress-ruler",
        type=Path,
        default=latest_report("fidelity-kvpress-ruler"),
        help="kvpress report on the RULER-style prompts (default: the latest in bench/results)",
    )
    parser.add_argument(
        "--kvpress-lm",
        type=Path,
        default=latest_report("fidelity-kvpress-lm"),
        help="kvpress language-model report (default: the latest in bench/results)",
    )
    parser.add_argument("--no-kvpress", action="store_true", help="compare with nothing external")
    parser.add_argument("--max-new-tokens", type=int, default=16)
    parser.add_argument("--limit", type=int, help="only the first N prompts of each retrieval suite (a quick look)")
    parser.add_argument(
        "--all-prompts",
        action="store_true",
        help="also ask the prompts a full cache misses (kvpress's; this server's, of the sparse systems)",
    )
    parser.add_argument("--ruler-tasks", type=lambda text: text.split(","), default=list(ruler.TASKS))
    parser.add_argument(
        "--ruler-lengths", type=_ints, default=list(ruler.DEFAULT_LENGTHS), help="haystack tokens of the ruler prompts"
    )
    parser.add_argument(
        "--ruler-per-length", type=int, default=ruler.DEFAULT_PER_LENGTH, help="ruler prompts per task and length"
    )
    parser.add_argument(
        "--ruler-seeds",
        type=_ints,
        default=[0],
        help="the ruler prompts of each of these seeds (the suite grows by a seed)",
    )
    parser.add_argument(
        "--frozen-suite",
        action="store_true",
        help=f"the ruler prompts of the frozen suite {FROZEN_SUITE.name} (its seeds, tasks and lengths; hash checked)",
    )
    parser.add_argument("--lm-context-lens", type=_ints, default=list(continuations.DEFAULT_CONTEXT_LENS))
    parser.add_argument(
        "--lm-passages", type=int, default=continuations.DEFAULT_PASSAGES_PER_LEN, help="passages per context length"
    )
    parser.add_argument(
        "--lm-continuation", type=int, default=continuations.DEFAULT_CONTINUATION_LEN, help="forced tokens per passage"
    )
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tag", default="", help="name the report fidelity-<tag>-<date> (runs of one day apart)")
    parser.add_argument(
        "--resume", action="store_true", help="keep the systems today's report measured without error; run the rest"
    )
    args = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    budgets = sorted(_ints(args.budgets))
    variants = [v for v in args.variants.split(",") if v]
    suites = args.suites.split(",")
    unknown = [v for v in variants if v not in VARIANTS] + [s for s in suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown --variants/--suites {unknown}; choose from {list(VARIANTS)} and {list(SUITES)}")
    recipes = {**{variant: VARIANTS[variant] for variant in variants}, **dict(args.variant)}
    if len(recipes) < len(variants) + len(args.variant):
        parser.error("a --variant label repeats another system's name")

    prompts = build_prompts() if "retrieval" in suites else []
    kvpress = None
    if prompts and not args.no_kvpress:
        if args.kvpress is None:
            parser.error("no kvpress report in bench/results: run bench/fidelity_kvpress.py, or --no-kvpress")
        kvpress = load_kvpress(args.kvpress, prompts)
        if not args.all_prompts:
            prompts = [p for p in prompts if kvpress["prompts"][p.prompt_id]["full"]["correct"]]
    prompts = prompts[: args.limit] if args.limit else prompts
    ruler_prompts = []
    if "ruler" in suites and args.frozen_suite:
        ruler_prompts = FROZEN_SUITE.prompts()
        args.ruler_seeds, args.ruler_tasks = list(FROZEN_SUITE.seeds), list(FROZEN_SUITE.tasks)
        args.ruler_lengths, args.ruler_per_length = list(FROZEN_SUITE.lengths), FROZEN_SUITE.per_length
    elif "ruler" in suites:
        try:
            ruler_prompts = build_ruler_prompts(
                args.ruler_seeds, args.ruler_tasks, args.ruler_lengths, args.ruler_per_length
            )
        except ValueError as exc:
            parser.error(str(exc))
    ruler_prompts = ruler_prompts[: args.limit] if args.limit else ruler_prompts
    kvpress_ruler = None
    if ruler_prompts and not args.no_kvpress and args.kvpress_ruler is not None:
        kvpress_ruler = load_kvpress(args.kvpress_ruler, ruler_prompts, strict=False)
    date = dt.date.today().isoformat()
    paths = ReportPaths(args.out_dir, f"fidelity-{args.tag + '-' if args.tag else ''}{date}")
    log_dir = args.out_dir / f"{paths.stem}-logs"
    model_dir, load_args = prepare_model(SETTINGS, log_dir)
    passages = (
        teacher_forced.build_passages(model_dir, args.lm_context_lens, args.lm_passages, args.lm_continuation)
        if "lm" in suites
        else []
    )
    kvpress_lm = None
    if passages and not args.no_kvpress and args.kvpress_lm is not None:
        kvpress_lm = load_kvpress_lm(args.kvpress_lm, passages)
    shared = shared_server_args(SETTINGS, model_dir, load_args) + list(teacher_forced.SERVER_FLAGS)
    report: dict[str, Any] = {
        "benchmark": "fidelity",
        "date": date,
        "machine": machine(),
        "server_args": args_for_report(shared, model_dir),
        "settings": {
            "suites": suites,
            "budgets": budgets,
            "variants": list(recipes),
            "max_new_tokens": args.max_new_tokens,
            "ruler_tasks": args.ruler_tasks,
            "ruler_lengths": args.ruler_lengths,
            "ruler_per_length": args.ruler_per_length,
            "ruler_seeds": args.ruler_seeds,
            "ruler_suite": {"name": FROZEN_SUITE.name, "sha256": FROZEN_SUITE.sha256} if args.frozen_suite else None,
            "lm_context_lens": args.lm_context_lens,
            "lm_passages_per_len": args.lm_passages,
            "lm_continuation_len": args.lm_continuation,
        },
        "prompt_ids": [p.prompt_id for p in prompts],
        "answers": [p.answer for p in prompts],
        "ruler_prompt_ids": [p.prompt_id for p in ruler_prompts],
        "ruler_answers": [p.answer for p in ruler_prompts],
        "passage_ids": [p.passage_id for p in passages],
        "full_greedy_continuations": {},
        "kvpress": kvpress and {k: v for k, v in kvpress.items() if k != "prompts"},
        "kvpress_ruler": kvpress_ruler and {k: v for k, v in kvpress_ruler.items() if k != "prompts"},
        "kvpress_lm": kvpress_lm and kvpress_lm["path"],
        "systems": [],
    }
    # Budget by budget, tightest first: a run cut short still compares every variant at its budgets.
    plan = [(FULL, FULL_FLAGS, None)] + [
        (f"{variant}-{budget}", recipe(budget), budget) for budget in budgets for variant, recipe in recipes.items()
    ]
    say(
        f"{len(prompts)} + {len(ruler_prompts)} prompts, {len(passages)} passages; {len(plan)} servers: "
        f"{', '.join(name for name, _, _ in plan)}"
    )
    done = resumable(paths, report) if args.resume else {}
    for name, flags, budget in plan:
        kept = done.get(name) if name in done and done[name]["flags"] == list(flags) else None
        asked = prompts_to_ask(report, prompts + ruler_prompts, args.all_prompts)
        if kept is not None:
            asked = not_yet_asked(kept, asked, report)
            say(f"[{name}] kept from {paths.json.name}" + (f"; asking {len(asked)} new prompts" if asked else ""))
            if not asked:
                report["systems"].append(kept)
                continue
        system = run_system(
            name,
            flags,
            shared,
            asked,
            [] if kept is not None else passages,  # a kept system scored them already
            report["full_greedy_continuations"],
            budget,
            log_dir,
            args.max_new_tokens,
        )
        report["systems"].append(system if kept is None else extend(kept, system))
        write_report(paths, report, {"retrieval": kvpress, "ruler": kvpress_ruler, "lm": kvpress_lm})
        if name == FULL and system["error"] is not None:
            say("the full cache failed: nothing to compare with")
            break
    # Once more: a resumed run that kept every system redraws its tables against today's kvpress.
    write_report(paths, report, {"retrieval": kvpress, "ruler": kvpress_ruler, "lm": kvpress_lm})
    print(paths.markdown.read_text(), flush=True)
    say(f"wrote {paths.json}, {paths.markdown}, {paths.png}")
    return 0 if all(s["error"] is None for s in report["systems"]) else 1


if __name__ == "__main__":
    sys.exit(main())
