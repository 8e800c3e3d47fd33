"""Run SGLang's own benchmark client (``python -m sglang.benchmark.serving``) against a server.

Using SGLang's client (not our own) is the point: its numbers are the ones SGLang users quote,
and it treats stock SGLang and the project identically.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests


class ClientError(RuntimeError):
    """The benchmark client failed or wrote no result."""


@dataclass(frozen=True)
class SharedPrefix:
    """Prompts in groups that share a system prompt (SGLang's ``generated-shared-prefix``
    dataset): the workload's ``input_len`` is the shared part, and each prompt adds a question of
    its own. Requests are shuffled, so a group's first request misses the radix cache and the
    others can hit it."""

    groups: int
    prompts_per_group: int
    question_len: int

    @property
    def num_prompts(self) -> int:
        return self.groups * self.prompts_per_group


@dataclass(frozen=True)
class Workload:
    """One client run at one max concurrency: fixed-length random token-id prompts, unrelated to
    each other or (``shared_prefix``) in groups sharing a system prompt."""

    input_len: int
    output_len: int
    num_prompts: int
    max_concurrency: int
    seed: int
    shared_prefix: SharedPrefix | None = None
    #: Empty the radix cache after the warm-up request (off when clients share a server at once).
    flush_cache: bool = True
    #: Lengths drawn uniformly from [range_ratio x length, length] (random-ids only).
    range_ratio: float = 1.0
    #: Requests the client sends before measuring (none where only counts matter, not speed).
    warmup_requests: int = 1

    def client_args(self) -> list[str]:
        """Arguments for ``sglang.benchmark.serving``.

        ``--tokenize-prompt`` sends token ids, so every prompt is exactly as long as asked (text
        prompts are re-tokenised by the server and grow by ~5 %). ``--flush-cache`` empties the
        radix cache after the client's warm-up request, so the same prompts (same seed) at the
        next concurrency, or on the next system, are computed again rather than served from cache.
        """
        common = [
            "--backend",
            "sglang",
            "--tokenize-prompt",
            "--num-prompts",
            str(self.num_prompts),
            "--max-concurrency",
            str(self.max_concurrency),
            "--seed",
            str(self.seed),
            "--warmup-requests",
            str(self.warmup_requests),
        ]
        if self.flush_cache:
            common.append("--flush-cache")
        prefix = self.shared_prefix
        if prefix is None:
            return [
                *common,
                "--dataset-name",
                "random-ids",
                "--random-input-len",
                str(self.input_len),
                "--random-output-len",
                str(self.output_len),
                "--random-range-ratio",
                str(self.range_ratio),
            ]
        return [
            *common,
            "--dataset-name",
            "generated-shared-prefix",
            "--gsp-num-groups",
            str(prefix.groups),
            "--gsp-prompts-per-group",
            str(prefix.prompts_per_group),
            "--gsp-system-prompt-len",
            str(self.input_len),
            "--gsp-question-len",
            str(prefix.question_len),
            "--gsp-output-len",
            str(self.output_len),
            "--gsp-range-ratio",
            "1.0",
        ]


def run_client(
    base_url: str, workload: Workload, result_file: Path, log_path: Path, timeout_s: float
) -> dict[str, Any]:
    """Run the client once, echo its output (progress bar included), return its JSON result.

    The client appends one JSON line per run to ``result_file``; we return the line it added.
    """
    before = _count_lines(result_file)
    command = [
        sys.executable,
        "-m",
        "sglang.benchmark.serving",
        "--base-url",
        base_url,
        *workload.client_args(),
        "--output-file",
        str(result_file),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        timed_out = threading.Event()

        def kill_on_timeout() -> None:
            timed_out.set()
            proc.kill()

        timer = threading.Timer(timeout_s, kill_on_timeout)
        timer.start()
        try:
            while chunk := proc.stdout.read1(4096):
                log.write(chunk)
                sys.stdout.buffer.write(chunk)
                sys.stdout.buffer.flush()
            proc.wait()
        finally:
            timer.cancel()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if timed_out.is_set():
        raise ClientError(f"benchmark client killed after {timeout_s:.0f} s (log: {log_path})")
    if proc.returncode != 0:
        raise ClientError(f"benchmark client exited with {proc.returncode} (log: {log_path})")
    lines = result_file.read_text().splitlines() if result_file.is_file() else []
    if len(lines) <= before:
        raise ClientError(f"benchmark client wrote no result (log: {log_path})")
    return json.loads(lines[-1])


def _count_lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


#: Longest a `/kvsparse/stats` probe waits: longer than any forward of a CPU run.
PROBE_TIMEOUT_S = 900.0


class KvStatsPoller:
    """Samples ``GET /kvsparse/stats`` during a run, for the KV bytes each request really holds.

    The project's server answers it with ``kv_bytes_in_use``, ``requests_running`` and per-layer
    ``slots_in_use``. A server that does not (stock SGLang) answers 404 at the first probe; the
    poller then stops and :attr:`available` stays False, so the report falls back to the dense
    figure and says so.

    One probe is in flight at a time, and it waits as long as a forward may take
    (`PROBE_TIMEOUT_S`): the scheduler answers between forwards, and SGLang's HTTP server queues
    the queries behind one another, so a probe given up on still waits there and every later probe
    would queue behind it, never answered while long forwards run. A probe that still times out is
    skipped, not taken for a missing endpoint.
    """

    def __init__(self, base_url: str, interval_s: float = 1.0) -> None:
        self._url = f"{base_url}/kvsparse/stats"
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self.available = False
        self.max_bytes_per_request: float | None = None
        self.layer_slots_per_request: dict[str, float] = {}  # layer kind -> mean slots, at that max

    def __enter__(self) -> KvStatsPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def bytes_per_request(self, dense_bytes: float) -> tuple[float, str]:
        """The measured KV bytes per request when the server reported them, else ``dense_bytes``;
        with the source, in words, for the report."""
        if self.available and self.max_bytes_per_request is not None:
            return self.max_bytes_per_request, "measured: /kvsparse/stats"
        return dense_bytes, "dense: (in+out) × bytes/token"

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._sample():
                return
            self._stop.wait(self._interval_s)

    def _sample(self) -> bool:
        """Take one sample; False when the server has no usable stats endpoint."""
        try:
            response = requests.get(self._url, timeout=PROBE_TIMEOUT_S)
        except requests.Timeout:
            return True
        except requests.RequestException:
            return False
        if response.status_code != 200:
            return False
        stats = response.json()
        if "kv_bytes_in_use" not in stats or "requests_running" not in stats:
            return False
        self.available = True
        running = stats["requests_running"]
        if running > 0:
            per_request = stats["kv_bytes_in_use"] / running
            if self.max_bytes_per_request is None or per_request > self.max_bytes_per_request:
                self.max_bytes_per_request = per_request
                self.layer_slots_per_request = _mean_slots_by_kind(stats["layers"], running)
        return True


def _mean_slots_by_kind(layers: list[dict], running: int) -> dict[str, float]:
    """Mean slots in use per running request, over the layers of each kind (full, sparse)."""
    by_kind: dict[str, list[float]] = {}
    for layer in layers:
        by_kind.setdefault(layer["kind"], []).append(layer["slots_in_use"] / running)
    return {kind: sum(values) / len(values) for kind, values in by_kind.items()}
