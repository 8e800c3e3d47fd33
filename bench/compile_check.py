"""Every Triton kernel of the product compiled for a GPU target on a machine without a GPU.

  python bench/compile_check.py                      # sm_90 with this environment's Triton and,
                                                     # where set up, the lent GPU's (Triton 3.6)
  python bench/compile_check.py --out-dir DIR        # also write compile-sm90-<date>.{json,md}
  python bench/compile_check.py --cases core         # the kernel tier's share (see `core`)

Each kernel is driven through its own launch wrapper (`kernels.*_triton`), with small CPU tensors
of a served shape (head dims 64 / 128 / 256, bf16 / fp16 / fp32, GQA groups 1 / 4 / 8, every
score update and eviction width the product launches; FP8 K/V buffers of both formats under
bf16 queries), so the constexprs, tile sizes and warps
are exactly those a GPU would get. Triton's launcher is turned into its warm-up (compile, never
launch) under a stand-in driver that names the target (`GPUTarget("cuda", 90, 32)`); the Triton
wheel's own `ptxas` builds the cubin and reports registers and spills; shared memory is Triton's
own figure. A kernel fails the check when it does not compile, or when it compiles but could not
launch on an H100 (more shared memory than a block may have, more registers than an SM holds for
its warps). A spill is reported, not failed: the report says where.

The lent GPU runs Triton 3.6, whose shape rules differ from this environment's (a `tl.dot`'s inner
dimension of 8, for one), so the check runs once per Triton it finds: this environment's, and
the one `scripts/setup.sh` installs beside it (`.venv/triton-3.6`), each in its own
process. No SGLang, no GPU, no network.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
#: Where `scripts/setup.sh` puts the lent GPU's Triton (a `pip --target` folder).
TRITON_36 = ROOT / ".venv" / "triton-3.6"

HEAD_DIMS = (64, 128, 256)
DTYPES = ("bfloat16", "float16", "float32")
#: The KV cache formats of `--kv-cache-dtype fp8_e4m3 / fp8_e5m2`, under bfloat16 queries.
FP8 = ("float8_e4m3fn", "float8_e5m2")
GROUPS = (1, 4, 8)
#: Decode evictions launch one row of budget + evict_page entries: the default budget, a small
#: and a large one a request may ask for (the row is one register tile, its width a power of two).
EVICT_ROWS = (256 + 16, 1024 + 16, 4096 + 16)

#: The variant of a decode or write launch that reads each request's rule from a tensor.
PER_ROW = "per-row"

#: Hopper's per-block limits (H100/H200, sm_90): dynamic shared memory and registers per SM.
MAX_SHARED_BYTES = 232_448
REGISTERS_PER_SM = 65_536


@dataclass(frozen=True)
class Case:
    """One launch of a kernel family at a served shape."""

    family: str  # extend | window_scores | decode | write | evict
    head_dim: int
    dtype: str
    group: int = 1
    #: extend: stats / no-stats; decode: its score update, or per-row (each request's own: a
    #: captured step, or a batch of several policies); write: the first score's kind, or per-row;
    #: evict: the row's entries
    variant: str = ""
    kv_dtype: str = ""  # the K/V buffers' dtype when it is not `dtype` (FP8)

    @property
    def label(self) -> str:
        kv = f" kv {self.kv_dtype}" if self.kv_dtype else ""
        return f"{self.family} D={self.head_dim} {self.dtype}{kv} G={self.group} {self.variant}".rstrip()


@dataclass
class KernelResult:
    """One compiled kernel of a case (a family may launch several), or the case's failure."""

    case: Case
    kernel: str
    ok: bool
    error: str = ""
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared_bytes: int | None = None
    num_warps: int | None = None
    seconds: float = 0.0


