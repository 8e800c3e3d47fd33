"""The external accuracy reference: NVIDIA kvpress on the retrieval suite, same model and budgets.

Run with the kvpress environment (``bash scripts/setup-kvpress.sh`` creates it)::

    .venv-kvpress/bin/python bench/fidelity_kvpress.py

For every prompt of ``kvsparse_testbed.retrieval`` (passkey and needle-in-essays) and, with
``--suites ruler``, of ``kvsparse_testbed.ruler`` (the harder RULER-style tasks, the same prompts
``bench/fidelity.py --suites ruler`` asks), chat-formatted with the model's template, it answers
greedily with the full KV cache and with kvpress's presses keeping each budget of tokens per
layer (SnapKV, PyramidKV and StreamingLLM by default; TOVA, key-norm and Expected Attention by
name, `PRESSES`): at their default parameters (``--methods``) and at any others
(``--variant LABEL=METHOD:JSON``, repeatable, e.g.
``snapkv.w16k15=snapkv:{"window_size": 16, "kernel_size": 15}``), so that a sweep reports
kvpress's best per budget beside its defaults. As in the project's server, the press compresses
the cache of the *whole* prompt, question included, at the end of prefill; decoding then runs on
the compressed cache.

One prefill serves every variant. A press never changes the prefill's own computation (kvpress
compresses each layer's cache in a hook that runs after that layer's attention), so the hook here
hands each layer's full keys and values to every press's own ``forward_hook``, each with its own
cache. On the first prompt the result is checked against kvpress's normal ``with press(model):``
path (bit-identical caches, or the run stops).

Writes ``bench/results/fidelity-kvpress-<date>.json`` (every answer) and ``.md`` (accuracy per
variant and budget over the prompts the full cache solves, and the best variant per budget),
rewritten after each prompt.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from common.report import ReportPaths, provenance_line, write_json
from kvpress import (
    AdaKVPress,
    ExpectedAttentionPress,
    KnormPress,
    PyramidKVPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from kvpress.presses.base_press import BasePress
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel
from transformers.utils import logging as hf_logging

from kvsparse_testbed import retrieval, ruler
from kvsparse_testbed.frozen_suite import FROZEN_SUITE
from kvsparse_testbed.texts import essay_text
from sglang_kvsparse.models import ModelUnavailableError, ensure_default_model

PressFactory = Callable[[float], BasePress]  # compression ratio -> press


def adakv_snapkv(compression_ratio: float, **parameters: Any) -> AdaKVPress:
    """Ada-KV over SnapKV's scores (the pairing of the Ada-KV paper): the budget of every KV head
    together, each head keeping at least `alpha_safeguard` of its share."""
    alpha = parameters.pop("alpha_safeguard", 0.20)
    return AdaKVPress(press=SnapKVPress(compression_ratio=compression_ratio, **parameters), alpha_safeguard=alpha)


#: The presses a run may name (`DEFAULT_METHODS` unless --methods says otherwise).
PRESSES: dict[str, Callable[..., BasePress]] = {
    "snapkv": SnapKVPress,
    "pyramidkv": PyramidKVPress,
    "streamingllm": StreamingLLMPress,
    "tova": TOVAPress,
    "knorm": KnormPress,
    "expected_attention": ExpectedAttentionPress,
    "adakv": adakv_snapkv,
}
DEFAULT_METHODS = ("snapkv", "pyramidkv", "streamingllm")
#: The head-masks an Ada-KV press leaves on each attention module after a prefill (kvpress's
#: attention patch applies them while decoding), per layer; None for a press that drops keys.
Masks = list[Any] | None
DEFAULT_BUDGETS = (256, 512, 1024, 2048)
Variant = tuple[str, int]  # (method label, budget)
Prompt = retrieval.RetrievalPrompt | ruler.RulerPrompt


def press_factory(method: str, parameters: dict[str, Any] | None = None) -> PressFactory:
    """The press `method` with these parameters (kvpress's defaults for the rest) at any ratio."""
    press = PRESSES[method]
    return lambda ratio: press(compression_ratio=ratio, **(parameters or {}))


def parse_press_variant(text: str) -> tuple[str, PressFactory]:
    """`LABEL=METHOD:JSON` -> (label, factory); ValueError naming what is wrong. The parameters
    are checked by building the press once (kvpress rejects unknown or bad ones)."""
    label, sep, spec = text.partition("=")
    method, sep2, params = spec.partition(":")
    if not (sep and sep2 and label):
        raise ValueError(f"--variant {text!r}: expected LABEL=METHOD:JSON")
    if method not in PRESSES:
        raise ValueError(f"--variant {text!r}: unknown method {method!r}; choose from {list(PRESSES)}")
    try:
        parameters = json.loads(params)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--variant {text!r}: the parameters are not JSON ({exc})") from None
    if not isinstance(parameters, dict):
        raise ValueError(f"--variant {text!r}: the parameters must be a JSON object")
    factory = press_factory(method, parameters)
    try:
        factory(0.5)
    except (TypeError, ValueError, AssertionError) as exc:
        raise ValueError(f"--variant {text!r}: {exc}") from None
    return label, factory


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
) -> tuple[torch.Tensor, DynamicCache, dict[Variant, DynamicCache], dict[Variant, Masks]]:
    """Prefill once; return the last logits, the full cache, one compressed cache per press and
    each press's head-masks (Ada-KV masks keys per head rather than dropping them: the mask it
    sets on the module is taken into `masks` and cleared, so that the next press starts clean).

    As ``press(model)`` does, each press is initialised from the model and each attention module
    given the model's ``rotary_emb`` (Expected Attention needs both); ``check_fan_out`` compares
    the result with that path.
    """
    for press in presses.values():
        press.post_init_from_model(model)
    for layer in model.model.layers:
        layer.self_attn.rotary_emb = model.model.rotary_emb
    full = DynamicCache(config=model.config)
    caches = {variant: DynamicCache(config=model.config) for variant in presses}
    masks: dict[Variant, Masks] = {variant: None for variant in presses}

    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        layer = module.layer_idx
        keys, values = full.layers[layer].keys, full.layers[layer].values
        for variant, press in presses.items():
            cache = caches[variant]
            cache.update(keys, values, layer)
            press.forward_hook(module, args, {**kwargs, "past_key_values": cache}, output)
            mask = getattr(module, "masked_key_indices", None)
            if mask is not None:
                masks[variant] = masks[variant] or [None] * len(model.model.layers)
                masks[variant][layer] = mask
                module.masked_key_indices = None
        return output

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in model.model.layers]
    try:
        with torch.inference_mode():
            logits = model(ids, past_key_values=full, use_cache=True, logits_to_keep=1).logits
    finally:
        for handle in handles:
            handle.remove()
    return logits[0, -1], full, caches, masks


