"""The external accuracy reference: NVIDIA kvpress on the retrieval suite, same model and budgets.

Run with the kvpress environment (``bash scripts/setup-kvpress.sh`` creates it)::

    .venv-kvpress/bin/python bench/fidelity_kvpress.py

For every prompt of ``kvsparse_testbed.retrieval`` (passkey and needle-in-essays, chat-formatted
with the model's template), it answers greedily with the full KV cache and with kvpress's
SnapKVPress, PyramidKVPress and StreamingLLMPress (their default parameters) keeping each budget of
tokens per layer. As in the project's server, the press compresses the cache of the *whole* prompt,
question included, at the end of prefill; decoding then runs on the compressed cache.

One prefill serves every variant. A press never changes the prefill's own computation (kvpress
compresses each layer's cache in a hook that runs after that layer's attention), so the hook here
hands each layer's full keys and values to every press's own ``forward_hook``, each with its own
cache. On the first prompt the result is checked against kvpress's normal ``with press(model):``
path (bit-identical caches, or the run stops).

Writes ``bench/results/fidelity-kvpress-<date>.json`` (every answer) and ``.md`` (accuracy per
method and budget over the prompts the full cache solves), rewritten after each prompt.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from common.report import ReportPaths, write_json
from kvpress import PyramidKVPress, SnapKVPress, StreamingLLMPress
from kvpress.presses.base_press import BasePress
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel
from transformers.utils import logging as hf_logging

from kvsparse_testbed import retrieval
from kvsparse_testbed.texts import essay_text
from sglang_kvsparse.models import ModelUnavailableError, ensure_default_model

METHODS: dict[str, Callable[[float], BasePress]] = {
    "snapkv": lambda ratio: SnapKVPress(compression_ratio=ratio),
    "pyramidkv": lambda ratio: PyramidKVPress(compression_ratio=ratio),
    "streamingllm": lambda ratio: StreamingLLMPress(compression_ratio=ratio),
}
DEFAULT_BUDGETS = (256, 512, 1024, 2048)
Variant = tuple[str, int]  # (method, budget)


def compression_ratio(budget: int, prompt_tokens: int) -> float:
    """The kvpress ratio that keeps `budget` of `prompt_tokens` per layer.

    kvpress keeps ``int(n * (1 - ratio))``; with ``1 - budget / n`` float rounding sometimes gives
    ``budget - 1``, so aim half a token higher (the kept counts are recorded, measured).
    """
    return 1.0 - (budget + 0.5) / prompt_tokens


def chat_ids(tokenizer: Any, user_message: str) -> torch.Tensor:
    """The prompt as the server's chat endpoint would build it: the model's template, one turn."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": user_message}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids


def prefill_fan_out(
    model: PreTrainedModel, ids: torch.Tensor, presses: dict[Variant, BasePress]
) -> tuple[torch.Tensor, DynamicCache, dict[Variant, DynamicCache]]:
    """Prefill once; return the last logits, the full cache and one compressed cache per press.

    ``press(model)`` would also call ``post_init_from_model`` and give each attention module the
    model's ``rotary_emb``; the three presses used here need neither (both are for other presses),
    and ``check_fan_out`` compares the result with that path.
    """
    full = DynamicCache(config=model.config)
    caches = {variant: DynamicCache(config=model.config) for variant in presses}

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        layer = module.layer_idx
        keys, values = full.layers[layer].keys, full.layers[layer].values
        for variant, press in presses.items():
            cache = caches[variant]
            cache.update(keys, values, layer)
            press.forward_hook(module, args, {**kwargs, "past_key_values": cache}, output)
        return output

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.inference_mode():
            logits = model(ids, past_key_values=full, use_cache=True, logits_to_keep=1).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits[0, -1], full, caches


def prefill_kvpress(model: PreTrainedModel, ids: torch.Tensor, press: BasePress) -> DynamicCache:
    """kvpress's own way: prefill inside ``with press(model)``. Used to check the fan-out."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode(), press(model):
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return cache


def greedy(
    model: PreTrainedModel,
    first_logits: torch.Tensor,
    cache: DynamicCache,
    prompt_tokens: int,
    max_new_tokens: int,
    stop_ids: set[int],
) -> list[int]:
    """Greedy decoding on `cache`, at the prompt's true positions (the cache may be shorter)."""
    token = int(first_logits.argmax())
    out = [token]
    with torch.inference_mode():
        for step in range(max_new_tokens - 1):
            if token in stop_ids:
                break
            logits = model(
                input_ids=torch.tensor([[token]]),
                past_key_values=cache,
                position_ids=torch.tensor([[prompt_tokens + step]]),
                use_cache=True,
            ).logits
            token = int(logits[0, -1].argmax())
            out.append(token)
    return out