def cases() -> list[Case]:
    """Every launch the product makes, at every served head dim and dtype."""
    out: list[Case] = []
    for d in HEAD_DIMS:
        for dtype in DTYPES:
            for g in GROUPS:
                out.append(Case("extend", d, dtype, g, "stats"))
                out.append(Case("window_scores", d, dtype, g))
                out.append(Case("decode", d, dtype, g, "add"))
                out.append(Case("decode", d, dtype, g, PER_ROW))
            out.append(Case("extend", d, dtype, 4, "no-stats"))
            out.append(Case("decode", d, dtype, 4, "replace"))
            out.append(Case("decode", d, dtype, 4, "none"))
            out.append(Case("write", d, dtype, 1, "zero"))
            out.append(Case("write", d, dtype, 1, PER_ROW))
            out.extend(Case("evict", d, dtype, 1, str(n)) for n in EVICT_ROWS)
        for kv in FP8:
            out.append(Case("extend", d, "bfloat16", 4, "stats", kv))
            out.append(Case("window_scores", d, "bfloat16", 4, "", kv))
            out.append(Case("decode", d, "bfloat16", 4, "add", kv))
            out.append(Case("decode", d, "bfloat16", 4, PER_ROW, kv))
            out.append(Case("write", d, "bfloat16", 1, PER_ROW, kv))
            out.append(Case("evict", d, "bfloat16", 1, str(EVICT_ROWS[1]), kv))
    return out


def core(case: Case) -> bool:
    """The kernel tier's share of `cases()`: every kernel and variant (FP8 K/V included) at every
    head dim in bfloat16, the GPU's dtype, with GQA group 4 (Llama-3.1-8B's) and every group at
    head dim 128. float16, float32 (whose IEEE dots take tiles of their own) and the other groups
    at 64 and 256 compile in the extended tier and in the report."""
    return case.dtype == "bfloat16" and (case.head_dim == 128 or case.group == 4 or case.family in ("write", "evict"))


CASE_SETS: dict[str, Callable[[Case], bool]] = {"all": lambda case: True, "core": core}


# -- the worker: one Triton, in this process -------------------------------------------------