def prefill_kvpress(model: PreTrainedModel, ids: torch.Tensor, press: BasePress) -> tuple[DynamicCache, Masks]:
    """kvpress's own way: prefill inside ``with press(model)``; the cache and the head-masks it
    left on the modules (cleared). Used to check the fan-out."""
    cache = DynamicCache(config=model.config)
    with torch.inference_mode(), press(model):
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    masks = use_masks(model, None)
    return cache, masks if any(mask is not None for mask in masks) else None


def use_masks(model: PreTrainedModel, masks: Masks) -> list[Any]:
    """Put these head-masks on the attention modules (None: clear them); return those they had."""
    layers = model.model.layers
    had = [getattr(layer.self_attn, "masked_key_indices", None) for layer in layers]
    for layer, mask in zip(layers, masks or [None] * len(layers)):
        layer.self_attn.masked_key_indices = mask
    return had


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
    """Compare the fan-out's caches with kvpress's own path, one budget per method label."""
    _, _, fanned, fanned_masks = prefill_fan_out(model, ids, presses)
    checked: dict[str, Any] = {}
    for method in dict.fromkeys(label for label, _ in presses):
        variant = min(v for v in presses if v[0] == method)
        reference, reference_masks = prefill_kvpress(model, ids, presses[variant])
        identical = all(
            torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            for a, b in zip(fanned[variant].layers, reference.layers)
        ) and same_masks(fanned_masks[variant], reference_masks)
        checked[f"{method}@{variant[1]}"] = identical
        if not identical:
            raise SystemExit(f"fan-out differs from kvpress's own path for {variant}; not a reference")
    return checked


def same_masks(a: Masks, b: Masks) -> bool:
    """Whether two presses' head-masks (tuples of index tensors per layer) are equal."""
    if a is None or b is None:
        return a is b
    return all(
        (x is None and y is None) or (x is not None and y is not None and all(map(torch.equal, x, y)))
        for x, y in zip(a, b)
    )


