"""What the sparse machinery adds to one decode step, counted as a GPU would pay for it.

    python bench/step_cost.py                     # simulated device (no GPU needed), ~3 minutes
    python bench/step_cost.py --before FILE.json  # the same, with an earlier run's counts beside (repeatable)

At Llama-3.1-8B's KV shape (32 layers, 8 KV heads, head dim 128, bf16; `bench/models/llama-3.1-8b`)
with the default preset (layer 0 full, 31 sparse layers at budget 1,024), requests decode in
batches of 1, 8, 64 and 128 at contexts above the budget. They joined at different steps, so their
rows reach budget + evict_page at different steps and most steps of a large batch evict. Each step
is driven as SGLang's decode graph runner drives the backend's sparse side (`SparseForward`: its
fixed buffers made once, `begin_replay` before each replay, the layers over the buffers), and for
every decode step it counts, by section of the step (allocation, before replay, layers, release):

* **launches**: device ops the sparse machinery issues (each project kernel counted as its
  Triton launches), from SGLang's allocation hook to the release after the forward;
* **host syncs**: reads of device values, blocking or pageable copies, data-dependent shapes;
* the host time of allocation, the work before the replay and release (this machine's; the counts
  are the contract).

SGLang's own work (its token allocator's ids, the full layers, the model) is not counted: the
question is what sparsity adds. Nothing here needs SGLang: the heap is SGLang's token allocator as
the state meets it (`TokenAllocatorModel`), with the project's heap hooks on it, and the sparse
layers' K/V live on a simulated device (`bench/common/device_cost.py`) or, with `--device cuda`,
a real one. Writes `bench/results/step-cost-<date>[-<device>].json`, `.md` and `.png`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from common.checkout import ROOT, importable
from torch.utils._python_dispatch import _disable_current_modes

importable()

from common.device_cost import DeviceCost, SimDevice, count_kernels, count_triton_launches  # noqa: E402
from common.report import ReportPaths, provenance, write_json  # noqa: E402

from sglang_kvsparse import kernels  # noqa: E402
from sglang_kvsparse.config import PRESETS, SparsityConfig  # noqa: E402
from sglang_kvsparse.forward.planning import plan_extend  # noqa: E402
from sglang_kvsparse.forward.sparse_forward import SparseForward  # noqa: E402
from sglang_kvsparse.patches.allocator import attach, make_heap  # noqa: E402
from sglang_kvsparse.policies.sentences import SentenceMarks  # noqa: E402
from sglang_kvsparse.state.admission import rows_for_next_decode  # noqa: E402
from sglang_kvsparse.state.device_copy import upload  # noqa: E402
from sglang_kvsparse.state.layout import HeapLayout, scores_per_row  # noqa: E402
from sglang_kvsparse.state.sparse_group import LaneBuffers  # noqa: E402
from sglang_kvsparse.state.sparse_state import SparseState  # noqa: E402

#: A decode step as SGLang's graph runner drives the backend: SGLang's allocation hook, then
#: before the replay `SparseForward.begin_replay` (the sentence marks, the plan from the host
#: tables, its evictions, the plan copied into the graph's fixed buffers), then the captured step
#: (`SparseForward.decode` for every sparse layer over those buffers), then the release.
BEFORE_REPLAY = "before replay"
SECTIONS = ("allocation", BEFORE_REPLAY, "layers", "release")
#: What a step launches from the host with decode graphs on: all but the replayed layers.
OUTSIDE_GRAPH = ("allocation", BEFORE_REPLAY, "release")
#: A dry run's model and configuration (`--small`; the unit tests run it too).
SMALL_SHAPE = {
    "num_hidden_layers": 6,
    "num_key_value_heads": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "max_position_embeddings": 4096,
    "vocab_size": 500,
}
SMALL_CONFIG = SparsityConfig(full_layers=(0, 1), budget=40, window=4, evict_page=8)
BATCHES = (1, 8, 64, 128)
MODEL = ROOT / "bench" / "models" / "llama-3.1-8b" / "config.json"


class TokenAllocatorModel:
    """SGLang 0.5.23's token allocator (page size 1) as the sparse state meets it: a free list
    of ids on the device; an allocation slices it, a free appends to it (`allocator/token.py`)."""

    page_size = 1

    def __init__(self, size: int, device: torch.device) -> None:
        self.size, self.device = size, device
        self.clear()

    def clear(self) -> None:
        self.free_pages = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    def available_size(self) -> int:
        return len(self.free_pages)

    def alloc(self, need_size: int) -> torch.Tensor | None:
        if need_size > len(self.free_pages):
            return None
        taken, self.free_pages = self.free_pages[:need_size], self.free_pages[need_size:]
        return taken

    def free(self, free_index: torch.Tensor) -> None:
        if free_index.numel():
            self.free_pages = torch.cat((self.free_pages, free_index))

    def free_page_ids(self, page_ids: torch.Tensor) -> None:
        self.free(page_ids)

    def evict_to_free_tokens(self, tree_cache: Any, num_tokens: int) -> None:
        return None


@dataclass
class Request:
    row: int
    length: int
    final: int
    ids: list[torch.Tensor] = field(default_factory=list)  # SGLang's ids, on the device


@dataclass
class Run:
    """One batch size's counts: per decode step, launches and syncs by section."""

    batch: int
    steps: list[dict[str, Any]] = field(default_factory=list)


