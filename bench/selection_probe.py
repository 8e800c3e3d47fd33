"""What a prefill selection keeps of a RULER answer, layer by layer, and what the model answers
with only those keys: per-layer selection against the guided one (`guide_from`), outside the
server.

Why it exists: through the server a wrong answer says only that something was dropped. This
runs the default model in Hugging Face transformers (fp32, CPU) on the RULER-style prompts of
`kvsparse_testbed.ruler`, takes each sparse layer's `span` scores from the observation window's
attention (float64, then the project's own `pool_scores`, `spread_scores` and `select_kept`; the
guided set through the project's `PrefillGuide`), and reports, per layer and KV head, how many of
the answer's tokens are kept. It then generates greedily with every sparse layer's prompt keys
masked to the kept ones (the prefill itself is full, as on the server; no decode eviction), so a
row of kept counts, and each hidden fact's share kept (the asked one and its look-alikes), sits
beside the answer it leads to. On the 14 prompts the full cache answers
its verdicts matched the server's prompt for prompt (`selection-probe-2026-12-03` against
`fidelity-ruler-ep64-2026-12-03`, per-layer: 8 and 6 of 14 at budgets 128 and 256, and
`fidelity-ruler-guide-2026-12-03`, guided: 10 and 10).

Writes ``<out-dir>/selection-probe[-<tag>]-<date>.json`` and ``.md``.

Usage: .venv/bin/python bench/selection_probe.py [--budgets 128,256] [--guide-from 0.33]
       [--long-follow 40] [--sentence 0.5] [--seeds 0,1,2]
       [--lengths 2000,3000]
       [--prompts ruler-multikey-2000-1,...] [--tag TAG]
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime as dt
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from common.report import ReportPaths, provenance_line, write_json
from common.systems import machine
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.modeling_utils import AttentionInterface

from kvsparse_testbed import ruler
from kvsparse_testbed.texts import essay_text
from sglang_kvsparse.config import PRESETS
from sglang_kvsparse.forward.guide import PrefillGuide
from sglang_kvsparse.kernels import select_kept
from sglang_kvsparse.kernels.common import Segments
from sglang_kvsparse.models import ensure_default_model
from sglang_kvsparse.policies import SpanPolicy
from sglang_kvsparse.policies.sentences import sentence_end_tokens, sentence_numbers

RESULTS_DIR = Path(__file__).resolve().parent / "results"
#: Each token's (first, past-last) character in the templated prompt.
Offsets = list[tuple[int, int]]
DEFAULT = PRESETS["default"]
#: The committed RULER runs' prompts (2 tasks x 2 lengths x 8 per seed); seed 0's full cache answers 14.
TASKS, LENGTHS, PER_LENGTH = ["multikey", "uuid"], [2000, 3000], 8


class AttentionProbe:
    """Replaces transformers' SDPA attention: at prefill it records each layer's window mass
    ([L, H_kv] float64: the last `window` queries' attention, summed over each KV head's query
    heads); while generating,
    it hides the prompt keys a layer did not keep."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.mass: dict[int, torch.Tensor] = {}
        self.kept: dict[int, torch.Tensor] = {}  # layer -> [H_kv, prompt_len] bool
        self.recording = True
        self._sdpa = AttentionInterface._global_mapping["sdpa"]

    @contextmanager
    def installed(self) -> Iterator[None]:
        AttentionInterface._global_mapping["sdpa"] = self.forward
        try:
            yield
        finally:
            AttentionInterface._global_mapping["sdpa"] = self._sdpa

    def forward(self, module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Any, **kwargs):
        layer, groups = module.layer_idx, module.num_key_value_groups
        keys = key[0].repeat_interleave(groups, dim=0)  # [H_q, S, D]
        if self.recording:
            n, w = keys.shape[1], self.window
            logits = torch.einsum("hwd,hsd->hws", query[0, :, -w:].double(), keys.double()) * kwargs["scaling"]
            future = torch.arange(n)[None, :] > torch.arange(n - w, n)[:, None]
            probs = logits.masked_fill(future, float("-inf")).softmax(-1)
            mass = probs.sum(1)
            self.mass[layer] = mass.unflatten(0, (-1, groups)).sum(1).T  # [S, H_kv]
            return self._sdpa(module, query, key, value, mask, **kwargs)
        kept = self.kept.get(layer)
        if kept is None:  # a full layer
            return self._sdpa(module, query, key, value, mask, **kwargs)
        visible = torch.ones(keys.shape[0], keys.shape[1], dtype=torch.bool)
        visible[:, : kept.shape[1]] = kept.repeat_interleave(groups, dim=0)
        logits = torch.einsum("hd,hsd->hs", query[0, :, 0], keys) * kwargs["scaling"]
        probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
        out = torch.einsum("hs,hsd->hd", probs, value[0].repeat_interleave(groups, dim=0))
        return out[None, None], None


