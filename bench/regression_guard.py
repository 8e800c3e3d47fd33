"""Which prompts of the frozen suite the default answers at small budgets: the regression guard's
selection (`tests/e2e/test_regression_guard.py` asks those again and fails when one is lost).

One server as the end-to-end tests' "uncached" server starts it (the default preset, float32,
`--disable-radix-cache`, the CPU pool of `serving_defaults.CPU_MAX_TOTAL_TOKENS`); each prompt
asked once per budget through a request's own budget (`custom_params`), greedy, through the chat
endpoint as `bench/fidelity.py` asks. Writes `<out-dir>/<stem>.json` and `.md` with every answer
and the ids answered at every budget.

    .venv/bin/python bench/regression_guard.py --seeds 3 --lengths 2000,3000   # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
from pathlib import Path
from typing import Any

from common.checkout import ROOT, importable
from common.frozen import SERVER_FLAGS, SERVER_SETTINGS, add_selection_arguments, ask, selection
from common.report import ReportPaths, provenance, provenance_line, write_json
from common.systems import args_for_report, machine, prepare_model, server_for, shared_server_args

importable()

from kvsparse_testbed.frozen_suite import FROZEN_SUITE  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_selection_arguments(parser, seeds="3")
    parser.add_argument("--full-cache", action="store_true", help="also ask a server with sparsity off")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--stem", default=f"regression-guard-{dt.date.today().isoformat()}")
    args = parser.parse_args()
    prompts, budgets = selection(args)
    made = provenance(sys.argv)  # the code that runs, whatever changes while it does
    answers: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory() as work:
        model_dir, load_args = prepare_model(SERVER_SETTINGS, Path(work))
        shared = shared_server_args(SERVER_SETTINGS, model_dir, load_args)
        with server_for("project", SERVER_FLAGS, shared, SERVER_SETTINGS, Path(work), print) as server:
            for number, prompt in enumerate(prompts, 1):
                answers[prompt.prompt_id] = {str(b): ask(server.base_url, prompt, {"budget": b}) for b in budgets}
                marks = " ".join(
                    f"{b}:{'ok' if answers[prompt.prompt_id][str(b)]['correct'] else '--'}" for b in budgets
                )
                print(f"[{number}/{len(prompts)}] {prompt.prompt_id} {marks}", flush=True)
        if args.full_cache:
            off = ("--kvsparse-preset", "off", *SERVER_FLAGS)
            with server_for("full-cache", off, shared, SERVER_SETTINGS, Path(work), print) as server:
                for prompt in prompts:
                    answers[prompt.prompt_id]["full"] = ask(server.base_url, prompt, None)
    full = [pid for pid, by_budget in answers.items() if by_budget.get("full", {}).get("correct")]
    kept = [pid for pid, by_budget in answers.items() if all(by_budget[str(b)]["correct"] for b in budgets)]
    report = {
        "benchmark": "regression-guard",
        "date": dt.date.today().isoformat(),
        "machine": machine(),
        "provenance": made,
        "suite": {"name": FROZEN_SUITE.name, "sha256": FROZEN_SUITE.sha256},
        "server_args": [*SERVER_FLAGS, *args_for_report(shared, model_dir)],
        "budgets": budgets,
        "expected": {p.prompt_id: p.answer for p in prompts},
        "answers": answers,
        "answered_at_every_budget": kept,
        "answered_by_the_full_cache": full if args.full_cache else None,
    }
    paths = ReportPaths(args.out_dir, args.stem)
    write_json(paths, report)
    keys = [str(b) for b in budgets] + (["full"] if args.full_cache else [])
    columns = [f"budget {b}" for b in budgets] + (["full cache"] if args.full_cache else [])
    lines = [
        f"# Regression guard selection ({report['date']})",
        provenance_line(report),
        f"- Suite `{FROZEN_SUITE.name}` (sha256 `{FROZEN_SUITE.sha256[:16]}`), seeds {args.seeds}, tasks "
        f"{args.tasks}, lengths {args.lengths}; the default preset with a request budget of each of {budgets}",
        "",
        "| prompt | expected | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
        *(
            f"| {pid} | {report['expected'][pid]} | "
            + " | ".join("yes" if answers[pid][key]["correct"] else "no" for key in keys)
            + " |"
            for pid in answers
        ),
        "",
        "Answered: "
        + ", ".join(
            f"{column} {sum(a[key]['correct'] for a in answers.values())}" for column, key in zip(columns, keys)
        )
        + f" of {len(answers)}; at every budget: {len(kept)}.",
        "",
    ]
    paths.markdown.write_text("\n".join(lines))
    print(f"answered at every budget: {len(kept)} of {len(answers)}: {', '.join(kept)}")


if __name__ == "__main__":
    main()