class Harness:
    """A sparse state at a model's KV shape (`shape`: its config.json fields) and a sparsity
    `config`, on a simulated (or real) device, driven through the calls the server makes for a
    decode step. Requests' prompts are above the budget (compressed at prefill) and they decode a
    tenth to two fifths of a budget's tokens."""

    def __init__(
        self,
        cost: DeviceCost,
        device: torch.device,
        batch: int,
        seed: int,
        shape: dict,
        config: SparsityConfig,
        allocator: Callable[[int, torch.device], Any] = TokenAllocatorModel,
    ) -> None:
        self.cost, self.device, self.batch = cost, device, batch
        self.kv_heads, self.q_heads, self.head_dim = (
            shape["num_key_value_heads"],
            shape["num_attention_heads"],
            shape["head_dim"],
        )
        self.budget = config.budget
        resolved = config.resolve(shape["num_hidden_layers"], shape["max_position_embeddings"])
        layout = HeapLayout.from_resolved(resolved, scores_per_row(self.head_dim, 2))
        longest_prompt = 3 * self.budget
        per_request = layout.rows_held(longest_prompt + self.budget) + longest_prompt * layout.num_columns
        self.rows = per_request * (batch + 1)
        self.max_requests = batch + 2
        self.allocator = allocator(self.rows, device)  # SGLang's token allocator, or its model
        heap = make_heap(self.allocator)
        lane_buffers = [LaneBuffers.over(self._kv(self.rows + 1), self._kv(self.rows + 1)) for _ in range(layout.lanes)]
        ends = torch.zeros(shape["vocab_size"], dtype=torch.bool)
        ends[::97] = True
        self.state = SparseState(
            resolved,
            heap=heap,
            lanes=lane_buffers,
            max_requests=self.max_requests,
            heap_rows=self.rows,
            prefix_cache=True,
            sentence_marks=SentenceMarks(ends, self.rows + 1, device),
        )
        attach(self.allocator, self.state)
        self.forward = SparseForward(self.state)
        self.forward.init_graph(batch)
        self.gen = torch.Generator().manual_seed(seed)
        self.running: dict[int, Request] = {}
        self.free_rows = list(range(self.max_requests - 1, 0, -1))
        self.vocab = shape["vocab_size"]

    def _kv(self, rows: int) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.zeros(rows, self.kv_heads, self.head_dim, dtype=torch.bfloat16, device=self.device)
        return SimDevice.shapes_only(rows, self.kv_heads, self.head_dim, dtype=torch.bfloat16)

    def _random(self, *shape: int) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.randn(*shape, dtype=torch.bfloat16, device=self.device)
        return SimDevice.shapes_only(*shape, dtype=torch.bfloat16)

    def _tokens(self, n: int) -> torch.Tensor:
        return upload([torch.randint(0, self.vocab, (n,), generator=self.gen)], self.device)[0]

    # -- requests ------------------------------------------------------------------------------
    def join(self, prompt: int = 0, final: int = 0) -> Request:
        """A request's prefill (uncounted): a prompt above the budget (random unless given),
        compressed to it."""
        row = self.free_rows.pop()
        prompt = prompt or int(torch.randint(self.budget + self.budget // 8, 3 * self.budget, (1,), generator=self.gen))
        final = final or prompt + int(torch.randint(self.budget // 10, 2 * self.budget // 5, (1,), generator=self.gen))
        ids = self.allocator.alloc(prompt)
        self.state.expect([row], [final])
        self.state.alloc_to_lengths(
            req_pool_indices_cpu=torch.tensor([row]), target_seq_lens_cpu=torch.tensor([prompt])
        )
        self.state.sentence_marks.record(ids, self._tokens(prompt))
        plan_extend(self.state, [row], [0], [prompt], [ids[:0]], ids, self.device)
        self.state.finish_forward()
        self.running[row] = request = Request(row, prompt, final, [ids])
        return request

    def finish(self, request: Request) -> None:
        """A request finished or was aborted: the state and SGLang's allocator release it."""
        self.state.free(request.row)
        self.allocator.free(torch.cat(request.ids))
        del self.running[request.row]
        self.free_rows.append(request.row)

    # -- one decode step, as the server runs it -------------------------------------------------
    def step(self) -> dict[str, Any]:
        cost, state = self.cost, self.state
        rows = sorted(self.running)
        requests = [self.running[row] for row in rows]
        lengths = torch.tensor([r.length for r in requests])
        timings: dict[str, float] = {}
        cost.reset()

        def timed(section: str, host_only: bool = False) -> _Section:
            return _Section(cost, timings, section, host_only)

        with cost.paused():  # SGLang's own ids (its allocator, the heap's hooks on it)
            ids = self.allocator.alloc(len(rows))  # page size 1: SGLang's `alloc_token_slots`
        with timed("allocation", host_only=True):
            rows_for_next_decode(state, rows)  # SGLang's decode check asks the heap
            state.alloc_to_lengths(req_pool_indices_cpu=torch.tensor(rows), target_seq_lens_cpu=lengths + 1)
        tokens = self._tokens(len(rows))  # the step's input ids, on the device as SGLang's are
        evictions = state.counters.evictions
        with timed(BEFORE_REPLAY):
            self.forward.begin_replay(rows, len(rows), ids, tokens)
        evicting = state.counters.evictions > evictions
        q = self._random(len(rows), self.q_heads, self.head_dim)
        k, v = (
            self._random(len(rows), self.kv_heads, self.head_dim),
            self._random(len(rows), self.kv_heads, self.head_dim),
        )
        (positions,) = upload([lengths], self.device)
        with timed("layers"):
            for layer in state.layout.layer_places:
                self.forward.decode(q, k, v, layer, 0.088, positions)
        for place, request in enumerate(requests):  # the harness's own bookkeeping
            request.length += 1
            request.ids.append(ids[place : place + 1])
        with timed("release", host_only=True):
            state.finish_forward()
        cost.section = "release"  # finished requests: SGLang's frees of their ids, through the heap's hooks
        for request in requests:
            if request.length >= request.final:
                self.finish(request)
        cost.section = "harness"
        return {
            "batch": len(rows),
            "evicting": evicting,
            "launches": {section: cost.launches[section] for section in SECTIONS},
            "host_ops": {section: cost.host_ops[section] for section in SECTIONS},
            "syncs": {section: cost.syncs[section] for section in SECTIONS},
            "sync_kinds": {kind: n for kind, n in cost.sync_kinds.items() if kind.split(":")[0] in SECTIONS},
            "host_ms": {section: 1000 * seconds for section, seconds in timings.items()},
        }


class _Section:
    """Counts and times a block as `section`; what runs outside any is the harness's own. A
    `host_only` block on the simulated device runs outside the counting mode, so its time is the
    host's own and any device op in it raises (a simulated tensor outside its mode)."""

    def __init__(self, cost: DeviceCost, timings: dict[str, float], section: str, host_only: bool) -> None:
        self.cost, self.timings, self.section = cost, timings, section
        self.outside = _disable_current_modes() if host_only and cost.simulated else nullcontext()

    def __enter__(self) -> None:
        self.cost.section = self.section
        self.outside.__enter__()
        self.start = time.perf_counter()

    def __exit__(self, *exc: Any) -> None:
        self.timings[self.section] = time.perf_counter() - self.start
        self.outside.__exit__(*exc)
        self.cost.section = "harness"


def measure(
    batch: int,
    steps: int,
    device: torch.device,
    seed: int,
    shape: dict | None = None,
    config: SparsityConfig | None = None,
    *,
    sync_debug: bool = False,
) -> Run:
    """Warm up until `batch` requests decode with staggered rows, then count `steps` steps (at
    Llama-3.1-8B's shape and the default preset unless given). `sync_debug` (CUDA): each counted
    step under `torch.cuda.set_sync_debug_mode("error")`, so a real sync raises."""
    shape = shape or json.loads(MODEL.read_text())
    config = config or PRESETS["default"]
    simulated = device.type != "cuda"
    cost = DeviceCost(simulated=simulated)
    restores = [
        count_kernels(cost, [kernels], ("decode_attention_with_scores", "evict_rows", "write_entries")),
        count_triton_launches(cost),
    ]
    run = Run(batch)
    try:
        with cost:
            harness = Harness(cost, device, batch, seed, shape, config)
            joins_per_step = max(1, -(-batch // config.evict_page))
            for _ in range(config.evict_page + 8):  # requests join over more than one eviction cycle
                for _ in range(min(joins_per_step, batch - len(harness.running))):
                    harness.join()
                harness.step()
            for _ in range(steps):
                while len(harness.running) < batch:
                    harness.join()
                with _sync_errors(sync_debug):
                    run.steps.append(harness.step())
    finally:
        for restore in restores:
            restore()
    return run


@contextmanager
def _sync_errors(enabled: bool) -> Iterator[None]:
    if not enabled:
        yield
        return
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def summarize(run: Run, sparse_layers: int) -> dict[str, Any]:
    """Per step means and maxima; per sparse layer; eviction steps apart."""

    def per_step(steps: list[dict[str, Any]]) -> dict[str, Any]:
        if not steps:
            return {"steps": 0}
        totals = [sum(step["launches"][s] for s in SECTIONS) for step in steps]
        syncs = [sum(step["syncs"].values()) for step in steps]
        return {
            "steps": len(steps),
            "launches_mean": sum(totals) / len(totals),
            "launches_max": max(totals),
            "launches_per_layer_mean": sum(totals) / len(totals) / sparse_layers,
            "launches_per_layer_max": max(totals) / sparse_layers,
            "outside_graph_mean": sum(sum(step["launches"][s] for s in OUTSIDE_GRAPH) for step in steps) / len(steps),
            "by_section_mean": {s: sum(step["launches"][s] for step in steps) / len(steps) for s in SECTIONS},
            "host_ops_before_replay_mean": sum(step["host_ops"][BEFORE_REPLAY] for step in steps) / len(steps),
            "syncs_mean": sum(syncs) / len(syncs),
            "syncs_max": max(syncs),
            "syncs_by_section_mean": {s: sum(step["syncs"][s] for step in steps) / len(steps) for s in SECTIONS},
        }

    kinds: dict[str, int] = {}
    for step in run.steps:
        for kind, count in step["sync_kinds"].items():
            kinds[kind] = kinds.get(kind, 0) + count
    host = {s: sorted(step["host_ms"][s] for step in run.steps)[len(run.steps) // 2] for s in SECTIONS}
    return {
        "batch": run.batch,
        "all_steps": per_step(run.steps),
        "eviction_steps": per_step([step for step in run.steps if step["evicting"]]),
        "other_steps": per_step([step for step in run.steps if not step["evicting"]]),
        "sync_kinds_total": kinds,
        "host_ms_median": host,
    }


def markdown(report: dict[str, Any]) -> str:
    layers = report["settings"]["sparse_layers"]
    lines = [
        f"# Decode step cost of the sparse machinery — {report['date']}",
        "",
        f"- Device: {report['device']}; commit `{report['provenance']['commit'][:10]}`"
        + (" (dirty tree)" if report["provenance"]["dirty"] else ""),
        f"- Shape: {report['settings']['shape']}; preset `default` ({layers} sparse layers, budget "
        f"{report['settings']['budget']}, evict page {report['settings']['evict_page']})",
        f"- Command: `{' '.join(report['provenance']['command'])}`",
        "",
        "Launches and host syncs per decode step that the sparse layers add, driven as SGLang's graph runner "
        "drives the backend (allocation hook; before the replay `SparseForward.begin_replay`: marks, plan, "
        "evictions, the graph's buffers filled; the sparse layers over those buffers; release), counted per "
        "op (`bench/common/device_cost.py`), each project kernel as its Triton launches. Per layer = per "
        "step / sparse layers. Host ops: every tensor op the host dispatches before the replay, on the host "
        "or the device, views and allocations included (each costs the host microseconds, launch or not).",
        "",
        "| batch | steps (evicting) | launches/step | per layer, all steps | per layer, eviction steps (max) "
        "| per layer, other steps | syncs/step (max) | outside a captured graph, per step "
        "| host ops before replay, per step | host ms: alloc / before replay / release |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row in report["runs"]:
        every, evicting, other = row["all_steps"], row["eviction_steps"], row["other_steps"]
        host = row["host_ms_median"]
        lines.append(
            f"| {row['batch']} | {every['steps']} ({evicting['steps']}) | {every['launches_mean']:.0f} | "
            f"{every['launches_per_layer_mean']:.2f} | "
            + (
                f"{evicting['launches_per_layer_mean']:.2f} ({evicting['launches_per_layer_max']:.2f})"
                if evicting["steps"]
                else "—"
            )
            + " | "
            + (f"{other['launches_per_layer_mean']:.2f}" if other["steps"] else "—")
            + f" | {every['syncs_mean']:.2f} ({every['syncs_max']}) | {every['outside_graph_mean']:.1f} | "
            f"{every['host_ops_before_replay_mean']:.0f} | "
            f"{host['allocation']:.2f} / {host[BEFORE_REPLAY]:.2f} / {host['release']:.2f} |"
        )
    runs = report["runs"]
    spread = runs[-1]["all_steps"]["launches_per_layer_mean"] / runs[0]["all_steps"]["launches_per_layer_mean"]
    lines += [
        "",
        f"Per layer over all steps, batch {runs[-1]['batch']} against batch {runs[0]['batch']}: {spread:.3f}x "
        "(the target: within 10%).",
        "",
        "Launches per step by section (mean over all steps). With SGLang's decode graph the layers replay "
        f"and the step launches {', '.join(OUTSIDE_GRAPH)} from the host.",
        "",
    ]
    sections = SECTIONS
    lines += ["| batch | " + " | ".join(sections) + " |", "|---:|" + "---:|" * len(sections)]
    for row in report["runs"]:
        by = row["all_steps"]["by_section_mean"]
        lines.append(f"| {row['batch']} | " + " | ".join(f"{by[s]:.1f}" for s in sections) + " |")
    kinds = {kind for row in report["runs"] for kind in row["sync_kinds_total"]}
    if kinds:
        lines += ["", "Host syncs by kind (total over the counted steps):", ""]
        lines += ["| kind | " + " | ".join(str(row["batch"]) for row in report["runs"]) + " |"]
        lines += ["|---|" + "---:|" * len(report["runs"])]
        for kind in sorted(kinds):
            lines.append(
                f"| {kind} | " + " | ".join(str(row["sync_kinds_total"].get(kind, 0)) for row in report["runs"]) + " |"
            )
    for before in report.get("before") or ():
        lines += [
            "",
            f"## Before (commit `{before['provenance']['commit'][:10]}`"
            + (", dirty tree" if before["provenance"]["dirty"] else "")
            + ": that run's harness)",
            "",
            "| batch | per layer, all steps | per layer, eviction steps | syncs/step | host ops before replay |",
            "|---:|---:|---:|---:|---:|",
        ]
        for row in before["runs"]:
            evicting, host_ops = row["eviction_steps"], row["all_steps"].get("host_ops_before_replay_mean")
            lines.append(
                f"| {row['batch']} | {row['all_steps']['launches_per_layer_mean']:.2f} | "
                + (f"{evicting['launches_per_layer_mean']:.2f}" if evicting["steps"] else "—")
                + f" | {row['all_steps']['syncs_mean']:.2f} | "
                + ("—" if host_ops is None else f"{host_ops:.0f}")
                + " |"
            )
    lines += [
        "",
        "Host milliseconds are this machine's medians. Allocation and release (`finish_forward`) touch "
        "no device tensor and run outside the counting mode: their time is the host's own. The work "
        "before the replay dispatches device ops, so its time includes the counting mode's Python work on "
        "each op and, on the simulated device, the ops themselves run on this CPU. The counts are what "
        "carries to a GPU.",
    ]
    return "\n".join(lines) + "\n"


def plot(report: dict[str, Any], path: Path) -> bool:
    """Launches per layer against the batch (False where matplotlib is not installed: a lent
    GPU's image may lack it; the JSON and markdown carry the same numbers)."""
    try:
        import matplotlib
    except ImportError:
        return False

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axis = plt.subplots(figsize=(7, 4))
    earlier = [(f"before ({b['provenance']['commit'][:7]})", b) for b in report.get("before") or ()]
    for label, data in [("after", report), *earlier]:
        batches = [row["batch"] for row in data["runs"]]
        every = [row["all_steps"]["launches_per_layer_mean"] for row in data["runs"]]
        evicting = [
            row["eviction_steps"]["launches_per_layer_mean"] if row["eviction_steps"]["steps"] else float("nan")
            for row in data["runs"]
        ]
        style = "-" if label == "after" else "--"
        axis.plot(batches, every, style, marker="o", label=f"{label}: all steps")
        axis.plot(batches, evicting, style, marker="s", label=f"{label}: eviction steps")
    axis.set(xlabel="decode batch", ylabel="launches per sparse layer per step", yscale="log")
    axis.set_xscale("log", base=2)
    axis.grid(True, alpha=0.3)
    axis.legend()
    axis.set_title(f"Sparse decode step: launches per layer ({report['device']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _without_before(report: dict[str, Any]) -> dict[str, Any]:
    """An earlier report as shown beside, without the reports it showed beside it."""
    return {key: value for key, value in report.items() if key != "before"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--steps", type=int, default=48, help="counted decode steps per batch size")
    parser.add_argument("--device", default="sim", choices=("sim", "cuda"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--before", type=Path, action="append", default=[], help="an earlier run's JSON, shown beside (repeatable)"
    )
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--stem", help="file name stem (default step-cost-<date>[-small][-cuda])")
    parser.add_argument("--small", action="store_true", help="a 6-layer model at budget 40 (a dry run)")
    parser.add_argument(
        "--sync-debug", action="store_true", help="CUDA: every counted step under set_sync_debug_mode('error')"
    )
    args = parser.parse_args()
    device = SimDevice.device if args.device == "sim" else torch.device("cuda")
    shape, config = (SMALL_SHAPE, SMALL_CONFIG) if args.small else (json.loads(MODEL.read_text()), PRESETS["default"])
    sparse_layers = shape["num_hidden_layers"] - len(config.full_layers)
    runs = []
    for batch in (int(b) for b in args.batches.split(",")):
        started = time.perf_counter()
        run = measure(batch, args.steps, device, args.seed, shape, config, sync_debug=args.sync_debug)
        runs.append(summarize(run, sparse_layers))
        print(
            f"[step-cost] batch {batch}: {runs[-1]['all_steps']['launches_per_layer_mean']:.2f} launches/layer, "
            f"{runs[-1]['all_steps']['syncs_mean']:.2f} syncs/step ({time.perf_counter() - started:.0f} s)",
            flush=True,
        )
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else f"simulated on {platform.processor() or 'CPU'}"
    report = {
        "date": dt.date.today().isoformat(),
        "device": gpu,
        "provenance": provenance(sys.argv),
        "settings": {
            "shape": f"{shape['num_hidden_layers']} layers, {shape['num_key_value_heads']} KV heads, head dim "
            f"{shape['head_dim']}, bf16",
            "sparse_layers": sparse_layers,
            "budget": config.budget,
            "evict_page": config.evict_page,
            "steps": args.steps,
            "seed": args.seed,
        },
        "runs": runs,
        "before": [_without_before(json.loads(path.read_text())) for path in args.before],
    }
    stem = args.stem or f"step-cost-{report['date']}" + ("-small" if args.small else "")
    stem += "-cuda" if device.type == "cuda" and not args.stem else ""
    paths = ReportPaths(args.out_dir, stem)
    write_json(paths, report)
    paths.markdown.write_text(markdown(report))
    plotted = plot(report, paths.png)
    print(
        f"[step-cost] wrote {paths.json}, {paths.markdown}"
        + (f", {paths.png}" if plotted else " (no matplotlib: no plot)")
    )


if __name__ == "__main__":
    main()