def check_fan_out(model: PreTrainedModel, ids: torch.Tensor, presses: dict[Variant, BasePress]) -> dict[str, Any]:
    """Compare the fan-out's caches with kvpress's own path, one budget per method."""
    _, _, fanned = prefill_fan_out(model, ids, presses)
    checked: dict[str, Any] = {}
    for method in METHODS:
        variants = sorted(v for v in presses if v[0] == method)
        if not variants:
            continue
        variant = variants[0]
        reference = prefill_kvpress(model, ids, presses[variant])
        identical = all(
            torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            for a, b in zip(fanned[variant].layers, reference.layers)
        )
        checked[f"{method}@{variant[1]}"] = identical
        if not identical:
            raise SystemExit(f"fan-out differs from kvpress's own path for {variant}; not a reference")
    return checked


def kept_per_layer(cache: DynamicCache) -> list[int]:
    """Tokens each layer holds right after prefill: what the press really kept (measured)."""
    return [layer.keys.shape[-2] for layer in cache.layers]


def accuracy_rows(prompts: list[dict[str, Any]], methods: list[str], budgets: list[int]) -> list[dict[str, Any]]:
    """Per suite (and all): full-cache rate, then per method and budget over the solved prompts."""
    rows = []
    for suite in sorted({p["suite"] for p in prompts}) + ["all"]:
        mine = [p for p in prompts if suite in ("all", p["suite"])]
        solved = [p for p in mine if p["full"]["correct"]]
        row: dict[str, Any] = {
            "suite": suite,
            "prompts": len(mine),
            "full_correct": len(solved),
            "methods": {},
        }
        for method in methods:
            per_budget = {}
            for budget in budgets:
                runs = [p["methods"][method].get(str(budget)) for p in solved]
                runs = [r for r in runs if r is not None]
                per_budget[str(budget)] = {
                    "correct": sum(r["correct"] for r in runs),
                    "evaluated": len(runs),
                }
            row["methods"][method] = per_budget
        rows.append(row)
    return rows


def markdown(report: dict[str, Any]) -> str:
    """Accuracy tables: a cell is correct / evaluated, over prompts the full cache solves."""
    budgets = report["settings"]["budgets"]
    methods = list(report["settings"]["press_parameters"])
    lines = [
        f"# Retrieval fidelity, NVIDIA kvpress {report['settings']['kvpress']} ({report['date']})",
        "",
        f"Model {report['settings']['model_name']}, fp32, Hugging Face transformers "
        f"{report['settings']['transformers']} on the CPU, greedy, max "
        f"{report['settings']['max_new_tokens']} new tokens. Budgets are tokens kept per layer "
        "of the whole prompt (question included). Prompt tokens "
        f"{report['summary']['prompt_tokens_min']:,}–{report['summary']['prompt_tokens_max']:,}.",
        "",
        "Each cell: prompts answered correctly / prompts evaluated, over the prompts the full "
        "cache answers correctly (a budget at or above a prompt's length is not evaluated).",
        "",
    ]
    for row in report["accuracy"]:
        lines += [
            f"## {row['suite']}: full cache {row['full_correct']}/{row['prompts']}",
            "",
            "| method | " + " | ".join(f"{b:,}" for b in budgets) + " |",
            "|---|" + "---|" * len(budgets),
            "| full cache | " + " | ".join(f"{row['full_correct']}/{row['full_correct']}" for _ in budgets) + " |",
        ]
        for method, per_budget in row["methods"].items():
            cells = [per_budget[str(b)] for b in budgets]
            lines.append(f"| {method} | " + " | ".join(f"{c['correct']}/{c['evaluated']}" for c in cells) + " |")
        lines.append("")
    lines += [
        "## Per prompt",
        "",
        "| prompt | tokens | answer | full | " + " | ".join(f"{m} {b}" for m in methods for b in budgets) + " |",
        "|---|---|---|---|" + "---|" * (len(methods) * len(budgets)),
    ]
    for p in report["prompts"]:
        marks = []
        for method in methods:
            for budget in budgets:
                run = p["methods"][method].get(str(budget))
                marks.append("—" if run is None else ("✓" if run["correct"] else "✗"))
        lines.append(
            f"| {p['prompt_id']} | {p['prompt_tokens']:,} | {p['answer']} | "
            f"{'✓' if p['full']['correct'] else '✗'} | " + " | ".join(marks) + " |"
        )
    return "\n".join(lines) + "\n"


def write_report(paths: ReportPaths, report: dict[str, Any]) -> None:
    prompts = report["prompts"]
    budgets = report["settings"]["budgets"]
    tokens = [p["prompt_tokens"] for p in prompts]
    report["summary"] = {
        "prompts": len(prompts),
        "full_correct": sum(p["full"]["correct"] for p in prompts),
        "solved_prompt_ids": [p["prompt_id"] for p in prompts if p["full"]["correct"]],
        "prompt_tokens_min": min(tokens),
        "prompt_tokens_max": max(tokens),
    }
    report["accuracy"] = accuracy_rows(prompts, list(report["settings"]["press_parameters"]), budgets)
    write_json(paths, report)
    paths.markdown.write_text(markdown(report))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model folder (default: the converted default model)")
    parser.add_argument("--suites", default="passkey,needle")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    parser.add_argument("--lengths", default=",".join(map(str, retrieval.DEFAULT_LENGTHS)))
    parser.add_argument("--depths", default=",".join(map(str, retrieval.DEFAULT_DEPTHS)))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-new-tokens", type=int, default=16)
    # One thread: on a shared 2-core machine two threads made decoding ~15x slower (measured).
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--limit", type=int, help="only the first N prompts (a quick look)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--stem", help="report name (default fidelity-kvpress-<date>)")
    return parser.parse_args(argv)


