"""Why the sparse layers serve tensor and data parallelism, and the CPU cores each rank gets (no
SGLang imports).

Tensor parallelism (`--tp-size`): each rank's heap, tables and prefix store hold its own KV heads
(SGLang's pool on that rank has only those heads), and every decision (admission, allocation,
eviction counts, store reuse) is taken from what every rank sees alike: SGLang's scheduler, which
runs replicated on every rank, and the sparse state's host tables, which change only through it.
Scores differ by rank, but they choose *which* entries a head keeps, never how many.
Data parallelism (`--dp-size`, or replicas behind SGLang's router): each replica is a whole
sparse server of its own. Pipeline parallelism, DP attention and context parallelism are refused
(`option_support.REFUSED` says why).
"""

from __future__ import annotations

import os

#: SGLang's variable giving each rank's CPU cores on the CPU engine ("0-3|4-7").
THREADS_BIND_ENV = "SGLANG_CPU_OMP_THREADS_BIND"


def cpu_thread_binding(ranks: int, cores: list[int]) -> str:
    """SGLang's `SGLANG_CPU_OMP_THREADS_BIND` giving each of `ranks` processes an equal, disjoint
    share of `cores` ("0|1" for two ranks on two cores); SGLang asks for it on the CPU when there
    are more ranks than NUMA nodes."""
    if ranks < 1:
        raise ValueError(f"need at least one rank, got {ranks}")
    if len(cores) < ranks:
        raise ValueError(f"{ranks} ranks need at least {ranks} CPU cores, this process may use {len(cores)}")
    share = len(cores) // ranks
    groups = [sorted(cores)[i * share : (i + 1) * share] for i in range(ranks)]
    return "|".join(",".join(str(core) for core in group) for group in groups)


def binding_for_this_process(ranks: int) -> str:
    """`cpu_thread_binding` over the cores this process may use."""
    return cpu_thread_binding(ranks, sorted(os.sched_getaffinity(0)))
