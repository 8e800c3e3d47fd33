"""Kernel benchmark: correctness at full sizes, then timings against SGLang's Triton kernels.

On a GPU (one run):
  * checks every Triton kernel against its torch reference (and the prefill against SGLang's
    ``extend_attention_fwd``) at the benchmark sizes;
  * times, with CUDA events (median of --reps after warm-up): prefill with vs without statistics
    (target: < 3 % overhead) next to SGLang's extend kernel and FlashInfer where importable; window
    scoring at 5,000 tokens as the default preset scores (its window of 16 queries)
    relative to that prefill (target: < 5 %); decode with
    score accumulation vs SGLang's decode kernel (and FlashInfer) at the same kept length, and over an
    FP8 cache (e4m3, half the bytes read: `fp8_vs_model_dtype`);
    a decode eviction (selection and move) of every request at once.
  * writes bench/results/kernels-<date>-<gpu>.json and .md (the GPU is named inside).
Without CUDA (or with --small / --dry-run) it runs the same checks at small sizes under the Triton
interpreter; the timings it prints there mean nothing.

Usage: python bench/kernels.py [--small | --dry-run] [--reps N] [--out-dir DIR]
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import platform
import re
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the first triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import triton  # noqa: E402
from common.checkout import importable  # noqa: E402
from common.report import ReportPaths, provenance_line, write_json  # noqa: E402
from common.timing import timer  # noqa: E402

importable()

from sglang_kvsparse.config import PRESETS  # noqa: E402
from sglang_kvsparse.kernels import (  # noqa: E402
    decode_attention_with_scores,
    evict_rows,
    extend_attention_with_stats,
    window_scores,
)
from sglang_kvsparse.kernels.common import quantize  # noqa: E402
from sglang_kvsparse.kernels.decode_attention import decode_splits, processor_count  # noqa: E402
from sglang_kvsparse.kernels.testing import (  # noqa: E402
    RaggedBatch,
    as_table,
    decode_queries,
    indptr_from_lens,
    kv_lens_of,
    make_ragged_batch,
    rel_error,
)

DEFAULT = PRESETS["default"]


@dataclass(frozen=True)
class Sizes:
    """One benchmark scale: model shape, prefill batches (q_lens, kv_lens), decode batches."""

    num_kv_heads: int
    group: int
    head_dim: int
    dtype: torch.dtype
    prefill: tuple[tuple[str, tuple[int, ...], tuple[int, ...]], ...]
    decode: tuple[tuple[str, int, int], ...]  # (name, batch, kept length)
    window: int


# A Llama-3-8B-like layer: 8 KV heads, GQA 4, head dim 128, bf16.
GPU_SIZES = Sizes(
    8,
    4,
    128,
    torch.bfloat16,
    prefill=(
        ("1x5000", (5000,), (5000,)),
        ("4x5000", (5000,) * 4, (5000,) * 4),
        ("4x(4000 cached + 1000 new)", (1000,) * 4, (5000,) * 4),
    ),
    decode=(("64 x 1536 kept", 64, 1536), ("64 x 4096", 64, 4096), ("8 x 16384", 8, 16384)),
    window=DEFAULT.window,
)
SMALL_SIZES = Sizes(
    2,
    4,
    64,
    torch.float16,
    prefill=(("2 requests", (100, 37), (100, 90)),),
    decode=(("3 x ~64", 3, 64),),
    window=16,
)
# Bounds on normwise relative error vs the torch reference (bf16/fp16 P@V rounding dominates).
OUT_REL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-4}
STAT_REL = 1e-4


def load_sglang() -> tuple[object | None, object | None, str]:
    """SGLang's Triton extend and decode entry points, or the reason they are unavailable."""
    try:
        from sglang.kernels.ops.attention.decode_attention import decode_attention_fwd
        from sglang.kernels.ops.attention.extend_attention import extend_attention_fwd
    except Exception as exc:  # any import failure just removes the comparison
        return None, None, f"unavailable: {type(exc).__name__}: {exc}"
    return extend_attention_fwd, decode_attention_fwd, "ok"


