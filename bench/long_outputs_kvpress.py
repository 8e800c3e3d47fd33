"""kvpress's decoding-time compression on a frozen long-output suite: the external reference for
decode-time eviction beside `bench/long_outputs.py`'s policies.

Run with the kvpress environment (``bash scripts/setup-kvpress.sh`` creates it)::

    .venv-kvpress/bin/python bench/long_outputs_kvpress.py   # long-count, 3 presses x 2 budgets
    .venv-kvpress/bin/python bench/long_outputs_kvpress.py --whole-layers 0   # the project's layout

kvpress compresses while decoding through `DecodingPress`: every `compression_interval` steps it
scores each layer's whole cache with a scorer press and keeps `target_size` entries. Here the
interval is the project's `evict_page` and the target the budget, so a layer holds between the
budget and the budget plus one page, as a project sparse layer does. kvpress compresses every
layer; ``--whole-layers 0`` leaves layer 0 whole as the project's default preset does, so that
only the scoring differs. The scorers run at kvpress's defaults: TOVA
(the newest query's attention), key norm and StreamingLLM (sink and newest). SnapKV is not run:
it scores with a window of queries at their own rotary positions, and a decoding step's hook
holds only the newest position's, so kvpress asserts or misplaces them. TOVA and key norm score by
content; kvpress's StreamingLLM scores by index in the cache, and `ScorerPress.compress` keeps its
top entries in score order, not in the sequence's (NVIDIA/kvpress#173), so after the first
compression its "oldest" are no longer the oldest: those rows are kvpress's behaviour, not
StreamingLLM's (`bench/long_outputs.py`'s `streamingllm` is).

Each prompt is plain text tokenized as the server tokenizes it, answered greedily for exactly its
output length (EOS ignored) by Hugging Face transformers (float32, sdpa, the converted default
model): with the full cache (the reference every press is measured against) and with each press
at each budget. With ``--sglang REPORT`` (a `bench/long_outputs.py` report of the same suite)
SGLang's full-cache outputs are measured against this reference too (``sglang full``): how far the
two engines' full caches agree, which bounds how the two reports' columns compare.

Writes ``<out-dir>/<stem>.json`` (the layout of `bench/long_outputs.py`'s, every output) and
``.md``, rewritten after each prompt; ``--resume`` keeps the outputs a report of that name holds,
``--render`` rewrites its markdown from its JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import torch
from common.long_output_tables import METRICS, length_tables
from common.report import ReportPaths, provenance, provenance_line, write_json
from fidelity_kvpress import greedy
from kvpress import DecodingPress, KnormPress, StreamingLLMPress, TOVAPress
from kvpress.presses.scorer_press import ScorerPress
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel
from transformers.utils import logging as hf_logging

from kvsparse_testbed.long_outputs import (
    LONG_COUNT_SUITE,
    LONG_OUTPUT_SUITES,
    TASKS,
    measure,
)
from sglang_kvsparse.models import ModelUnavailableError, ensure_default_model

FULL = "full"
SGLANG_FULL = "sglang full"
#: The project's default `evict_page` (`sglang_kvsparse.config.schema`, which needs triton, absent
#: from kvpress's environment): its sparse layers evict that many entries at once.
EVICT_PAGE = 16
#: The scorer presses a decoding step can drive, at kvpress's defaults.
SCORERS: dict[str, type[ScorerPress]] = {"tova": TOVAPress, "knorm": KnormPress, "streamingllm": StreamingLLMPress}


@dataclass
class WholeLayersDecodingPress(DecodingPress):
    """`DecodingPress` that leaves `whole_layers` uncompressed, as the project's full layers."""

    whole_layers: tuple[int, ...] = ()

    def forward_hook(self, module: torch.nn.Module, input: list[torch.Tensor], kwargs: dict, output: list) -> Any:
        if module.layer_idx in self.whole_layers:
            return output
        return super().forward_hook(module, input, kwargs, output)


def decoding_press(scorer: str, budget: int, interval: int, whole_layers: tuple[int, ...]) -> WholeLayersDecodingPress:
    """kvpress's decoding-time compression to `budget` entries every `interval` steps, scored by
    `scorer`, of every layer but `whole_layers`."""
    return WholeLayersDecodingPress(
        base_press=SCORERS[scorer](), compression_interval=interval, target_size=budget, whole_layers=whole_layers
    )