class _TargetDriver:
    """Triton's active driver reduced to what its launcher asks before compiling: the target."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def is_active(self) -> bool:
        return True


@contextlib.contextmanager
def compiling_for(arch: int) -> Iterator[list[tuple[str, Any, str, float]]]:
    """Within: every Triton launch compiles for `sm_<arch>` and returns without running; yields
    the list of (kernel name, compiled kernel, ptxas log, seconds) it fills."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver
    from triton.runtime.jit import JITFunction

    compiled: list[tuple[str, Any, str, float]] = []
    logs: dict[str, str] = {}  # a kernel's ptxas log by its hash: a second launch of it compiles nothing
    run = JITFunction.run

    def warm_up(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        log = io.StringIO()
        start = time.perf_counter()
        with contextlib.redirect_stdout(log):
            kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        logs.setdefault(kernel.hash, log.getvalue())
        compiled.append((self.fn.__name__, kernel, logs[kernel.hash], time.perf_counter() - start))
        return kernel

    dump, active = knobs.nvidia.dump_ptxas_log, driver._active  # no GPU: there is no default driver to reset to
    knobs.nvidia.dump_ptxas_log = True
    driver.set_active(_TargetDriver(GPUTarget("cuda", arch, 32)))
    JITFunction.run = warm_up
    try:
        yield compiled
    finally:
        JITFunction.run = run
        driver._active = active
        knobs.nvidia.dump_ptxas_log = dump


def _launch(case: Case) -> None:
    """Call the case's launch wrapper with small CPU tensors of its shape."""
    import torch

    from sglang_kvsparse import kernels

    dtype = getattr(torch, case.dtype)
    kv_dtype = getattr(torch, case.kv_dtype or case.dtype)
    heads, d, g = 2, case.head_dim, case.group
    slots = 512
    k_buf = torch.zeros(slots, heads, d, dtype=kv_dtype)
    v_buf = torch.zeros_like(k_buf)
    scores = torch.zeros(slots * 4, heads, dtype=torch.float32)
    lens = [40, 24]
    indptr = torch.tensor([0, 40, 64], dtype=torch.int32)
    indices = torch.arange(64, dtype=torch.int32)
    q_ext = torch.zeros(64, heads * g, d, dtype=dtype)
    if case.family == "extend":
        kernels.extend_attention_with_stats_triton(
            q_ext, k_buf, v_buf, indptr, indptr, indices, 0.1, with_stats=case.variant == "stats"
        )
    elif case.family == "window_scores":
        lse = torch.zeros(64, heads * g, dtype=torch.float32)
        kernels.window_scores_triton(q_ext, k_buf, lse, indptr, indptr, indices, 16, 0.1)
    elif case.family == "decode":
        batch = len(lens)
        table = torch.arange(batch * 48, dtype=torch.int32).view(batch, 48)
        kernels.decode_attention_with_scores_triton(
            torch.zeros(batch, heads * g, d, dtype=dtype),
            k_buf,
            v_buf,
            torch.tensor(lens, dtype=torch.int32),
            table,
            scores,
            0.1,
            score_indices=table,
            score_update="add" if case.variant == PER_ROW else case.variant,
            row_updates=torch.zeros(batch, dtype=torch.int32) if case.variant == PER_ROW else None,
            num_kv_splits=kernels.decode_attention.MAX_SPLITS,  # the widest merge a server compiles
        )
    elif case.family == "write":
        n = 3
        kernels.write_entries_triton(
            k_buf,
            v_buf,
            scores,
            torch.arange(n, dtype=torch.int64),
            torch.arange(n, dtype=torch.int64),
            torch.zeros(n, heads, d, dtype=dtype),
            torch.zeros(n, heads, d, dtype=dtype),
            torch.arange(n, dtype=torch.int64),
            first_score="zero" if case.variant == PER_ROW else case.variant,
            first_kinds=torch.zeros(n, dtype=torch.int32) if case.variant == PER_ROW else None,
        )
    elif case.family == "evict":
        n = int(case.variant)
        k_big = torch.zeros(2 * n, heads, d, dtype=kv_dtype)
        table = torch.arange(2 * n, dtype=torch.int64).view(1, 2, n)
        kernels.evict_rows_triton(
            k_big,
            torch.zeros_like(k_big),
            torch.zeros(2 * n, heads, dtype=torch.float32),
            torch.zeros(2, n, heads, dtype=torch.float32),
            table,
            table,
            n - 16,
            4,
            16,
        )
    else:
        raise ValueError(f"unknown kernel family {case.family!r}")


_USED = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _resources(case: Case, name: str, kernel: Any, log: str, seconds: float) -> KernelResult:
    """Registers and spills from the kernel's ptxas log, shared memory from Triton's metadata;
    a kernel that would not launch on the target is a failure."""
    used, spills = _USED.search(log), _SPILLS.search(log)
    if used is None or spills is None:
        return KernelResult(case, name, False, f"no ptxas report in the compile log: {log[-300:]!r}", seconds=seconds)
    result = KernelResult(
        case,
        name,
        True,
        registers=int(used.group(1)),
        spill_stores=int(spills.group(1)),
        spill_loads=int(spills.group(2)),
        shared_bytes=int(kernel.metadata.shared),
        num_warps=int(kernel.metadata.num_warps),
        seconds=seconds,
    )
    if result.shared_bytes > MAX_SHARED_BYTES:
        result.ok, result.error = (
            False,
            f"{result.shared_bytes} bytes of shared memory (a block has {MAX_SHARED_BYTES})",
        )
    elif result.registers * result.num_warps * 32 > REGISTERS_PER_SM:
        result.ok, result.error = False, f"{result.registers} registers x {result.num_warps} warps exceed an SM's"
    return result


def check(
    arch: int,
    selected: list[Case],
    progress: Callable[[str], None],
    launch: Callable[[Case], None] | None = None,
) -> list[KernelResult]:
    """Compile every case's kernels for `sm_<arch>` with the Triton this process imports, each
    through `launch` (default: the product's launch wrapper of its family)."""
    launch = launch or _launch
    results: list[KernelResult] = []
    with compiling_for(arch) as compiled:
        for i, case in enumerate(selected):
            start = len(compiled)
            began = time.perf_counter()
            try:
                launch(case)
            except Exception as error:  # a compile error is the finding: record it, go on
                message = f"{type(error).__name__}: {error}".strip()
                results.append(KernelResult(case, "", False, message[:2000], seconds=time.perf_counter() - began))
            else:
                results.extend(_resources(case, *entry) for entry in compiled[start:])
            progress(f"{i + 1}/{len(selected)} {case.label}: {'ok' if results[-1].ok else 'FAILED'}")
    return results


def worker(arch: int, out: Path, only: str | None, case_set: str) -> None:
    """Run the check with this process's Triton and write its results as JSON."""
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="kvsparse-compile-")  # every kernel compiled here
    os.environ.pop("TRITON_INTERPRET", None)  # the GPU's code path: native dots, GPU tile sizes
    sys.path.insert(0, str(ROOT / "bench"))
    from common.checkout import importable

    importable()
    import triton

    wanted = CASE_SETS[case_set]
    selected = [c for c in cases() if wanted(c) and (only is None or c.family in only.split(","))]
    results = check(arch, selected, lambda line: print(f"[compile triton {triton.__version__}] {line}", flush=True))
    out.write_text(json.dumps({"triton": triton.__version__, "results": [_row(r) for r in results]}, indent=1))


