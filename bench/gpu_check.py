"""What needs a GPU to check, checked and timed in one command from a plain checkout (a lent GPU).

  python bench/gpu_check.py [--out-dir DIR]      # on a CUDA machine: under 8 minutes, at most 8 files
  python bench/gpu_check.py --dry-run            # the same steps on a CPU at tiny sizes

It needs torch and Triton only: no SGLang and no install (`common/checkout.py` maps the package
names onto the checkout's folders). Steps, each with a time limit; a failing step is recorded and
the run goes on:
  kernels    ``bench/kernels.py``: every Triton kernel against its torch reference at full sizes,
             then timed (beside SGLang's kernels where SGLang imports); its own JSON and markdown.
  step-cost  ``bench/step_cost.py --device cuda``: launches and host syncs the sparse machinery
             adds per decode step at Llama-3.1-8B's KV shape, batches 1, 8 and 64, every counted
             step under ``torch.cuda.set_sync_debug_mode("error")``; its own JSON, markdown and PNG.
             (CPU: the simulated device at a small shape.)
  graph      the sparse decode step as SGLang's graph runner drives the backend's sparse side
             (``SparseForward``: its fixed buffers, planned into before every replay, under
             ``torch.cuda.set_sync_debug_mode("error")``), captured once in a ``torch.cuda.CUDAGraph``
             and replayed for 300 steps in which requests, of the server's policy or their own
             (TOVA, KeyNorm, random: every score update and first score), join, evict and finish,
             against the eager step on a twin state: outputs equal within two roundings of their
             dtype (a replay sums in the captured batch's grouping), and the median step time
             of both. (CPU: the buffers without a graph.)
  bandwidth  ``bench/bandwidth.py``: the decode and eviction kernels' achieved bandwidth against the
             device's copy bandwidth and the decode's time against torch's flash SDPA over the
             same K/V, contexts 1k-32k, batches 1-128, head dims 64-256, GQA 1-8 (decode:
             (share of the copy bandwidth, time over SDPA's) per case); its own JSON.
  serving    ``bench/serving.py --profile gpu-check-serving`` (the Llama-3.1-8B shape with dummy
             weights, stock SGLang against the project), only where SGLang imports: recorded as
             skipped, with the reason, where it does not.

Writes ``<out-dir>/gpu-check-<date>[-dry-run].json`` and ``.md``, the device named in both: with
the kernels', the step cost's and the bandwidth's reports, eight files.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import importlib.util
import json
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common.checkout import ROOT, importable
from common.report import ReportPaths, provenance_line, write_json

importable()

from sglang_kvsparse.state.sparse_state import SparseState  # noqa: E402
from tests.unit.heap import OWN_POLICY_SETTINGS, ReplayStep, decode_lifecycle, eager_step, make_state  # noqa: E402

STEPS = 300
GRAPH_BS = 6
SERVING_PROFILE = "gpu-check-serving"
STEP_NAMES = ("kernels", "step-cost", "graph", "bandwidth", "serving")
#: Each subprocess step's limit in seconds: together under 8 minutes with the graph step.
LIMITS = {"kernels": 170, "step-cost": 170, "bandwidth": 100, "serving": 900}


def say(message: str) -> None:
    print(f"[gpu-check] {message}", flush=True)


def lifecycle_state(device: str) -> SparseState:
    """The decode lifecycle's state: 3 sparse layers, budget 8, evicting every 4 entries, lanes
    of head dim 128 in bfloat16 (the served shape: `tl.dot`'s inner dimension is the head dim)."""
    state, _ = make_state(
        num_layers=4,
        full_layers=(0,),
        budget=8,
        evict_page=4,
        rows=4096,
        max_requests=8,
        context=4096,
        device=device,
        head_dim=128,
        dtype=torch.bfloat16,
    )
    return state


class GraphDecode(ReplayStep):
    """The decode step as SGLang's graph runner drives the sparse side of the backend
    (`SparseForward`: `init_graph`, `begin_capture`, then `begin_replay` before every replay),
    its sparse layers captured in a CUDA graph at the first step (after a warm-up whose writes
    are undone); on a CPU the same buffers run eagerly."""

    def __init__(self, state: SparseState, device: str) -> None:
        super().__init__(state, GRAPH_BS)
        self.device = device
        self.inputs: list[torch.Tensor] | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.out: torch.Tensor | None = None
        self.times: list[float] = []

    def __call__(self, state: SparseState, req_indices: list[int], q, k, v, positions) -> torch.Tensor:
        start = time.perf_counter()
        if self.inputs is None:
            self.inputs = [t.new_zeros(GRAPH_BS, *t.shape[1:]) for t in (q, k, v, positions)]
        if self.device != "cuda":
            self.fill(req_indices)
            self._set_inputs(q, k, v, positions)
            self.out = self.layers_over(*self.inputs)
        else:
            if self.graph is None:
                self.fill(req_indices)
                self._set_inputs(q, k, v, positions)
                self._capture(state)
            else:
                torch.cuda.set_sync_debug_mode("error")  # planning and replay never wait on the device
                try:
                    self.fill(req_indices)
                    self._set_inputs(q, k, v, positions)
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            self.graph.replay()
            torch.cuda.synchronize()
        self.times.append(time.perf_counter() - start)
        return self.out[:, : q.shape[0]].clone()

    def _set_inputs(self, q, k, v, positions) -> None:
        for static, given in zip(self.inputs, (q, k, v, positions)):
            static.zero_()
            static[: given.shape[0]].copy_(given)

    def _capture(self, state: SparseState) -> None:
        saved = [(lane.k.clone(), lane.v.clone()) for lane in state.lanes]  # scores live in k
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.layers_over(*self.inputs)  # compiles and loads every kernel
        torch.cuda.current_stream().wait_stream(side)
        for lane, (k, v) in zip(state.lanes, saved):
            lane.k.copy_(k)
            lane.v.copy_(v)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = self.layers_over(*self.inputs)


def timed_eager(times: list[float]) -> Callable:
    def decode(state, req_indices, q, k, v, positions):
        start = time.perf_counter()
        out = eager_step(state, req_indices, q, k, v, positions)
        if q.is_cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        return out

    return decode


def check_graph(device: str) -> dict[str, Any]:
    settings = OWN_POLICY_SETTINGS
    eager_times: list[float] = []
    eager, evicting = decode_lifecycle(lifecycle_state(device), STEPS, timed_eager(eager_times), settings=settings)
    state = lifecycle_state(device)
    graph = GraphDecode(state, device)
    replayed, _ = decode_lifecycle(state, STEPS, graph, settings=settings)
    worst = max((float((a - b).abs().max()) for a, b in zip(eager, replayed)), default=0.0)
    scale = max((float(a.abs().max()) for a in eager), default=1.0) or 1.0
    # A replay runs the captured batch size (padding included), so its sums are grouped otherwise
    # than an eager step's (the kernel's split of the keys, the reference's matmul blocking): an
    # output may round to the next value of its dtype. Stale buffers would miss by the outputs' size.
    bound = 2 * torch.finfo(eager[0].dtype).eps if eager else 0.0
    return {
        "decode_steps": len(eager),
        "steps_with_evictions": evicting,
        "request_policies": [setting.policy.name if setting.policy else "server's" for setting in settings],
        "max_abs_difference": worst,
        "max_difference_of_largest_output": worst / scale,
        "bound": bound,
        "eager_step_ms_median": 1e3 * statistics.median(eager_times),
        "graph_step_ms_median": 1e3 * statistics.median(graph.times[1:] or graph.times),
        "ok": len(eager) == len(replayed) and worst / scale <= bound,
    }


def run_script(args: list[str], timeout_s: int) -> dict[str, Any]:
    """Run one of the bench scripts; its own reports land in the same folder."""
    try:
        run = subprocess.run(
            [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired as exc:
        tail = ((exc.stdout or b"").decode() + (exc.stderr or b"").decode()).strip().splitlines()[-15:]
        return {"command": " ".join(args), "timed_out_after_s": timeout_s, "output_tail": tail, "ok": False}
    tail = (run.stdout + run.stderr).strip().splitlines()[-15:]
    return {"command": " ".join(args), "returncode": run.returncode, "output_tail": tail, "ok": run.returncode == 0}


def check_kernels(out_dir: Path, dry_run: bool) -> dict[str, Any]:
    args = ["bench/kernels.py", "--out-dir", str(out_dir), *(["--dry-run"] if dry_run else [])]
    return run_script(args, LIMITS["kernels"])


def check_step_cost(out_dir: Path, dry_run: bool) -> dict[str, Any]:
    args = ["bench/step_cost.py", "--out-dir", str(out_dir), "--batches", "1,8,64", "--steps", "32"]
    args += ["--device", "sim", "--small"] if dry_run else ["--device", "cuda", "--sync-debug"]
    result = run_script(args, LIMITS["step-cost"])
    reports = sorted(out_dir.glob("step-cost-*.json"))
    if reports:
        runs = json.loads(reports[-1].read_text())["runs"]
        result["per_layer"] = {
            run["batch"]: {
                "all_steps": round(run["all_steps"]["launches_per_layer_mean"], 2),
                "eviction_steps": round(run["eviction_steps"].get("launches_per_layer_mean", 0.0), 2),
                "syncs_per_step": run["all_steps"]["syncs_mean"],
            }
            for run in runs
        }
    return result


def check_bandwidth(out_dir: Path, dry_run: bool) -> dict[str, Any]:
    path = out_dir / f"bandwidth-{dt.date.today().isoformat()}{'-dry-run' if dry_run else ''}.json"
    args = ["bench/bandwidth.py", "--json", str(path), *(["--small"] if dry_run else [])]
    result = run_script(args, LIMITS["bandwidth"])
    if path.exists():
        report = json.loads(path.read_text())
        result["copy_gb_s"] = round(report["copy_bandwidth"] / 1e9, 1)
        result["targets"] = report["targets"]
        result["decode"] = {
            f"{row['context']}x{row['batch']} D{row['head_dim']} G{row['group']}": (
                round(row["of_copy_bandwidth"], 3),
                None if row["vs_sdpa"] is None else round(row["vs_sdpa"], 2),
            )
            for row in report["decode"]
        }
        result["evict_of_copy"] = {
            f"{row['budget']}x{row['requests']}": round(row["of_copy_bandwidth"], 3) for row in report["evict"]
        }
    return result


def check_serving(out_dir: Path, dry_run: bool) -> dict[str, Any]:
    if importlib.util.find_spec("sglang") is None:
        return {"ok": True, "skipped": "SGLang is not installed here (serving needs it, the other steps do not)"}
    args = ["bench/serving.py", "--profile", SERVING_PROFILE, "--out-dir", str(out_dir)]
    result = run_script([*args, *(["--dry-run"] if dry_run else [])], LIMITS["serving"])
    name = f"{SERVING_PROFILE}-dry-run" if dry_run else SERVING_PROFILE
    reports = sorted(out_dir.glob(f"{name}-[0-9]*.json"))
    if reports:
        systems = json.loads(reports[-1].read_text())["systems"]
        result["systems"] = {
            system["name"]: {"error": system["error"], "runs": [_summary(run) for run in system["runs"]]}
            for system in systems
        }
        result["ok"] = result["ok"] and all(system["error"] is None for system in systems)
    return result


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    keys = ("concurrency", "completed", "output_tok_s", "itl_median_ms", "ttft_median_ms", "peak_running")
    return {key: run.get(key) for key in keys}


def _version(package: str) -> str | None:
    try:
        return importlib.import_module(package).__version__
    except ImportError:
        return None


def device_name(device: str) -> str:
    return torch.cuda.get_device_name(0) if device == "cuda" else "CPU (dry run)"


def write_report(out_dir: Path, report: dict[str, Any]) -> Path:
    stem = f"gpu-check-{report['date']}{'-dry-run' if report['dry_run'] else ''}"
    json_path = ReportPaths(out_dir, stem).json
    write_json(ReportPaths(out_dir, stem), report)
    lines = [
        f"# GPU check, {report['date']}: {report['device']}",
        provenance_line(report),
        "",
        "Written by `bench/gpu_check.py`" + (" --dry-run (timings mean nothing)." if report["dry_run"] else "."),
        "",
        "| step | ok | seconds | result |",
        "|---|---|---|---|",
    ]
    for name, step in report["steps"].items():
        shown = {key: value for key, value in step.items() if key not in ("ok", "seconds", "output_tail", "error")}
        if step.get("error"):
            shown = {"error": step["error"]}
        lines.append(
            f"| {name} | {'yes' if step['ok'] else '**no**'} | {step['seconds']:.0f} | `{json.dumps(shown)}` |"
        )
    (out_dir / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return json_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at tiny sizes")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--steps", default=",".join(STEP_NAMES), help=f"comma-separated, of {', '.join(STEP_NAMES)}")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if device == "cpu" and not args.dry_run:
        parser.error("no CUDA device here: run with --dry-run")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "date": dt.date.today().isoformat(),
        "device": device_name(device),
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "triton": _version("triton"),
        "steps": {},
    }
    steps: dict[str, Callable[[], dict[str, Any]]] = {
        "kernels": lambda: check_kernels(args.out_dir, args.dry_run),
        "step-cost": lambda: check_step_cost(args.out_dir, args.dry_run),
        "graph": lambda: check_graph(device),
        "bandwidth": lambda: check_bandwidth(args.out_dir, args.dry_run),
        "serving": lambda: check_serving(args.out_dir, args.dry_run),
    }
    chosen = args.steps.split(",")
    unknown = set(chosen) - set(steps)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; choose from {', '.join(STEP_NAMES)}")
    for name in chosen:
        step = steps[name]
        say(f"{name} ...")
        start = time.perf_counter()
        try:
            result = step()
        except Exception as exc:  # recorded; the other steps still run
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}
        result["seconds"] = time.perf_counter() - start
        report["steps"][name] = result
        say(f"{name}: {'ok' if result['ok'] else 'FAILED'} in {result['seconds']:.0f} s")
        write_report(args.out_dir, report)
    path = write_report(args.out_dir, report)
    say(f"wrote {path} and its .md")
    return 0 if all(step["ok"] for step in report["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
