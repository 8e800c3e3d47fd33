"""Write a benchmark's results as JSON, a markdown table and a PNG plot.

Only measured values go in: every number in the tables comes from the run's own JSON, and a
value that was not measured is shown as "—" (never a placeholder number).
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The checkout, whose commit a report records.
ROOT = Path(__file__).resolve().parents[2]

#: Metrics compared between systems: (key in a run row, column title).
METRICS: tuple[tuple[str, str], ...] = (
    ("output_tok_s", "output tok/s"),
    ("total_tok_s", "total tok/s"),
    ("ttft_median_ms", "TTFT median ms"),
    ("ttft_p99_ms", "TTFT P99 ms"),
    ("itl_median_ms", "ITL median ms"),
    ("peak_running", "peak running req"),
    ("kv_bytes_per_request", "KV bytes/req"),
)


@dataclass(frozen=True)
class ReportPaths:
    """Where one run's report files go: ``<dir>/<stem>.json``, ``.md``, ``.png``."""

    directory: Path
    stem: str

    @property
    def json(self) -> Path:
        return self.directory / f"{self.stem}.json"

    @property
    def markdown(self) -> Path:
        return self.directory / f"{self.stem}.md"

    @property
    def png(self) -> Path:
        return self.directory / f"{self.stem}.png"


def ratio_rows(systems: Sequence[dict[str, Any]], baseline: str) -> list[dict[str, Any]]:
    """project / stock for every metric, per system and concurrency measured on both."""
    by_name = {system["name"]: system for system in systems}
    if baseline not in by_name:
        return []
    base_runs = {run["concurrency"]: run for run in by_name[baseline]["runs"]}
    rows = []
    for system in systems:
        if system["name"] == baseline:
            continue
        for run in system["runs"]:
            base = base_runs.get(run["concurrency"])
            if base is None:
                continue
            row: dict[str, Any] = {"system": system["name"], "concurrency": run["concurrency"]}
            for key, _ in METRICS:
                mine, theirs = run.get(key), base.get(key)
                row[key] = mine / theirs if mine is not None and theirs else None
            rows.append(row)
    return rows


def provenance(command: list[str]) -> dict[str, Any]:
    """The commit a report was made at, whether the tree was dirty (uncommitted changes; other
    runs' new reports under bench/results do not count), and the command: every result JSON
    carries it."""

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=False)
        return done.stdout.strip()

    changes = [line for line in git("status", "--porcelain").splitlines() if not line.startswith("?? bench/results/")]
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changes), "command": command}


def write_json(paths: ReportPaths, report: dict[str, Any]) -> None:
    """The report as JSON, with its `provenance` (this process's command) unless it has one."""
    report.setdefault("provenance", provenance(sys.argv))
    paths.directory.mkdir(parents=True, exist_ok=True)
    paths.json.write_text(json.dumps(report, indent=2) + "\n")