def layer_scores(mass: torch.Tensor, policy: SpanPolicy, sentence_ends: torch.Tensor) -> torch.Tensor:
    """`span`'s scores [L, H_kv] from a layer's window mass: spread forward, then raised by
    sentence (`sentence_ends` [L] bool, as the server marks them)."""
    keys = Segments.of(torch.tensor([0, mass.shape[0]], dtype=torch.int32))
    spread = policy.spread(mass.float(), keys, DEFAULT.sink, DEFAULT.window)
    return policy.by_sentence(spread, sentence_numbers(sentence_ends, keys))


def kept_sets(scores: dict[int, torch.Tensor], budget: int, guide_layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """Per sparse layer, [H_kv, L] bool of the kept prompt keys: by the layer's own scores, or
    (with guide layers) by the guide's, through the server's `PrefillGuide`."""
    length = next(iter(scores.values())).shape[0]
    keys = Segments.of(torch.tensor([0, length], dtype=torch.int32))
    kept: dict[int, torch.Tensor] = {}

    def keep(layer: int, by: torch.Tensor) -> None:
        positions, _ = select_kept(by, keys, budget, DEFAULT.sink, DEFAULT.window)
        mask = torch.zeros(by.shape[1], length, dtype=torch.bool)
        for head, row in enumerate(positions[0]):
            mask[head, row[row >= 0]] = True
        kept[layer] = mask

    if not guide_layers:
        for layer, own in scores.items():
            keep(layer, own)
        return kept
    guide = PrefillGuide(guide_layers)
    for layer, own in scores.items():
        if guide.guides(layer):
            guide.add(layer, own)
        guide.defer(lambda by, layer=layer, heads=own.shape[1]: keep(layer, by[:, None].expand(-1, heads)))
    guide.finish()
    return kept


def answer_positions(offsets: Offsets, text: str, value: str) -> list[int]:
    """Token positions of the first occurrence of `value` in the templated prompt `text`."""
    start = text.index(value)
    return token_span(offsets, start, start + len(value))


def token_span(offsets: Offsets, start: int, end: int) -> list[int]:
    """Token positions of the characters start..end-1 (`offsets`: each token's characters)."""
    return [i for i, (a, b) in enumerate(offsets) if a < end and b > start]


def fact_spans(offsets: Offsets, text: str, prompt: Any) -> list[tuple[bool, list[int]]]:
    """(asked, token positions) of each hidden fact sentence, in text order: a fact is asked
    when it holds an expected value. A wrong answer with the asked fact cut and a look-alike
    kept whole is a selection miss; with every fact whole it is the model's reading."""
    base = text.index(prompt.user_message)
    spans = []
    for offset in prompt.fact_char_offsets:
        start = base + offset
        end = text.index(".", start) + 1
        asked = any(value in text[start:end] for value in prompt.expected)
        spans.append((asked, token_span(offsets, start, end)))
    return spans


def facts_kept(kept: dict[int, torch.Tensor], facts: list[tuple[bool, list[int]]]) -> list[dict[str, Any]]:
    """Each fact's share of tokens kept, over every sparse layer and KV head."""
    masks = torch.stack(list(kept.values()))  # [layers, H_kv, prompt]
    return [{"asked": asked, "kept": round(float(masks[:, :, span].double().mean()), 3)} for asked, span in facts]


def probe_prompt(
    model, tokenizer, prompt, probe: AttentionProbe, budgets, guides, policy: SpanPolicy, ends_sentence: torch.Tensor
) -> dict[str, Any]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt.user_message}], add_generation_prompt=True, tokenize=False
    )
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = encoded["input_ids"], encoded["offset_mapping"]
    answer = answer_positions(offsets, text, prompt.expected[0])
    facts = fact_spans(offsets, text, prompt)
    probe.recording, probe.mass = True, {}
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    sparse = [layer for layer in sorted(probe.mass) if layer not in DEFAULT.full_layers]
    sentence_ends = ends_sentence[torch.tensor(ids)]
    stops = {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}
    result: dict[str, Any] = {"prompt_tokens": len(ids), "answer_tokens": len(answer), "runs": {}}
    for budget in budgets:
        scores = {layer: layer_scores(probe.mass[layer], policy, sentence_ends) for layer in sparse}
        for label, guide_layers in guides.items():
            probe.kept = kept_sets(scores, budget, guide_layers)
            probe.recording = False
            cache = copy.deepcopy(out.past_key_values)
            tokens = [int(out.logits[0, -1].argmax())]
            with torch.no_grad():
                while len(tokens) < ruler.MAX_NEW_TOKENS and tokens[-1] not in stops:
                    step = model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
                    tokens.append(int(step.logits[0, -1].argmax()))
            output = tokenizer.decode(tokens, skip_special_tokens=True)
            kept_answer = {
                str(layer): [int(mask[head, answer].sum()) for head in range(mask.shape[0])]
                for layer, mask in probe.kept.items()
            }
            result["runs"][f"{label}-{budget}"] = {
                "output": output,
                "correct": prompt.correct(output),
                "answer_tokens_kept": kept_answer,
                "facts_kept": facts_kept(probe.kept, facts),
            }
            mark = "✓" if prompt.correct(output) else "✗"
            print(f"[probe] {prompt.prompt_id} {label}-{budget}: {mark} {output[:50]!r}", flush=True)
    return result


