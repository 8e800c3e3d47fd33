"""What the sparse layers add to one prefill forward, counted as a GPU would pay for it.

    python bench/prefill_cost.py            # Llama-3.1-8B's KV shape, the default preset, ~1 minute
    python bench/prefill_cost.py --small    # a 6-layer model at budget 40 (what the unit test runs)

Prefills are never captured in a CUDA graph (`docs/architecture.md`), so every op the sparse
layers dispatch is a launch the host pays while the forward runs, and every read of a device value
(a sync) makes the host wait for all the work queued before it: after a sync the GPU idles until
the host has launched the next op, so the launches that follow are no longer hidden behind the
GPU's work. A prefill is driven as SGLang's attention backend drives `SparseForward`
(`begin_extend`, `extend` for every sparse layer, the release after the forward) on the simulated
device of `bench/step_cost.py` (`common/device_cost.py`), with the same heap, allocator model and
sentence marks. Q, K and V hold no values (shapes only): every op and every host read runs as in a
real prefill, since the sizes they depend on (lengths, budgets, the entries kept) come from the
host plan and the batch's boundaries, which are real. Each project kernel counts as its Triton
launches. Counted per case: launches, syncs and host ops (every tensor op the host dispatches) by
section, per sparse layer, and where in the product each launch and sync comes from. SGLang's own
work (the full layers, the model) is not counted. Writes `prefill-cost-<date>[-small].{json,md}`.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common.checkout import ROOT, importable

importable()

import step_cost  # noqa: E402
from common.device_cost import DeviceCost, SimDevice, count_kernels, count_triton_launches  # noqa: E402
from common.report import ReportPaths, provenance, provenance_line, write_json  # noqa: E402

from sglang_kvsparse import kernels  # noqa: E402
from sglang_kvsparse.config import PRESETS, SparsityConfig  # noqa: E402
from sglang_kvsparse.policies import base as policy_base  # noqa: E402

SECTIONS = ("plan", "layers", "release")
#: The kernels a prefill launches, by dispatcher name, and the modules that call them by name.
KERNELS = ("extend_attention_with_stats", "window_scores", "write_entries")
KERNEL_CALLERS = (kernels, policy_base)


@dataclass(frozen=True)
class Case:
    """One prefill forward: the prompts it prefills together, whole."""

    label: str
    prompts: tuple[int, ...]


#: At the default budget (1,024): below it nothing is compressed; at 4,000 tokens each layer keeps
#: by its own scores; at 8,000 (the budget under `guide_below` of the prompt) the guide chooses.
CASES = (
    Case("a prompt within the budget", (512,)),
    Case("a prompt kept by each layer's scores", (4000,)),
    Case("a guided prompt", (8000,)),
    Case("four prompts kept by their layers' scores", (4000, 4000, 4000, 4000)),
)
#: `--small`: `bench/step_cost.py`'s small model, guided as the default preset is.
SMALL_CONFIG = dataclasses.replace(step_cost.SMALL_CONFIG, guide_from=0.5, guide_below=0.15)
SMALL_CASES = (
    Case("a prompt within the budget", (30,)),
    Case("a prompt kept by each layer's scores", (200,)),
    Case("a guided prompt", (400,)),
    Case("four prompts kept by their layers' scores", (200, 200, 200, 200)),
)


def measure(case: Case, shape: dict, config: SparsityConfig, seed: int = 0) -> dict[str, Any]:
    """Count one prefill forward of `case` on the simulated device; also each request's entries
    kept per sparse group afterwards (what the prefill really did)."""
    cost = DeviceCost(simulated=True, sources=True)
    restores = [count_kernels(cost, list(KERNEL_CALLERS), KERNELS), count_triton_launches(cost)]
    try:
        with cost:
            harness = step_cost.Harness(cost, SimDevice.device, len(case.prompts) + 1, seed, shape, config)
            state = harness.state
            rows = [harness.free_rows.pop() for _ in case.prompts]
            total = sum(case.prompts)
            with cost.paused():  # SGLang's allocation of the prompts' ids, through the heap's hooks
                state.expect(rows, list(case.prompts))
                ids = harness.allocator.alloc(total)
                state.alloc_to_lengths(
                    req_pool_indices_cpu=torch.tensor(rows), target_seq_lens_cpu=torch.tensor(case.prompts)
                )
                tokens = harness._tokens(total)
                positions = torch.cat([torch.arange(n) for n in case.prompts]).to(SimDevice.device)
            q = SimDevice.shapes_only(total, harness.q_heads, harness.head_dim, dtype=torch.bfloat16)
            k = SimDevice.shapes_only(total, harness.kv_heads, harness.head_dim, dtype=torch.bfloat16)
            v = SimDevice.shapes_only(total, harness.kv_heads, harness.head_dim, dtype=torch.bfloat16)
            cost.reset()
            cost.section = "plan"
            no_prefix = [ids[:0]] * len(rows)
            harness.forward.begin_extend(rows, [0] * len(rows), list(case.prompts), no_prefix, ids, tokens)
            cost.section = "layers"
            for layer in state.layout.layer_places:
                harness.forward.extend(q, k, v, layer, 0.088, positions)
            cost.section = "release"
            state.finish_forward()
            cost.section = "harness"
            kept = [[int(group.table.counts[row]) for group in state.groups] for row in rows]
    finally:
        for restore in restores:
            restore()
    return {
        "label": case.label,
        "prompts": list(case.prompts),
        "kept": kept,
        "launches": {s: cost.launches[s] for s in SECTIONS},
        "syncs": {s: cost.syncs[s] for s in SECTIONS},
        "host_ops": {s: cost.host_ops[s] for s in SECTIONS},
        "launch_sources": _by_source(cost.launch_sources),
        "sync_sources": _by_source(cost.sync_sources),
    }


def _by_source(counts: Any) -> dict[str, dict[str, int]]:
    """{section: {source: count}}, most first."""
    out: dict[str, dict[str, int]] = {}
    for (section, source), n in counts.most_common():
        out.setdefault(section, {})[source] = n
    return out


def markdown(report: dict[str, Any]) -> str:
    layers = report["settings"]["sparse_layers"]
    lines = [
        f"# Prefill cost of the sparse layers — {report['date']}",
        "",
        provenance_line(report),
        f"- Device: {report['device']}; shape: {report['settings']['shape']}; budget "
        f"{report['settings']['budget']} ({layers} sparse layers)",
        "",
        "One prefill forward driven as SGLang's attention backend drives the sparse layers (`begin_extend`: "
        "the plan; `extend` for every sparse layer; the release), counted per op "
        "(`bench/common/device_cost.py`), each project kernel as its Triton launches. Prefills are not "
        "captured in a CUDA graph: every launch is paid from the host, and each sync makes the host wait "
        "for the queue. Host ops: every tensor op the host dispatches (views and allocations included).",
        "",
        "| case | prompts | launches: plan / layers | per sparse layer | syncs: plan / layers | per sparse layer "
        "| host ops per sparse layer | entries kept per request |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["cases"]:
        launches, syncs, ops = row["launches"], row["syncs"], row["host_ops"]
        kept = sorted({n for request in row["kept"] for n in request})
        lines.append(
            f"| {row['label']} | {' + '.join(f'{n:,}' for n in row['prompts'])} | "
            f"{launches['plan']} / {launches['layers']:,} | {launches['layers'] / layers:.1f} | "
            f"{syncs['plan']} / {syncs['layers']} | {syncs['layers'] / layers:.1f} | {ops['layers'] / layers:.0f} | "
            f"{', '.join(map(str, kept))} |"
        )
    lines += ["", "## Where the syncs come from (per prefill, all cases)", ""]
    lines += _source_table(report, "sync_sources", per_layer=False)
    lines += ["", "## Where the launches come from (per sparse layer, by file)", ""]
    lines += _source_table(report, "launch_sources", per_layer=True, by_file=True)
    return "\n".join(lines) + "\n"


def _source_table(report: dict[str, Any], key: str, per_layer: bool, by_file: bool = False) -> list[str]:
    cases = report["cases"]
    layers = report["settings"]["sparse_layers"]
    counts: list[dict[str, int]] = []
    for row in cases:
        merged: dict[str, int] = {}
        for section, sources in row[key].items():
            for source, n in sources.items():
                name = f"{section}: " + (source.split(":")[0] if by_file else source)
                merged[name] = merged.get(name, 0) + n
        counts.append(merged)
    names = sorted(
        {name for merged in counts for name in merged}, key=lambda name: -max(c.get(name, 0) for c in counts)
    )
    lines = ["| source | " + " | ".join(row["label"] for row in cases) + " |", "|---|" + "---:|" * len(cases)]
    for name in names:
        cells = [c.get(name, 0) / (layers if per_layer else 1) for c in counts]
        lines.append(f"| `{name}` | " + " | ".join(f"{x:.1f}" if per_layer else f"{x:.0f}" for x in cells) + " |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--stem", help="file name stem (default prefill-cost-<date>[-small])")
    parser.add_argument("--small", action="store_true", help="a 6-layer model at budget 40 (a dry run)")
    args = parser.parse_args()
    if args.small:
        shape, config, cases = step_cost.SMALL_SHAPE, SMALL_CONFIG, SMALL_CASES
    else:
        shape, config, cases = json.loads(step_cost.MODEL.read_text()), PRESETS["default"], CASES
    sparse_layers = shape["num_hidden_layers"] - len(config.full_layers)
    rows = []
    for case in cases:
        started = time.perf_counter()
        rows.append(measure(case, shape, config))
        print(
            f"[prefill-cost] {case.label}: {rows[-1]['launches']['layers'] / sparse_layers:.1f} launches and "
            f"{rows[-1]['syncs']['layers'] / sparse_layers:.1f} syncs per sparse layer "
            f"({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    report = {
        "date": dt.date.today().isoformat(),
        "device": f"simulated on {platform.processor() or 'CPU'}",
        "provenance": provenance(sys.argv),
        "settings": {
            "shape": f"{shape['num_hidden_layers']} layers, {shape['num_key_value_heads']} KV heads, "
            f"{shape['num_attention_heads']} query heads, head dim {shape['head_dim']}, bf16",
            "sparse_layers": sparse_layers,
            "budget": config.budget,
        },
        "cases": rows,
    }
    stem = args.stem or f"prefill-cost-{report['date']}" + ("-small" if args.small else "")
    paths = ReportPaths(args.out_dir, stem)
    write_json(paths, report)
    paths.markdown.write_text(markdown(report))
    print(f"[prefill-cost] wrote {paths.json} and {paths.markdown}")


if __name__ == "__main__":
    main()
