"""Every Triton kernel of the product compiles for an H100 (sm_90) without a GPU, with this
environment's Triton and with the lent GPU's (3.6) (`bench/compile_check.py`); and the check fails
a kernel that would not compile or launch there.

The kernel tier compiles every kernel and variant at every head dim in bfloat16 (`core`: about a
minute on 2 cores, each Triton in its own process, side by side); the extended tier every served
dtype and GQA group besides (over three minutes).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import compile_check  # noqa: E402


def compiles_for_sm90_with_both_tritons(case_set: str) -> None:
    assert len(compile_check.tritons()) == 2, "the lent GPU's Triton is missing: run scripts/setup.sh"
    runs = compile_check.run_all(90, case_set=case_set)
    assert {run["triton"].rsplit(".", 1)[0] for run in runs} >= {"3.6"}
    wanted = {compile_check.Case(**row["case"]) for row in runs[0]["results"]}
    kinds = {(case.family, case.variant, case.kv_dtype) for case in compile_check.cases()}
    assert {(case.family, case.variant, case.kv_dtype) for case in wanted} == kinds
    for run in runs:
        assert {compile_check.Case(**row["case"]) for row in run["results"]} == wanted
        assert {row["case"]["head_dim"] for row in run["results"]} == {64, 128, 256}
        # every case compiled at least one kernel, with its resources read from ptxas
        assert all(row["registers"] for row in run["results"] if row["ok"])
    assert compile_check.failures(runs) == []


def test_every_kernel_and_variant_compiles_for_sm90_with_both_tritons() -> None:
    compiles_for_sm90_with_both_tritons("core")


@pytest.mark.extended
def test_every_served_dtype_and_group_compiles_for_sm90_with_both_tritons() -> None:
    compiles_for_sm90_with_both_tritons("all")


def test_a_kernel_that_cannot_compile_fails_the_check(tmp_path: Path) -> None:
    """A bf16 `tl.dot` with an inner dimension of 8 (NVIDIA needs 16): the check records the
    compile error and goes on to the next case. Compiled in a fresh process, as the check does."""
    code = """
import os, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp()
sys.path.insert(0, sys.argv[1])
import torch, triton, triton.language as tl
import compile_check as cc

@triton.jit
def bad(X, Y):
    r = tl.arange(0, 16)
    k = tl.arange(0, 8)
    a = tl.load(X + r[:, None] * 8 + k[None, :])
    b = tl.load(X + k[:, None] * 16 + r[None, :])
    tl.store(Y + r[:, None] * 16 + r[None, :], tl.dot(a, b))

def launch(case):
    if case.family == "bad":
        bad[(1,)](torch.zeros(256, dtype=torch.bfloat16), torch.zeros(256, dtype=torch.float32))
    else:
        cc._launch(case)

results = cc.check(90, [cc.Case("bad", 8, "bfloat16"), cc.Case("write", 128, "bfloat16", 1, "zero")], print, launch)
print("RESULT", [(r.case.family, r.ok) for r in results], results[0].error[:200].replace(chr(10), " "))
"""
    bench = Path(compile_check.__file__).parent
    script = tmp_path / "bad_kernel.py"  # Triton reads a kernel's source from its file
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script), str(bench)], capture_output=True, text=True, timeout=300, cwd=bench.parent
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = next(line for line in done.stdout.splitlines() if line.startswith("RESULT"))
    assert "[('bad', False), ('write', True)]" in result, result


@pytest.mark.parametrize(
    "shared, registers, warps, ok", [(1024, 64, 4, True), (300_000, 64, 4, False), (1024, 255, 16, False)]
)
def test_a_kernel_too_large_for_an_sm_fails(shared: int, registers: int, warps: int, ok: bool) -> None:
    """Compiled is not enough: more shared memory than a block may have, or more registers than
    an SM holds for the kernel's warps, would fail at launch on the GPU."""

    class Kernel:
        class metadata:  # noqa: N801 (Triton's attribute)
            pass

    Kernel.metadata.shared, Kernel.metadata.num_warps = shared, warps
    log = f"ptxas info : Used {registers} registers\n0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"
    result = compile_check._resources(compile_check.Case("decode", 128, "bfloat16"), "k", Kernel, log, 0.0)
    assert result.ok is ok and result.registers == registers
