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
- ``default``: the launcher's default recipe (`--kvsparse-preset default`) at the budget;
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
from common.fidelity_report import FULL, load_kvpress, load_kvpress_lm, say, write_report
from common.report import ReportPaths
from common.systems import ServerSettings, args_for_report, machine, prepare_model, server_for, shared_server_args

from kvsparse_testbed import continuations, retrieval, ruler
from kvsparse_testbed.frozen_suite import FROZEN_SUITE
from kvsparse_testbed.server import ServerStartError
from kvsparse_testbed.texts import essay_text

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_BUDGETS = (256, 512, 1024, 2048)
SUITES = ("retrieval", "ruler", "lm")
FULL_FLAGS = ("--kvsparse-preset", "off")


def _default_with(config: dict) -> Callable[[int], tuple[str, ...]]:
    """The default recipe with `config` (a `--kvsparse-config` object)."""
    return lambda budget: (*VARIANTS["default"](budget), "--kvsparse-config", json.dumps(config))


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
    "default": lambda budget: ("--kvsparse-preset", "default", "--kvsparse-budget", str(budget)),
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
            say(
                "no kvpress retrieval report in bench/results (bench/fidelity_kvpress.py makes one): "
                "every retrieval prompt is asked, compared with nothing external"
            )
        else:
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
