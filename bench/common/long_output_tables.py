"""The tables of a long-output report, shared by `bench/long_outputs.py` (the project's server)
and `bench/long_outputs_kvpress.py` (kvpress's decoding-time presses): per output length, each
system's metrics against the full cache's output of the same prompt, then the first divergence by
task. Plain Python over the reports' JSON, so both environments import it."""

from __future__ import annotations

from statistics import mean
from typing import Any

from kvsparse_testbed.long_outputs import LOOP_EXCESS, LOOP_NGRAM, TASKS

#: What the tables' columns measure.
METRICS = (
    "Against the full cache's output of the same prompt: **first divergence** (mean position of the first "
    "different token), **agreement** (share of positions with the same token), **score** (the task's, mean "
    f"over the checkable tasks), **loops** (outputs whose repeated {LOOP_NGRAM}-grams exceed the full cache's "
    f"by {LOOP_EXCESS:.0%} of the output)."
)


def summary(data: dict[str, Any], system: str, output_len: int, task: str | None = None) -> dict[str, Any] | None:
    """A system's metrics over the prompts of one output length (and task) it answered."""
    rows = [
        answers[system]
        for prompt_id, answers in data["answers"].items()
        if system in answers
        and data["prompts"][prompt_id]["output_len"] == output_len
        and (task is None or data["prompts"][prompt_id]["task"] == task)
    ]
    if not rows:
        return None
    scores = [row["score"] for row in rows if row["score"] is not None]
    return {
        "prompts": len(rows),
        "first_divergence": mean(row["first_divergence"] for row in rows),
        "agreement": mean(row["agreement"] for row in rows),
        "score": mean(scores) if scores else None,
        "loops": sum(row["loop_excess"] >= LOOP_EXCESS for row in rows),
    }


def _span(data: dict[str, Any], output_len: int, task: str) -> str:
    """The shortest and longest prompt of a task and output length, in tokens."""
    lens = [p["prompt_len"] for p in data["prompts"].values() if p["output_len"] == output_len and p["task"] == task]
    return f"{min(lens):,}-{max(lens):,}" if min(lens) != max(lens) else f"{min(lens):,}"


def _cell(value: float | None, digits: int = 2) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def length_tables(data: dict[str, Any]) -> list[str]:
    """Markdown lines: for each output length of the report, its systems' metrics table and the
    first divergence by task (systems in the report's order)."""
    lengths = sorted({p["output_len"] for p in data["prompts"].values()})
    tasks = [t for t in TASKS if any(p["task"] == t for p in data["prompts"].values())]
    scored = [t for t in tasks if t != "continue"]
    lines: list[str] = []
    for output_len in lengths:
        lines += [
            "",
            f"## {output_len:,} output tokens",
            "",
            "| system | prompts | first divergence | agreement | score | loops | "
            + " | ".join(f"{t} score" for t in scored)
            + " |",
            "|---|---:|---:|---:|---:|---:|" + "---:|" * len(scored),
        ]
        for system in data["systems"]:
            row = summary(data, system["label"], output_len)
            if row is None:
                continue
            per_task = [summary(data, system["label"], output_len, t) for t in scored]
            lines.append(
                f"| {system['label']} | {row['prompts']} | {row['first_divergence']:.0f} | {row['agreement']:.2f} | "
                f"{_cell(row['score'])} | {row['loops']} | "
                + " | ".join(_cell(t["score"] if t else None) for t in per_task)
                + " |"
            )
        spans = {t: _span(data, output_len, t) for t in tasks}
        lines += [
            "",
            "First divergence by task (prompt tokens: "
            + ", ".join(f"{t} {spans[t]}" for t in tasks)
            + "; a prompt shorter than the budget is kept whole, so there only decode-time eviction acts):",
            "",
            "| system | " + " | ".join(tasks) + " |",
            "|---|" + "---:|" * len(tasks),
        ]
        for system in data["systems"]:
            per_task = [summary(data, system["label"], output_len, t) for t in tasks]
            if any(per_task):
                cells = ["—" if t is None else f"{t['first_divergence']:.0f}" for t in per_task]
                lines.append(f"| {system['label']} | " + " | ".join(cells) + " |")
    return lines
