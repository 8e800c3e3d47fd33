"""The external reference for the language-model suite: NVIDIA kvpress, teacher-forced on the same
essay passages as ``bench/fidelity.py --suites lm``.

Run with the kvpress environment (``bash scripts/setup-kvpress.sh`` creates it)::

    .venv-kvpress/bin/python bench/fidelity_kvpress_lm.py

For every passage of ``kvsparse_testbed.continuations`` the context is prefilled once, each layer's
keys and values handed to every press (``fidelity_kvpress.prefill_fan_out``, checked against
kvpress's own path on the first passage). The full cache decodes its greedy continuation; then the
full cache and each press at each budget are teacher-forced, a token a step at the true positions,
on the real continuation (perplexity, top-1) and on that greedy continuation (agreement). kvpress
compresses at prefill only: every continuation token stays in its cache, whereas the project's
server also evicts while decoding.

Writes ``bench/results/fidelity-kvpress-lm-<date>.json`` and ``.md``, rewritten after each passage.
"""

from __future__ import annotations

import argparse
import copy
import datetime as dt
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from common.report import ReportPaths, provenance_line, write_json
from fidelity_kvpress import (
    DEFAULT_BUDGETS,
    add_method_arguments,
    check_fan_out,
    compression_ratio,
    greedy,
    prefill_fan_out,
    prepare_run,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from kvsparse_testbed import continuations
from kvsparse_testbed.continuations import ForcedScore, total

FULL = "full"


def forced_records(
    model: PreTrainedModel, first_logits: torch.Tensor, cache: DynamicCache, context_len: int, forced: list[int]
) -> list[list[float]]:
    """[logprob of the forced token, top id] per step: the first from the prefill's logits, each
    next one from a decode step of the forced token over a copy of `cache`, at its true position.
    One token a step, as kvpress decodes: its layers may keep different numbers of entries
    (PyramidKV), which one causal mask over several new tokens could not describe."""
    cache = copy.deepcopy(cache)
    logits = [first_logits]
    with torch.inference_mode():
        for step, token in enumerate(forced[:-1]):
            logits.append(
                model(
                    input_ids=torch.tensor([[token]]),
                    past_key_values=cache,
                    position_ids=torch.tensor([[context_len + step]]),
                    use_cache=True,
                ).logits[0, -1]
            )
    logprobs = torch.log_softmax(torch.stack(logits).float(), dim=-1)
    return [[float(logprobs[i, token]), int(logprobs[i].argmax())] for i, token in enumerate(forced)]


def scores(
    model: PreTrainedModel,
    first_logits: torch.Tensor,
    cache: DynamicCache,
    context_len: int,
    real: list[int],
    greedy_ids: list[int],
) -> dict[str, dict[str, float]]:
    return {
        reference: ForcedScore.of(forced_records(model, first_logits, cache, context_len, ids), ids).to_json()
        for reference, ids in (("real", real), ("full_greedy", greedy_ids))
    }


def summary_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Token-weighted totals per system over the passages scored so far; the perplexity ratio is
    to the full cache on the same passages (a press skips passages no longer than its budget)."""
    settings = report["settings"]
    systems = [FULL] + [f"{m}-{b}" for m in settings["methods"] for b in settings["budgets"]]
    rows = []
    for system in systems:
        passages = [p for p in report["passages"] if system in p["scores"]]
        if not passages:
            continue
        real, greedy_score = (
            total([ForcedScore.from_json(p["scores"][system][ref]) for p in passages])
            for ref in ("real", "full_greedy")
        )
        full = total([ForcedScore.from_json(p["scores"][FULL]["real"]) for p in passages])
        method, _, budget = system.partition("-")
        rows.append(
            {
                "system": f"kvpress {system}" if budget else FULL,
                "method": method,
                "budget": int(budget) if budget else None,
                "passages": len(passages),
                "tokens": real.tokens,
                "perplexity": real.perplexity,
                "perplexity_ratio": real.perplexity / full.perplexity,
                "top1_real": real.top1_rate,
                "agreement_with_full": greedy_score.top1_rate,
            }
        )
    return rows


def markdown(report: dict[str, Any]) -> str:
    settings = report["settings"]
    lines = [
        f"# kvpress, teacher-forced on essay passages — {report['date']}",
        provenance_line(report),
        "",
        f"- kvpress {settings['kvpress']}, transformers {settings['transformers']}, torch {settings['torch']}, "
        f"{settings['dtype']}, {settings['attention']}, CPU",
        f"- {settings['passages_per_len']} passages per context length "
        f"({', '.join(f'{n:,}' for n in settings['context_lens'])} tokens), {settings['continuation_len']} forced "
        "tokens each; presses compress the context at prefill (ratio "
        f"{settings['compression_ratio']}), the continuation is never evicted",
        "",
        "Each row is over the passages longer than its budget; *vs full* is the perplexity ratio to the",
        "full cache on those same passages.",
        "",
        "| system | budget | tokens | perplexity | vs full | top-1 (real text) | agreement with full |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary_rows(report):
        budget = "—" if row["budget"] is None else f"{row['budget']:,}"
        lines.append(
            f"| {row['system']} | {budget} | {row['tokens']} | {row['perplexity']:.3f} | "
            f"{row['perplexity_ratio']:.3f} | {row['top1_real']:.3f} | {row['agreement_with_full']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: the converted default model)")
    add_method_arguments(parser)
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    parser.add_argument("--context-lens", default=",".join(map(str, continuations.DEFAULT_CONTEXT_LENS)))
    parser.add_argument(
        "--passages", type=int, default=continuations.DEFAULT_PASSAGES_PER_LEN, help="passages per context length"
    )
    parser.add_argument("--continuation", type=int, default=continuations.DEFAULT_CONTINUATION_LEN)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir, methods, budgets = prepare_run(args)
    context_lens = [int(n) for n in args.context_lens.split(",")]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    passages = continuations.tokenized_essay_passages(tokenizer, context_lens, args.passages, args.continuation)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    date = dt.date.today().isoformat()
    paths = ReportPaths(args.out_dir, f"fidelity-kvpress-lm-{date}")
    report: dict[str, Any] = {
        "benchmark": "fidelity-kvpress-lm",
        "date": date,
        "settings": {
            "model_name": model_dir.name,
            "dtype": "float32",
            "attention": "sdpa",
            "threads": args.threads,
            "kvpress": version("kvpress"),
            "transformers": version("transformers"),
            "torch": torch.__version__,
            "methods": list(methods),
            "budgets": budgets,
            "context_lens": context_lens,
            "passages_per_len": args.passages,
            "continuation_len": args.continuation,
            "compression_ratio": "1 - (budget + 0.5) / context_tokens",
        },
        "passages": [],
    }
    print(f"[kvpress-lm] {len(passages)} passages, methods {list(methods)}, budgets {budgets}", flush=True)
    started = time.monotonic()
    for number, passage in enumerate(passages, 1):
        ids = torch.tensor([passage.context_ids])
        n = ids.shape[1]
        presses = {(m, b): press(compression_ratio(b, n)) for m, press in methods.items() for b in budgets if b < n}
        if number == 1:
            report["fan_out_check"] = check_fan_out(model, ids, presses)
        first_logits, full, caches = prefill_fan_out(model, ids, presses)
        real = list(passage.continuation_ids)
        greedy_ids = greedy(model, first_logits, copy.deepcopy(full), n, len(real), stop_ids=set())
        record: dict[str, Any] = {
            "passage_id": passage.passage_id,
            "context_tokens": n,
            "full_greedy": greedy_ids,
            "scores": {},
        }
        record["scores"][FULL] = scores(model, first_logits, full, n, real, greedy_ids)
        for (method, budget), cache in caches.items():
            record["scores"][f"{method}-{budget}"] = scores(model, first_logits, cache, n, real, greedy_ids)
        report["passages"].append(record)
        report["summary"] = summary_rows(report)
        write_json(paths, report)
        paths.markdown.write_text(markdown(report))
        print(f"[{number}/{len(passages)}] {passage.passage_id}: {time.monotonic() - started:.0f} s so far", flush=True)
    print(paths.markdown.read_text())
    print(f"[kvpress-lm] wrote {paths.json} and {paths.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
