"""Kernel timing shared by the kernel benchmarks: the median of repeated runs after warm-up."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def timer(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after two warm-ups (CUDA events on GPU)."""
    for _ in range(2):
        fn()
    samples = []
    for _ in range(reps):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)