def sglang_extend_call(extend_fwd, batch: RaggedBatch, with_lse: bool) -> Callable[[], tuple]:
    """SGLang's form: cached prefix through indices, new tokens' K/V as separate tensors."""
    prefix, new = [], []
    for b, (q_len, kv_len) in enumerate(zip(batch.q_lens, batch.kv_lens)):
        slots = batch.kv_indices[batch.kv_indptr[b] : batch.kv_indptr[b + 1]]
        prefix.append(slots[: kv_len - q_len])
        new.append(slots[kv_len - q_len :])
    new_slots = torch.cat(new)
    k_new, v_new = batch.k_buf[new_slots], batch.v_buf[new_slots]
    prefix_indptr = indptr_from_lens([k - q for q, k in zip(batch.q_lens, batch.kv_lens)], batch.q.device)
    prefix_indices = torch.cat(prefix)
    o = torch.empty_like(batch.q)
    lse = torch.empty(batch.q.shape[:2], dtype=torch.float32, device=batch.q.device) if with_lse else None
    max_q = max(batch.q_lens)

    def run() -> tuple:
        extend_fwd(
            batch.q,
            k_new,
            v_new,
            o,
            batch.k_buf,
            batch.v_buf,
            batch.qo_indptr,
            prefix_indptr,
            prefix_indices,
            None,
            True,
            None,
            max_q,
            1.0,
            1.0,
            sm_scale=batch.sm_scale,
            lse_extend=lse,
        )
        return o, lse

    return run


def sglang_decode_call(decode_fwd, batch: RaggedBatch, q: torch.Tensor, splits: int) -> Callable[[], torch.Tensor]:
    """SGLang's split-K decode at the same kept length and split count as ours."""
    bsz, heads, dim = q.shape
    o = torch.empty_like(q)
    logits = torch.empty((bsz, heads, splits, dim), dtype=torch.float32, device=q.device)
    lse = torch.empty((bsz, heads, splits), dtype=torch.float32, device=q.device)
    num_splits = torch.full((bsz,), splits, dtype=torch.int32, device=q.device)

    def run() -> torch.Tensor:
        decode_fwd(
            q,
            batch.k_buf,
            batch.v_buf,
            o,
            batch.kv_indptr,
            batch.kv_indices,
            logits,
            lse,
            num_splits,
            splits,
            batch.sm_scale,
            1.0,
            1.0,
        )
        return o

    return run


def flashinfer_calls(batch: RaggedBatch, q_decode: torch.Tensor | None) -> tuple[Callable | None, str]:
    """FlashInfer's paged (page size 1) prefill or decode over the same pool, if importable."""
    try:
        import flashinfer

        workspace = torch.empty(256 << 20, dtype=torch.uint8, device=batch.q.device)
        paged = (batch.k_buf.unsqueeze(1), batch.v_buf.unsqueeze(1))  # [pages, 1, H_kv, D]
        kv_indptr = batch.kv_indptr.int()
        indices = batch.kv_indices.int()
        last = torch.ones(len(batch.kv_lens), dtype=torch.int32, device=batch.q.device)
        heads_q, heads_kv, dim = batch.q.shape[1], batch.k_buf.shape[1], batch.q.shape[2]
        if q_decode is None:
            wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
            wrapper.plan(
                batch.qo_indptr.int(),
                kv_indptr,
                indices,
                last,
                heads_q,
                heads_kv,
                dim,
                1,
                causal=True,
                q_data_type=batch.q.dtype,
                kv_data_type=batch.k_buf.dtype,
            )
            return (lambda: wrapper.run(batch.q, paged, return_lse=True)), "ok"
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        wrapper.plan(
            kv_indptr,
            indices,
            last,
            heads_q,
            heads_kv,
            dim,
            1,
            q_data_type=q_decode.dtype,
            kv_data_type=batch.k_buf.dtype,
        )
        return (lambda: wrapper.run(q_decode, paged)), "ok"
    except Exception as exc:  # FlashInfer is optional: record why it is missing
        return None, f"unavailable: {type(exc).__name__}: {str(exc)[:200]}"