def answer(
    model: PreTrainedModel, ids: list[int], output_len: int, press: WholeLayersDecodingPress | None
) -> tuple[list[int], int]:
    """A greedy output of exactly `output_len` tokens (EOS ignored) and the largest cache a
    compressed layer held while decoding, with the press (None: the full cache, every layer)."""
    whole = press.whole_layers if press is not None else ()
    cache = DynamicCache(config=model.config)
    largest = 0

    def watch(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        nonlocal largest
        if module.layer_idx not in whole:
            largest = max(largest, cache.layers[module.layer_idx].keys.shape[-2])
        return output

    layers = model.model.layers
    with torch.inference_mode(), press(model) if press is not None else contextlib.nullcontext():
        # Registered after the press's hooks: it sees each layer's cache as the press left it.
        handles = [layer.self_attn.register_forward_hook(watch, with_kwargs=True) for layer in layers]
        try:
            first = model(torch.tensor([ids]), past_key_values=cache, use_cache=True, logits_to_keep=1).logits
            output = greedy(model, first[0, -1], cache, len(ids), output_len, set())
        finally:
            for handle in handles:
                handle.remove()
    return output, largest


def markdown(data: dict[str, Any]) -> str:
    settings = data["settings"]
    tasks = [t for t in TASKS if any(p["task"] == t for p in data["prompts"].values())]
    whole = settings.get("whole_layers", [])  # absent from the first report: every layer compressed
    held = ", ".join(f"{label} {n:,}" for label, n in settings["largest_cache"].items() if label != FULL)
    lines = [
        f"# Long outputs with kvpress's decoding-time compression — {data['date']}",
        provenance_line(data),
        "",
        f"- Suite: `{data['suite']['name']}` (sha256 `{data['suite']['sha256'][:12]}…`), tasks {', '.join(tasks)}; "
        "greedy, EOS ignored, every answer exactly its output length",
        f"- Machine: {data['machine']}; Hugging Face transformers {settings['transformers']}, kvpress "
        f"{settings['kvpress']}, torch {settings['torch']}, float32, sdpa, {settings['threads']} thread(s)",
        f"- `DecodingPress(base_press=<scorer at its defaults>, compression_interval={settings['interval']}, "
        "target_size=<budget>)`: every layer "
        + (f"but {', '.join(map(str, whole))} " if whole else "")
        + "compressed to the budget each interval (it holds at most the budget plus the interval; the most a "
        f"compressed layer held: {held})",
        "",
        f"{METRICS} The reference is transformers' own full-cache output; `{SGLANG_FULL}` is SGLang's full-cache "
        "output of the same prompt measured against it (how far the two engines' references agree).",
        *length_tables(data),
    ]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--suite", default=LONG_COUNT_SUITE.name, choices=sorted(LONG_OUTPUT_SUITES))
    parser.add_argument("--lengths", default="1024", help="output lengths, of the suite's")
    parser.add_argument("--tasks", default="count", help=f"of {', '.join(TASKS)}")
    parser.add_argument("--scorers", default=",".join(SCORERS), help=f"of {', '.join(SCORERS)}")
    parser.add_argument("--budgets", default="128,256")
    parser.add_argument(
        "--interval", type=int, default=EVICT_PAGE, help="steps between compressions (the project's evict_page)"
    )
    parser.add_argument(
        "--whole-layers", default="", help="layers left uncompressed, e.g. 0 as the project's default preset keeps"
    )
    parser.add_argument("--sglang", type=Path, help="a bench/long_outputs.py report of the same suite")
    # One thread: on a shared 2-core machine two threads made decoding far slower (fidelity_kvpress).
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--limit", type=int, help="only the first N prompts (a quick look)")
    parser.add_argument("--resume", action="store_true", help="keep the outputs --stem's report holds")
    parser.add_argument("--render", action="store_true", help="rewrite --stem's markdown, asking nothing")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    parser.add_argument("--stem", default=f"long-outputs-kvpress-{dt.date.today().isoformat()}")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    paths = ReportPaths(args.out_dir, args.stem)
    if args.render:
        paths.markdown.write_text(markdown(json.loads(paths.json.read_text())))
        return 0
    scorers = [s for s in args.scorers.split(",") if s]
    unknown = [s for s in scorers if s not in SCORERS]
    tasks = [t for t in args.tasks.split(",") if t]
    if unknown or not set(tasks) <= set(TASKS):
        print(f"error: --scorers of {list(SCORERS)}, --tasks of {list(TASKS)}", file=sys.stderr)
        return 2
    try:
        budgets = sorted(int(b) for b in args.budgets.split(",") if b)
        lengths = [int(n) for n in args.lengths.split(",") if n]
        whole = tuple(sorted({int(n) for n in args.whole_layers.split(",") if n}))
    except ValueError:
        print("error: --budgets, --lengths and --whole-layers take integers separated by commas", file=sys.stderr)
        return 2
    if args.interval < 1 or not budgets or budgets[0] < 1 or (args.limit is not None and args.limit < 1):
        print("error: --interval, --limit and every --budget must be at least 1", file=sys.stderr)
        return 2
    sglang = json.loads(args.sglang.read_text()) if args.sglang else None
    suite = LONG_OUTPUT_SUITES[args.suite]
    if sglang is not None and sglang["suite"]["sha256"] != suite.sha256:
        print(f"error: {args.sglang} is not a report of {suite.name}", file=sys.stderr)
        return 2
    prompts = [p for p in suite.prompts(lengths) if p.task in tasks][: args.limit]
    missing = [p.prompt_id for p in prompts if sglang is not None and p.prompt_id not in sglang["answers"]]
    if not prompts or missing:
        print(
            f"error: no prompt of --lengths and --tasks in {suite.name}, or not in --sglang: {missing}", file=sys.stderr
        )
        return 2
    try:
        model_dir = ensure_default_model()
    except ModelUnavailableError as exc:
        print(f"error: {exc}; run scripts/setup.sh first (it converts the model)", file=sys.stderr)
        return 1
    torch.set_num_threads(args.threads)
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    if any(not 0 <= n < model.config.num_hidden_layers for n in whole):
        print(f"error: --whole-layers of 0-{model.config.num_hidden_layers - 1}", file=sys.stderr)
        return 2
    systems = [{"label": FULL, "budget": None, "policy": None}]
    systems += [{"label": SGLANG_FULL, "budget": None, "policy": None}] if sglang else []
    systems += [
        {"label": f"kvpress-{s}@{b}", "budget": b, "policy": f"kvpress-{s}", "scorer": s}
        for s in scorers
        for b in budgets
    ]
    outputs: dict[str, dict[str, list[int]]] = {}
    largest: dict[str, int] = {}
    if args.resume and paths.json.exists():
        earlier = json.loads(paths.json.read_text())
        if (earlier["settings"]["interval"], earlier["settings"].get("whole_layers", [])) != (
            args.interval,
            list(whole),
        ):
            print(f"error: {paths.json} was made with another --interval or --whole-layers", file=sys.stderr)
            return 2
        largest = earlier["settings"]["largest_cache"]
        for prompt_id, kept in earlier["answers"].items():
            outputs[prompt_id] = {label: got["output_ids"] for label, got in kept.items() if label != SGLANG_FULL}
    data: dict[str, Any] = {
        "benchmark": "long-outputs-kvpress",
        "date": dt.date.today().isoformat(),
        "machine": f"{platform.machine()} {os.cpu_count()} CPU cores, no GPU",
        "provenance": provenance(sys.argv),
        "suite": {"name": suite.name, "sha256": suite.sha256},
        "settings": {
            "model": model_dir.name,
            "transformers": version("transformers"),
            "kvpress": version("kvpress"),
            "torch": torch.__version__,
            "threads": args.threads,
            "interval": args.interval,
            "whole_layers": list(whole),
            "largest_cache": largest,
            "sglang_report": args.sglang.name if args.sglang else None,
        },
        "systems": systems,
        "prompts": {},
        "answers": {},
    }
    started = time.monotonic()
    for number, prompt in enumerate(prompts, 1):
        ids = list(tokenizer(prompt.text)["input_ids"])
        data["prompts"][prompt.prompt_id] = {
            "task": prompt.task,
            "output_len": prompt.output_len,
            "prompt_len": len(ids),
        }
        mine = outputs.setdefault(prompt.prompt_id, {})
        for system in systems:
            label = system["label"]
            if label in mine or label == SGLANG_FULL:
                continue
            press = None if label == FULL else decoding_press(system["scorer"], system["budget"], args.interval, whole)
            tick = time.monotonic()
            mine[label], held = answer(model, ids, prompt.output_len, press)
            largest[label] = max(held, largest.get(label, 0))
            print(f"[{number}/{len(prompts)}] {prompt.prompt_id} {label}: {time.monotonic() - tick:.0f} s", flush=True)
        if sglang is not None:
            mine[SGLANG_FULL] = sglang["answers"][prompt.prompt_id]["full"]["output_ids"]
        measured = data["answers"][prompt.prompt_id] = {}
        for label, output in mine.items():
            text = tokenizer.decode(output)
            measured[label] = {"output_ids": output, "text": text, **measure(prompt, output, text, mine[FULL])}
        write_json(paths, data)
        paths.markdown.write_text(markdown(data))
    print(f"[long-outputs-kvpress] {len(prompts)} prompts in {time.monotonic() - started:.0f} s: {paths.markdown}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