def provenance_line(report: dict[str, Any]) -> str:
    """One markdown line: the commit and command a report was made with, and a dirty tree."""
    made = report.get("provenance") or provenance(sys.argv)
    dirty = " (from a dirty tree: uncommitted changes)" if made["dirty"] else ""
    return f"- Made at commit `{made['commit'][:10]}`{dirty} by `{' '.join(made['command'])}`"


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown(report: dict[str, Any]) -> str:
    """The report as markdown: settings, one row per system and concurrency, then the ratios."""
    settings = report["settings"]
    lines = [
        f"# Serving benchmark `{report['profile']}` — {report['date']}",
        provenance_line(report),
        "",
        report["description"],
        "",
        f"- Machine: {report['machine']}",
        f"- Model: {settings['model']} ({settings['dtype']}, {settings['kv_bytes_per_token']:,} dense KV bytes/token)",
        f"- Workload: {_workload(settings)}, SGLang's `sglang.benchmark.serving`",
        f"- Server arguments (every system): `{' '.join(settings['server_args'])}`",
        "",
        "| system | concurrency | done/sent | "
        + " | ".join(title for _, title in METRICS)
        + " | KV source | load avg |",
        "|---|---:|---:|" + "---:|" * len(METRICS) + "---|---|",
    ]
    for system in report["systems"]:
        for run in system["runs"]:
            cells = [_fmt(run.get(key), 0 if key == "kv_bytes_per_request" else 1) for key, _ in METRICS]
            load = " → ".join(f"{value:.1f}" for value in run["load_avg"])
            lines.append(
                f"| {system['name']} | {run['concurrency']} | "
                f"{run['completed']}/{run['num_prompts']} | "
                + " | ".join(cells)
                + f" | {run['kv_bytes_source']} | {load} |"
            )
    lines += ["", "Systems:", ""]
    for system in report["systems"]:
        flags = " ".join(system["flags"])
        if system.get("kv_dtype"):
            flags += f" (KV {system['kv_dtype']}, --max-total-tokens {system['max_total_tokens']:,})"
        flags = flags.strip() or "(none)"
        started = f"started in {system['startup_s']:.0f} s" if system.get("startup_s") is not None else "did not start"
        lines.append(f"- **{system['name']}**: `{system['launcher']}` {flags} — {started}")
        if system.get("error"):
            lines.append(f"  - error: {system['error']}")
    for baseline in dict.fromkeys(row.get("baseline", report["baseline"]) for row in report["ratios"]):
        lines += [
            "",
            f"## Ratio to `{baseline}` (>1 is better for throughput and running "
            "requests, <1 is better for latency and KV bytes)",
            "",
            "| system | concurrency | " + " | ".join(title for _, title in METRICS) + " |",
            "|---|---:|" + "---:|" * len(METRICS),
        ]
        for row in report["ratios"]:
            if row.get("baseline", report["baseline"]) == baseline:
                lines.append(
                    f"| {row['system']} | {row['concurrency']} | "
                    + " | ".join(_fmt(row[key], 3) for key, _ in METRICS)
                    + " |"
                )
    lines += [
        "",
        "Load avg: the machine's 1-minute load average at the start and end of each "
        "level; above its core count, other work competed with the benchmark.",
    ]
    if report.get("notes"):
        lines += ["", "Notes:", ""] + [f"- {note}" for note in report["notes"]]
    return "\n".join(lines) + "\n"


def _workload(settings: dict[str, Any]) -> str:
    prefix = settings.get("shared_prefix")
    if prefix is None:
        return (
            f"{settings['input_len']:,} input / {settings['output_len']:,} output tokens "
            f"(random token ids, seed {settings['seed']})"
        )
    return (
        f"{prefix['groups']} groups × {prefix['prompts_per_group']} prompts, each a shared "
        f"{settings['input_len']:,}-token system prompt and a {prefix['question_len']:,}-token "
        f"question, {settings['output_len']:,} output tokens (random token ids, seed "
        f"{settings['seed']}, generated-shared-prefix)"
    )


def write_markdown(paths: ReportPaths, report: dict[str, Any]) -> None:
    paths.markdown.write_text(markdown(report))


def write_plot(paths: ReportPaths, report: dict[str, Any]) -> None:
    """Throughput and TTFT against concurrency, one line per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for system in report["systems"]:
        runs = [run for run in system["runs"] if run.get("output_tok_s") is not None]
        if not runs:
            continue
        conc = [run["concurrency"] for run in runs]
        left.plot(conc, [run["output_tok_s"] for run in runs], marker="o", label=system["name"])
        right.plot(conc, [run["ttft_median_ms"] / 1000 for run in runs], marker="o", label=system["name"])
    left.set(xlabel="max concurrency", ylabel="output tokens/s", title="Throughput")
    right.set(xlabel="max concurrency", ylabel="TTFT median (s)", title="Time to first token")
    levels = sorted({run["concurrency"] for system in report["systems"] for run in system["runs"]})
    for axis in (left, right):
        axis.set_xscale("log", base=2)
        axis.set_xticks(levels, [str(level) for level in levels])
        axis.minorticks_off()
        axis.grid(True, alpha=0.3)
        axis.legend()
    fig.suptitle(f"{report['profile']} — {report['date']}")
    fig.tight_layout()
    fig.savefig(paths.png, dpi=110)
    plt.close(fig)