def prepare_run(args: argparse.Namespace) -> tuple[Path, list[str], list[int]]:
    """Set torch's threads and quiet transformers; return the model folder and the checked
    --methods and --budgets (exits with a one-line error: 1 without the model, 2 for bad input).
    Shared with bench/fidelity_kvpress_lm.py."""
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model_dir = Path(args.model) if args.model else ensure_default_model()
    except ModelUnavailableError as exc:
        print(f"error: {exc}; run scripts/setup.sh first (it converts the model)", file=sys.stderr)
        raise SystemExit(1) from None
    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        print(f"error: unknown --methods {unknown}; choose from {list(METHODS)}", file=sys.stderr)
        raise SystemExit(2)
    return model_dir, methods, sorted(int(b) for b in args.budgets.split(","))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir, methods, budgets = prepare_run(args)
    lengths = [int(n) for n in args.lengths.split(",")]
    depths = [float(d) for d in args.depths.split(",")]

    prompts: list[retrieval.RetrievalPrompt] = []
    for suite in args.suites.split(","):
        if suite == "passkey":
            prompts += retrieval.passkey_prompts(args.seed, lengths, depths)
        elif suite == "needle":
            essays = essay_text(retrieval.min_essay_chars(lengths))
            prompts += retrieval.needle_prompts(essays, args.seed, lengths, depths)
        else:
            print(f"error: unknown suite {suite!r} (passkey, needle)", file=sys.stderr)
            return 2
    prompts = prompts[: args.limit] if args.limit else prompts

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    stop_ids = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    date = dt.date.today().isoformat()
    paths = ReportPaths(args.out_dir, args.stem or f"fidelity-kvpress-{date}")
    report: dict[str, Any] = {
        "benchmark": "fidelity-kvpress",
        "date": date,
        "settings": {
            "model": str(model_dir),
            "model_name": model_dir.name,
            "dtype": "float32",
            "attention": "sdpa",
            "device": "cpu",
            "threads": args.threads,
            "kvpress": version("kvpress"),
            "transformers": version("transformers"),
            "torch": torch.__version__,
            "press_parameters": {
                m: {k: v for k, v in asdict(METHODS[m](0.0)).items() if k != "compression_ratio"} for m in methods
            },
            "budgets": budgets,
            "max_new_tokens": args.max_new_tokens,
            "seed": args.seed,
            "lengths_target_tokens": lengths,
            "depths": depths,
            "compression_ratio": "1 - (budget + 0.5) / prompt_tokens, whole prompt compressed",
        },
        "prompts": [],
    }
    print(f"[fidelity-kvpress] {len(prompts)} prompts, methods {methods}, budgets {budgets}")
    started = time.monotonic()
    for number, prompt in enumerate(prompts, 1):
        tick = time.monotonic()
        ids = chat_ids(tokenizer, prompt.user_message)
        n = ids.shape[1]
        presses = {
            (method, budget): METHODS[method](compression_ratio(budget, n))
            for method in methods
            for budget in budgets
            if budget < n
        }
        if number == 1:
            report["fan_out_check"] = check_fan_out(model, ids, presses)
            print(f"[fidelity-kvpress] fan-out matches kvpress's own path: {report['fan_out_check']}")
        first_logits, full, caches = prefill_fan_out(model, ids, presses)
        prefill_s = time.monotonic() - tick
        kept = {variant: kept_per_layer(cache) for variant, cache in caches.items()}

        def answer(cache: DynamicCache) -> dict[str, Any]:
            tokens = greedy(model, first_logits, cache, n, args.max_new_tokens, stop_ids)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            return {"output": text, "correct": retrieval.is_correct(prompt.answer, text)}

        record = prompt.to_json()
        del record["user_message"]  # rebuilt from the seed; keeps the JSON readable
        record.update(prompt_tokens=n, full=answer(full), methods={m: {} for m in methods})
        for (method, budget), cache in caches.items():
            result = answer(cache)
            result.update(kept_min=min(kept[(method, budget)]), kept_max=max(kept[(method, budget)]))
            record["methods"][method][str(budget)] = result
        record["seconds"] = {"prefill": round(prefill_s, 1), "total": round(time.monotonic() - tick, 1)}
        report["prompts"].append(record)
        write_report(paths, report)
        hits = " ".join(
            f"{m}:" + "".join("✓" if r["correct"] else "✗" for r in record["methods"][m].values()) for m in methods
        )
        print(
            f"[{number}/{len(prompts)}] {prompt.prompt_id} {n} tok, answer {prompt.answer}: "
            f"full {'✓' if record['full']['correct'] else '✗'} {record['full']['output']!r} "
            f"| {hits} ({record['seconds']['total']} s, {time.monotonic() - started:.0f} s so far)",
            flush=True,
        )
    print(f"[fidelity-kvpress] wrote {paths.json} and {paths.markdown}")
    print(paths.markdown.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