def markdown(report: dict[str, Any]) -> str:
    runs = sorted({run for p in report["prompts"].values() for run in p["runs"]})
    lines = [
        f"# Selection probe — {report['date']}",
        provenance_line(report),
        "",
        f"- Machine: {report['machine']}; Hugging Face transformers, fp32, no server",
        f"- Policy `span` (long_follow {report['settings']['long_follow']}, "
        f"sentence {report['settings']['sentence']}), "
        f"window {DEFAULT.window}, sink {DEFAULT.sink}, full layers {list(DEFAULT.full_layers)}; guided: "
        f"layers {report['settings']['guide_layers']}",
        "- Kept: per sparse layer, the answer tokens kept in each KV head (digits, one per head), "
        "from the first sparse layer on; no decode eviction",
        "- Facts: each hidden fact sentence's share of tokens kept over every sparse layer and KV head, "
        "in text order, the asked one starred; a wrong answer with the asked fact whole is the "
        "model's reading of what is kept, not a selection that dropped it",
        "",
        "| run | correct | wrong with the asked fact whole |",
        "|---|---|---|",
    ]
    for run in runs:
        results = [p["runs"][run] for p in report["prompts"].values()]
        right = sum(r["correct"] for r in results)
        whole = sum(not r["correct"] and all(f["kept"] == 1 for f in r["facts_kept"] if f["asked"]) for r in results)
        lines.append(f"| {run} | {right}/{len(results)} | {whole} |")
    lines += ["", "| prompt | run | answer | facts kept | kept per layer and head |", "|---|---|---|---|---|"]
    for prompt_id, p in report["prompts"].items():
        for run in runs:
            r = p["runs"][run]
            kept = " ".join("".join(str(min(n, 9)) for n in heads) for heads in r["answer_tokens_kept"].values())
            facts = " ".join(f"{'*' if f['asked'] else ''}{f['kept']:.2f}" for f in r["facts_kept"])
            lines.append(f"| {prompt_id} | {run} | {'✓' if r['correct'] else '✗'} | {facts} | `{kept}` |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budgets", default="128,256")
    parser.add_argument("--guide-from", type=float, default=DEFAULT.guide_from)
    parser.add_argument("--long-follow", type=int, default=DEFAULT.policy.long_follow)
    parser.add_argument("--sentence", type=float, default=DEFAULT.policy.sentence)
    parser.add_argument("--seeds", default="0", help="comma-separated RULER seeds (the suite's --ruler-seeds)")
    parser.add_argument(
        "--lengths",
        default=",".join(map(str, LENGTHS)),
        help="comma-separated haystack lengths (the suite's --ruler-lengths)",
    )
    parser.add_argument("--prompts", default="", help="comma-separated prompt ids (default: every prompt)")
    parser.add_argument("--out-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument("--tag", default="")
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    budgets = [int(b) for b in args.budgets.split(",") if b]
    model_dir = ensure_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    config = dataclasses.replace(DEFAULT, guide_from=args.guide_from)
    guided = config.resolve(model.config.num_hidden_layers, model.config.max_position_embeddings).guide_layers
    guides = {"per-layer": (), "guided": guided}
    wanted = {p for p in args.prompts.split(",") if p}
    seeds = [int(seed) for seed in args.seeds.split(",") if seed]
    lengths = [int(length) for length in args.lengths.split(",") if length]
    prompts = ruler.ruler_suite(essay_text(ruler.min_essay_chars(lengths)), seeds, TASKS, lengths, PER_LENGTH)
    prompts = [p for p in prompts if not wanted or p.prompt_id in wanted]
    if not prompts:
        print(f"error: no prompt among {sorted(wanted)}", file=sys.stderr)
        return 2
    date = dt.date.today().isoformat()
    paths = ReportPaths(args.out_dir, f"selection-probe{'-' + args.tag if args.tag else ''}-{date}")
    report: dict[str, Any] = {
        "benchmark": "selection-probe",
        "date": date,
        "machine": machine(),
        "settings": {
            "budgets": budgets,
            "seeds": seeds,
            "lengths": lengths,
            "long_follow": args.long_follow,
            "sentence": args.sentence,
            "guide_layers": list(guided),
        },
        "prompts": {},
    }
    policy = dataclasses.replace(
        DEFAULT.policy,
        long_follow=args.long_follow,
        sentence=args.sentence,
    )
    ends_sentence = sentence_end_tokens(tokenizer.batch_decode, len(tokenizer))
    probe = AttentionProbe(DEFAULT.window)
    with probe.installed():
        for prompt in prompts:
            report["prompts"][prompt.prompt_id] = probe_prompt(
                model, tokenizer, prompt, probe, budgets, guides, policy, ends_sentence
            )
            write_json(paths, report)
            paths.markdown.write_text(markdown(report))
    print(f"[probe] wrote {paths.json}, {paths.markdown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