def _row(result: KernelResult) -> dict[str, Any]:
    row = asdict(result)
    row["case"] = asdict(result.case)
    return row


# -- the driver: every Triton, a report -----------------------------------------------------


def tritons() -> list[tuple[str, Path | None]]:
    """(label, extra import path) of each Triton to check with: this environment's, and the lent
    GPU's where it is set up."""
    found: list[tuple[str, Path | None]] = [("this environment", None)]
    if (TRITON_36 / "triton").is_dir():
        found.append(("the lent GPU's", TRITON_36))
    return found


def run_all(arch: int, only: str | None = None, case_set: str = "all") -> list[dict[str, Any]]:
    """Each Triton's results, one process each (a Triton is imported once per process), the
    processes side by side."""
    with tempfile.TemporaryDirectory() as tmp:
        started = []
        for i, (label, path) in enumerate(tritons()):
            out = Path(tmp) / f"results-{i}.json"
            env = dict(os.environ)
            if path is not None:
                env["PYTHONPATH"] = os.pathsep.join([str(path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
            command = [sys.executable, __file__, "--worker", str(out), "--arch", str(arch), "--cases", case_set]
            if only:
                command += ["--only", only]
            started.append((label, out, subprocess.Popen(command, env=env)))
        runs = []
        for label, out, process in started:
            if process.wait() != 0:
                raise RuntimeError(f"the compile check with {label} Triton stopped with exit code {process.returncode}")
            runs.append({**json.loads(out.read_text()), "label": label})
    return runs


def failures(runs: list[dict[str, Any]]) -> list[str]:
    return [
        f"Triton {run['triton']}: {_case_label(row)} {row['kernel']}: {row['error']}"
        for run in runs
        for row in run["results"]
        if not row["ok"]
    ]


def _case_label(row: dict[str, Any]) -> str:
    return Case(**row["case"]).label


def markdown(report: dict[str, Any]) -> str:
    """The report: every kernel's registers, spills and shared memory by shape, each Triton side
    by side, then the failures and spills."""
    from common.report import provenance_line

    runs, arch = report["runs"], report["arch"]
    lines = [
        f"# Triton kernels compiled for sm_{arch} without a GPU ({report['date']})",
        "",
        provenance_line(report),
        "",
        "Each kernel driven through its launch wrapper at a served shape and compiled (never launched)"
        " for an H100's target by Triton's own pipeline and the Triton wheel's ptxas"
        " (`bench/compile_check.py`). A failure: no compile, or more than"
        f" {MAX_SHARED_BYTES:,} bytes of shared memory, or more registers than an SM's {REGISTERS_PER_SM:,}"
        " for the kernel's warps. Registers and spill bytes (stores/loads) per thread; shared memory"
        " per block.",
        "",
    ]
    for run in runs:
        rows = run["results"]
        bad = [r for r in rows if not r["ok"]]
        spilled = [r for r in rows if r["ok"] and (r["spill_stores"] or r["spill_loads"])]
        most = max((max(r["spill_stores"], r["spill_loads"]) for r in spilled), default=0)
        lines.append(
            f"- Triton {run['triton']} ({run['label']}): {len(rows)} kernels in"
            f" {sum(r['seconds'] for r in rows):.0f} s, {len(bad)} failed, {len(spilled)} spill"
            + (f" (at most {most} bytes a thread)" if spilled else "")
        )
    lines += ["", "## Failures and spills", ""]
    if not any(not r["ok"] or r["spill_stores"] or r["spill_loads"] for run in runs for r in run["results"]):
        lines.append("None.")
    for run in runs:
        for r in run["results"]:
            if not r["ok"]:
                lines.append(f"- Triton {run['triton']}: {_case_label(r)} `{r['kernel']}` failed: {r['error'][:300]}")
            elif r["spill_stores"] or r["spill_loads"]:
                lines.append(
                    f"- Triton {run['triton']}: {_case_label(r)} `{r['kernel']}` spills"
                    f" {r['spill_stores']}/{r['spill_loads']} bytes ({r['registers']} registers)"
                )
    spills = [r for run in runs for r in run["results"] if r["ok"] and (r["spill_stores"] or r["spill_loads"])]
    if spills and all(max(r["spill_stores"], r["spill_loads"]) <= 64 and r["registers"] < 255 for r in spills):
        lines += [
            "",
            "Each spill is at most 64 bytes a thread in a kernel below its 255 registers: stack traffic"
            " ptxas chose (served from L1), not register pressure.",
        ]
    titles = " | ".join(f"{run['triton']} registers | {run['triton']} spill B" for run in runs)
    lines += [
        "",
        "## Every kernel",
        "",
        f"| kernel | family | D | dtype | G | variant | {titles} | shared B | warps |",
        "|---|---|---|---|---|---|" + "---|---|" * len(runs) + "---|---|",
    ]
    first = runs[0]["results"]
    others = [{(_case_label(r), r["kernel"]): r for r in run["results"]} for run in runs[1:]]
    for r in first:
        c, key = r["case"], (_case_label(r), r["kernel"])
        cells = [_resource_cells(r)] + [_resource_cells(other.get(key)) for other in others]
        dtype = c["dtype"] + (f", K/V {c['kv_dtype']}" if c.get("kv_dtype") else "")
        lines.append(
            f"| {r['kernel'] or '—'} | {c['family']} | {c['head_dim']} | {dtype} | {c['group']} |"
            f" {c['variant']} | {' | '.join(cells)} | {_dash(r['shared_bytes'])} | {_dash(r['num_warps'])} |"
        )
    return "\n".join(lines)


def _resource_cells(row: dict[str, Any] | None) -> str:
    if row is None:
        return "— | —"
    if not row["ok"]:
        return "**failed** | —"
    return f"{row['registers']} | {row['spill_stores']}/{row['spill_loads']}"


def _dash(value: Any) -> str:
    return "—" if value is None else str(value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90: Hopper)")
    parser.add_argument("--out-dir", type=Path, help="write compile-sm<arch>-<date>.{json,md} there")
    parser.add_argument("--only", help="kernel families, comma-separated (default: all)")
    parser.add_argument("--cases", choices=sorted(CASE_SETS), default="all", help="every case, or the kernel tier's")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.arch, args.worker, args.only, args.cases)
        return 0
    runs = run_all(args.arch, args.only, args.cases)
    bad = failures(runs)
    if args.out_dir is not None:
        sys.path.insert(0, str(ROOT / "bench"))
        from common.report import ReportPaths, write_json

        date = dt.date.today().isoformat()
        report = {"arch": args.arch, "date": date, "runs": runs, "failures": bad}
        paths = ReportPaths(args.out_dir, f"compile-sm{args.arch}-{date}")
        write_json(paths, report)
        paths.markdown.write_text(markdown(report) + "\n")
        print(f"[compile] wrote {paths.json} and {paths.markdown}")
    for line in bad:
        print(f"[compile] FAILED {line}")
    print(f"[compile] {sum(len(r['results']) for r in runs)} kernels, {len(bad)} failed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