def ours_extend(batch: RaggedBatch, with_stats: bool) -> Callable[[], tuple]:
    o = torch.empty_like(batch.q)
    lse = torch.empty(batch.q.shape[:2], dtype=torch.float32, device=batch.q.device)
    max_q = max(batch.q_lens)
    return lambda: extend_attention_with_stats(
        batch.q,
        batch.k_buf,
        batch.v_buf,
        batch.qo_indptr,
        batch.kv_indptr,
        batch.kv_indices,
        batch.sm_scale,
        with_stats=with_stats,
        max_q_len=max_q,
        out=o,
        lse_out=lse,
        backend="triton",
    )


def bench_prefill(sizes: Sizes, device: str, reps: int, sglang_extend, report: dict) -> None:
    cuda = device == "cuda"
    for name, q_lens, kv_lens in sizes.prefill:
        batch = make_ragged_batch(
            q_lens,
            kv_lens,
            sizes.num_kv_heads,
            sizes.group,
            sizes.head_dim,
            sizes.dtype,
            device,
            seed=len(report["checks"]),
        )
        args = (batch.q, batch.k_buf, batch.v_buf, batch.qo_indptr, batch.kv_indptr, batch.kv_indices, batch.sm_scale)
        o, lse = ours_extend(batch, True)()
        o_ref, lse_ref = extend_attention_with_stats(*args, backend="torch")
        check(report, f"prefill {name}: output vs torch", rel_error(o, o_ref), OUT_REL[sizes.dtype])
        check(report, f"prefill {name}: LSE vs torch", rel_error(lse, lse_ref), STAT_REL)
        win_args = (
            batch.q,
            batch.k_buf,
            lse,
            batch.qo_indptr,
            batch.kv_indptr,
            batch.kv_indices,
            sizes.window,
            batch.sm_scale,
        )
        max_kv = max(kv_lens)
        scores = window_scores(*win_args, max_kv_len=max_kv, backend="triton")
        scores_ref = window_scores(*win_args, backend="torch")
        check(report, f"window scores {name}: vs torch", rel_error(scores, scores_ref), STAT_REL)

        row = {"case": name, "q_tokens": sum(q_lens), "kv_tokens": sum(kv_lens)}
        row["ours_no_stats_ms"] = timer(ours_extend(batch, False), reps, cuda)
        row["ours_with_stats_ms"] = timer(ours_extend(batch, True), reps, cuda)
        row["stats_overhead_pct"] = 100 * (row["ours_with_stats_ms"] / row["ours_no_stats_ms"] - 1)
        row["window_scores_ms"] = timer(
            lambda: window_scores(*win_args, max_kv_len=max_kv, out=scores, backend="triton"), reps, cuda
        )
        row["scores_vs_prefill_pct"] = 100 * row["window_scores_ms"] / row["ours_with_stats_ms"]
        if sglang_extend is not None:
            so, slse = sglang_extend_call(sglang_extend, batch, True)()
            check(report, f"prefill {name}: output vs SGLang", rel_error(o, so), OUT_REL[sizes.dtype])
            check(report, f"prefill {name}: LSE vs SGLang", rel_error(lse, slse), STAT_REL)
            row["sglang_no_lse_ms"] = timer(sglang_extend_call(sglang_extend, batch, False), reps, cuda)
            row["sglang_with_lse_ms"] = timer(sglang_extend_call(sglang_extend, batch, True), reps, cuda)
        fi_run, fi_status = flashinfer_calls(batch, None) if cuda else (None, "needs CUDA")
        row["flashinfer"] = fi_status
        if fi_run is not None:
            row["flashinfer_with_lse_ms"] = timer(fi_run, reps, cuda)
        report["prefill"].append(row)