def press_parameters(press: BasePress) -> dict[str, Any]:
    """The press's parameters but its ratio."""
    return {k: v for k, v in asdict(press).items() if k != "compression_ratio"}


def kept_per_layer(cache: DynamicCache, masks: Masks) -> list[int]:
    """Tokens each layer holds right after prefill, per KV head on average (a head-mask's entries
    are not kept): what the press really kept (measured)."""
    kept = []
    for number, layer in enumerate(cache.layers):
        tokens = layer.keys.shape[-2]
        mask = masks[number] if masks else None
        kept.append(tokens if mask is None else tokens - len(mask[0]) // layer.keys.shape[1])
    return kept


def accuracy_rows(prompts: list[dict[str, Any]], methods: list[str], budgets: list[int]) -> list[dict[str, Any]]:
    """Per suite (and all): full-cache rate, then per method and budget over the solved prompts,
    and per budget the best method (`best`: its label and counts; ties go to the first listed)."""
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
        row["best"] = {
            str(budget): max(
                ({"method": m, **row["methods"][m][str(budget)]} for m in methods),
                key=lambda cell: cell["correct"],
                default=None,
            )
            for budget in budgets
        }
        rows.append(row)
    return rows


def markdown(report: dict[str, Any]) -> str:
    """Accuracy tables: a cell is correct / evaluated, over prompts the full cache solves."""
    budgets = report["settings"]["budgets"]
    methods = list(report["settings"]["press_parameters"])
    lines = [
        f"# Retrieval fidelity, NVIDIA kvpress {report['settings']['kvpress']} ({report['date']})",
        provenance_line(report),
        "",
        f"Model {report['settings']['model_name']}, fp32, Hugging Face transformers "
        f"{report['settings']['transformers']} on the CPU, greedy, max "
        f"{report['settings']['max_new_tokens']} new tokens ({report['settings']['ruler_max_new_tokens']} "
        "for RULER-style prompts). Budgets are tokens kept per layer "
        "of the whole prompt (question included). Prompt tokens "
        f"{report['summary']['prompt_tokens_min']:,}–{report['summary']['prompt_tokens_max']:,}.",
        "",
        "Each cell: prompts answered correctly / prompts evaluated, over the prompts the full "
        "cache answers correctly (a budget at or above a prompt's length is not evaluated). "
        "With several presses, the last row is the best of them at each budget.",
        "",
        "| press | parameters (kvpress's defaults for the rest) |",
        "|---|---|",
        *(
            f"| {label} | {parameters['method']} "
            + ", ".join(f"{k}={v}" for k, v in parameters.items() if k != "method")
            + " |"
            for label, parameters in report["settings"]["press_parameters"].items()
        ),
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
        if len(row["methods"]) > 1:
            best = [row["best"][str(b)] for b in budgets]
            cells = [f"{c['correct']}/{c['evaluated']} ({c['method']})" for c in best]
            lines.append("| **best of kvpress** | " + " | ".join(cells) + " |")
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
    parser.add_argument(
        "--suites",
        default="passkey,needle",
        help="passkey, needle, ruler, frozen (the frozen suite's prompts of --ruler-tasks and --ruler-lengths)",
    )
    add_method_arguments(parser)
    parser.add_argument("--budgets", default=",".join(map(str, DEFAULT_BUDGETS)))
    parser.add_argument("--lengths", default=",".join(map(str, retrieval.DEFAULT_LENGTHS)))
    parser.add_argument("--depths", default=",".join(map(str, retrieval.DEFAULT_DEPTHS)))
    parser.add_argument("--ruler-tasks", default=",".join(ruler.TASKS))
    parser.add_argument("--ruler-lengths", default=",".join(map(str, ruler.DEFAULT_LENGTHS)))
    parser.add_argument("--ruler-per-length", type=int, default=ruler.DEFAULT_PER_LENGTH)
    parser.add_argument(
        "--ruler-seeds", default="0", help="comma-separated: the ruler prompts of each seed (the suite grows by a seed)"
    )
    parser.add_argument("--seed", type=int, default=0, help="the passkey and needle prompts' seed")
    parser.add_argument(
        "--max-new-tokens", type=int, default=16, help=f"retrieval prompts ({ruler.MAX_NEW_TOKENS} for ruler ones)"
    )
    # One thread: on a shared 2-core machine two threads made decoding ~15x slower (measured).
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--limit", type=int, help="only the first N prompts (a quick look)")
    parser.add_argument(
        "--all-prompts", action="store_true", help="also run the presses where the full cache answers wrong"
    )
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--stem", help="report name (default fidelity-kvpress-<date>)")
    parser.add_argument(
        "--resume",
        action="store_true",
        help="keep the answers the report of this name holds for prompts still asked (same settings but "
        "--ruler-seeds); run the rest",
    )
    return parser.parse_args(argv)


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    """--methods (kvpress's defaults) and --variant (other parameters); shared with the LM runner."""
    parser.add_argument(
        "--methods", default=",".join(DEFAULT_METHODS), help="presses at kvpress's defaults ('' for none)"
    )
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="LABEL=METHOD:JSON",
        help='a press with these parameters, e.g. snapkv.w16k15=snapkv:{"window_size": 16, "kernel_size": 15}',
    )


def prepare_run(args: argparse.Namespace) -> tuple[Path, dict[str, PressFactory], list[int]]:
    """Set torch's threads and quiet transformers; return the model folder, the presses of
    --methods and --variant by label, and the checked --budgets (exits with a one-line error: 1
    without the model, 2 for bad input). Shared with bench/fidelity_kvpress_lm.py."""
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        model_dir = Path(args.model) if args.model else ensure_default_model()
    except ModelUnavailableError as exc:
        print(f"error: {exc}; run scripts/setup.sh first (it converts the model)", file=sys.stderr)
        raise SystemExit(1) from None
    names = [m for m in args.methods.split(",") if m]
    unknown = [m for m in names if m not in PRESSES]
    if unknown:
        print(f"error: unknown --methods {unknown}; choose from {list(PRESSES)}", file=sys.stderr)
        raise SystemExit(2)
    methods = {m: press_factory(m) for m in names}
    for text in args.variant:
        try:
            label, factory = parse_press_variant(text)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        if label in methods:
            print(f"error: --variant label {label!r} is used twice", file=sys.stderr)
            raise SystemExit(2)
        methods[label] = factory
    if not methods:
        print("error: no method: give --methods or --variant", file=sys.stderr)
        raise SystemExit(2)
    return model_dir, methods, sorted(int(b) for b in args.budgets.split(","))


def build_prompts(args: argparse.Namespace) -> list[Prompt]:
    """The --suites' prompts, as `bench/fidelity.py` builds them (ValueError for an unknown suite)."""
    lengths = [int(n) for n in args.lengths.split(",")]
    depths = [float(d) for d in args.depths.split(",")]
    prompts: list[Prompt] = []
    for suite in args.suites.split(","):
        if suite == "passkey":
            prompts += retrieval.passkey_prompts(args.seed, lengths, depths)
        elif suite == "needle":
            essays = essay_text(retrieval.min_essay_chars(lengths))
            prompts += retrieval.needle_prompts(essays, args.seed, lengths, depths)
        elif suite == "frozen":
            tasks, lengths = args.ruler_tasks.split(","), [int(n) for n in args.ruler_lengths.split(",")]
            prompts += [p for p in FROZEN_SUITE.prompts() if p.suite in tasks and p.target_tokens in lengths]
        elif suite == "ruler":
            ruler_lengths = [int(n) for n in args.ruler_lengths.split(",")]
            essays = essay_text(ruler.min_essay_chars(ruler_lengths))
            prompts += ruler.ruler_suite(
                essays, ruler_seeds(args), args.ruler_tasks.split(","), ruler_lengths, args.ruler_per_length
            )
        else:
            raise ValueError(f"unknown suite {suite!r} (passkey, needle, ruler, frozen)")
    return prompts[: args.limit] if args.limit else prompts


def ruler_seeds(args: argparse.Namespace) -> list[int]:
    return [int(seed) for seed in args.ruler_seeds.split(",") if seed]


#: Settings a resumed run may change: which seeds' RULER prompts it asks. Any other difference
#: changes what a kept answer means.
_GROWABLE_SETTINGS = ("ruler_seeds",)


def kept_records(paths: ReportPaths, report: dict[str, Any], prompts: list[Prompt]) -> dict[str, dict[str, Any]]:
    """For --resume: the earlier report's record of every prompt still asked (same id and answer),
    by prompt id, and its fan-out check (into `report`: the same settings, kvpress's version among
    them, need it once); nothing when there is no earlier report. Exits when it ran other settings."""
    if not paths.json.is_file():
        return {}
    earlier = json.loads(paths.json.read_text())
    settings = report["settings"]

    def fixed(values: dict[str, Any]) -> dict[str, Any]:
        return {key: value for key, value in values.items() if key not in _GROWABLE_SETTINGS}

    if fixed(earlier["settings"]) != fixed(settings):
        changed = sorted(k for k in fixed(settings) if earlier["settings"].get(k) != settings[k])
        raise SystemExit(f"--resume: {paths.json} was run with other settings ({', '.join(changed)}); drop --resume")
    if "fan_out_check" in earlier:
        report["fan_out_check"] = earlier["fan_out_check"]
    answers = {prompt.prompt_id: prompt.answer for prompt in prompts}
    return {r["prompt_id"]: r for r in earlier["prompts"] if answers.get(r["prompt_id"]) == r["answer"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir, methods, budgets = prepare_run(args)
    try:
        prompts = build_prompts(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

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
                label: {"method": type(press).__name__, **press_parameters(press)}
                for label, press in ((label, factory(0.0)) for label, factory in methods.items())
            },
            "budgets": budgets,
            "suites": args.suites.split(","),
            "frozen_suite": {"name": FROZEN_SUITE.name, "sha256": FROZEN_SUITE.sha256}
            if "frozen" in args.suites.split(",")
            else None,
            "max_new_tokens": args.max_new_tokens,
            "ruler_max_new_tokens": ruler.MAX_NEW_TOKENS,
            "seed": args.seed,
            "lengths_target_tokens": [int(n) for n in args.lengths.split(",")],
            "depths": [float(d) for d in args.depths.split(",")],
            "ruler_tasks": args.ruler_tasks.split(","),
            "ruler_lengths": [int(n) for n in args.ruler_lengths.split(",")],
            "ruler_per_length": args.ruler_per_length,
            "ruler_seeds": ruler_seeds(args),
            "presses_on_prompts_the_full_cache_misses": args.all_prompts,
            "compression_ratio": "1 - (budget + 0.5) / prompt_tokens, whole prompt compressed",
        },
        "prompts": [],
    }
    earlier = kept_records(paths, report, prompts) if args.resume else {}
    print(
        f"[fidelity-kvpress] {len(prompts)} prompts ({len(earlier)} kept from {paths.json.name}), "
        f"methods {list(methods)}, budgets {budgets}"
    )
    started = time.monotonic()
    for number, prompt in enumerate(prompts, 1):
        if prompt.prompt_id in earlier:
            report["prompts"].append(earlier[prompt.prompt_id])
            continue
        tick = time.monotonic()
        ids = chat_ids(tokenizer, prompt.user_message)
        n = ids.shape[1]
        presses = {
            (method, budget): factory(compression_ratio(budget, n))
            for method, factory in methods.items()
            for budget in budgets
            if budget < n
        }
        if "fan_out_check" not in report:  # the first prompt asked for this report
            report["fan_out_check"] = check_fan_out(model, ids, presses)
            print(f"[fidelity-kvpress] fan-out matches kvpress's own path: {report['fan_out_check']}")
        first_logits, full, caches, masks = prefill_fan_out(model, ids, presses)
        prefill_s = time.monotonic() - tick
        kept = {variant: kept_per_layer(cache, masks[variant]) for variant, cache in caches.items()}

        max_new_tokens = ruler.MAX_NEW_TOKENS if isinstance(prompt, ruler.RulerPrompt) else args.max_new_tokens

        def answer(cache: DynamicCache, head_masks: Masks = None) -> dict[str, Any]:
            use_masks(model, head_masks)
            try:
                tokens = greedy(model, first_logits, cache, n, max_new_tokens, stop_ids)
            finally:
                use_masks(model, None)
            text = tokenizer.decode(tokens, skip_special_tokens=True)
            return {"output": text, "correct": prompt.correct(text)}

        record = prompt.to_json()
        del record["user_message"]  # rebuilt from the seed; keeps the JSON readable
        record.update(prompt_tokens=n, full=answer(full), methods={m: {} for m in methods})
        asked = caches if record["full"]["correct"] or args.all_prompts else {}  # only solved prompts count
        for (method, budget), cache in asked.items():
            result = answer(cache, masks[(method, budget)])
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
    write_report(paths, report)  # again, for kept prompts after the last one asked
    print(f"[fidelity-kvpress] wrote {paths.json} and {paths.markdown}")
    print(paths.markdown.read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