def bench_decode(sizes: Sizes, device: str, reps: int, sglang_decode, report: dict) -> None:
    cuda = device == "cuda"
    for name, bsz, kept in sizes.decode:
        kv_lens = [kept - 7 * (b % 3) for b in range(bsz)]  # ragged around the kept length
        batch = make_ragged_batch(
            [0] * bsz, kv_lens, sizes.num_kv_heads, sizes.group, sizes.head_dim, sizes.dtype, device, seed=bsz
        )
        q = decode_queries(batch)
        args = (q, batch.k_buf, batch.v_buf, kv_lens_of(batch), as_table(batch, extra=0))
        splits = decode_splits(bsz, sizes.num_kv_heads, args[-1].shape[1], processor_count(torch.device(device)))
        scores, scores_ref = (torch.zeros(batch.k_buf.shape[:2], device=device) for _ in range(2))
        o = decode_attention_with_scores(*args, scores, batch.sm_scale, num_kv_splits=splits, backend="triton")
        o_ref = decode_attention_with_scores(*args, scores_ref, batch.sm_scale, backend="torch")
        check(report, f"decode {name}: output vs torch", rel_error(o, o_ref), OUT_REL[sizes.dtype])
        check(report, f"decode {name}: scores vs torch", rel_error(scores, scores_ref), STAT_REL)
        out = torch.empty_like(q)
        row = {"case": name, "batch": bsz, "kept_len": kept, "num_kv_splits": splits}
        row["ours_with_scores_ms"] = timer(
            lambda: decode_attention_with_scores(
                *args, scores, batch.sm_scale, num_kv_splits=splits, out=out, backend="triton"
            ),
            reps,
            cuda,
        )
        # The same step over an FP8 cache (e4m3, scales 0.5 / 2): half the K/V bytes read.
        k8, v8 = quantize(batch.k_buf, torch.float8_e4m3fn, 0.5), quantize(batch.v_buf, torch.float8_e4m3fn, 2.0)
        args8 = (q, k8, v8, kv_lens_of(batch), as_table(batch, extra=0))
        scales = {"k_scale": 0.5, "v_scale": 2.0}
        s8, s8_ref = (torch.zeros(batch.k_buf.shape[:2], device=device) for _ in range(2))
        o8 = decode_attention_with_scores(*args8, s8, batch.sm_scale, num_kv_splits=splits, backend="triton", **scales)
        o8_ref = decode_attention_with_scores(*args8, s8_ref, batch.sm_scale, backend="torch", **scales)
        check(report, f"decode {name} FP8: output vs torch", rel_error(o8, o8_ref), OUT_REL[sizes.dtype])
        check(report, f"decode {name} FP8: scores vs torch", rel_error(s8, s8_ref), STAT_REL)
        row["ours_fp8_ms"] = timer(
            lambda: decode_attention_with_scores(
                *args8, s8, batch.sm_scale, num_kv_splits=splits, out=out, backend="triton", **scales
            ),
            reps,
            cuda,
        )
        row["fp8_vs_model_dtype"] = row["ours_fp8_ms"] / row["ours_with_scores_ms"]
        if sglang_decode is not None:
            run = sglang_decode_call(sglang_decode, batch, q, splits)
            check(report, f"decode {name}: output vs SGLang", rel_error(o, run()), OUT_REL[sizes.dtype])
            row["sglang_ms"] = timer(run, reps, cuda)
            row["ours_vs_sglang"] = row["ours_with_scores_ms"] / row["sglang_ms"]
        fi_run, fi_status = flashinfer_calls(batch, q) if cuda else (None, "needs CUDA")
        row["flashinfer"] = fi_status
        if fi_run is not None:
            row["flashinfer_ms"] = timer(fi_run, reps, cuda)
        report["decode"].append(row)

        # A decode eviction of every request at once: rows of budget + evict_page entries (the
        # default's, or what the shortest request holds) cut back to the budget, in place.
        n = min(kv_lens + [DEFAULT.budget + DEFAULT.evict_page])
        budget = n - min(DEFAULT.evict_page, n // 2)
        sink, window = min(DEFAULT.sink, budget // 4), min(DEFAULT.window, budget // 4)
        starts = batch.kv_indptr[:-1].long()
        slots = batch.kv_indices[starts[:, None] + torch.arange(n, device=device)][None]  # [1, B, n]
        gen = torch.Generator().manual_seed(0)
        ranked = torch.rand(bsz, n, sizes.num_kv_heads, generator=gen).to(device)
        args = (ranked, slots, slots, budget, sink, window)
        bufs = (batch.k_buf.clone(), batch.v_buf.clone(), scores.clone())
        ref = tuple(t.clone() for t in bufs)
        evict_rows(*bufs, *args, backend="triton")
        evict_rows(*ref, *args, backend="torch")
        check(report, f"evict {name}: bit-exact vs torch", float(not all(map(torch.equal, bufs, ref))), 0.0)
        report["evict"].append(
            {
                "case": name,
                "rows": bsz,
                "entries": n,
                "budget": budget,
                "ours_ms": timer(lambda: evict_rows(*bufs, *args, backend="triton"), reps, cuda),
                "torch_ms": timer(lambda: evict_rows(*bufs, *args, backend="torch"), reps, cuda),
            }
        )


def check(report: dict, name: str, error: float, bound: float) -> None:
    report["checks"].append({"check": name, "rel_error": error, "bound": bound, "ok": error <= bound})
    print(f"{'ok  ' if error <= bound else 'FAIL'} {name}: {error:.2e} (bound {bound:.0e})")


def markdown(report: dict) -> str:
    lines = [
        f"# Kernel benchmark: {report['gpu']}",
        provenance_line(report),
        "",
        f"- date: {report['date']}",
        f"- torch {report['torch']}, triton {report['triton']}, SGLang kernels: {report['sglang']}",
        f"- timings meaningful: {report['timings_meaningful']}",
        "",
    ]
    failed = [c["check"] for c in report["checks"] if not c["ok"]]
    lines += [
        f"Correctness: {len(report['checks']) - len(failed)}/{len(report['checks'])} checks passed"
        + (f"; FAILED: {', '.join(failed)}" if failed else ""),
        "",
    ]
    for section in ("prefill", "decode", "evict"):
        rows = report[section]
        if not rows:
            continue
        keys = list(dict.fromkeys(k for r in rows for k in r))
        lines += [f"## {section}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in rows:
            cells = [f"{r[k]:.4g}" if isinstance(r.get(k), float) else str(r.get(k, "")) for k in keys]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    lines += ["Targets: stats_overhead_pct < 3; scores_vs_prefill_pct < 5 (1x5000, alpha=64).", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="small sizes (default without CUDA)")
    parser.add_argument("--dry-run", action="store_true", help="small sizes, one timing rep")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    small = args.small or args.dry_run or not cuda
    reps = 1 if args.dry_run else (args.reps if cuda else min(args.reps, 3))
    device = "cuda" if cuda else "cpu"
    gpu = torch.cuda.get_device_name() if cuda else "cpu-interpreter"
    if not cuda:
        print("No CUDA: running small checks under the Triton interpreter; timings here mean nothing.")
        # SGLang's kernels compute log(0) / inf - inf on padding rows they never store.
        warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton.runtime.interpreter")
    sglang_extend, sglang_decode, sglang_status = load_sglang()
    now = dt.datetime.now()
    report = {
        "gpu": gpu,
        "date": now.isoformat(timespec="seconds"),
        "host": platform.node(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "sglang": sglang_status,
        "sizes": "small" if small else "full",
        "reps": reps,
        "timings_meaningful": cuda,
        "checks": [],
        "prefill": [],
        "decode": [],
        "evict": [],
    }
    sizes = SMALL_SIZES if small else GPU_SIZES
    report["shape"] = {
        "num_kv_heads": sizes.num_kv_heads,
        "group": sizes.group,
        "head_dim": sizes.head_dim,
        "dtype": str(sizes.dtype),
        "window": sizes.window,
    }
    bench_prefill(sizes, device, reps, sglang_extend, report)
    bench_decode(sizes, device, reps, sglang_decode, report)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"kernels-{now:%Y%m%d-%H%M%S}-{re.sub(r'[^A-Za-z0-9]+', '-', gpu).strip('-')}"
    write_json(ReportPaths(args.out_dir, stem), report)
    (args.out_dir / f"{stem}.md").write_text(markdown(report))
    print(markdown(report))
    print(f"wrote {args.out_dir / stem}.json and .md")
    return 0 if all(c["ok"] for c in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
