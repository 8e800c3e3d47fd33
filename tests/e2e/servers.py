"""Start and stop SGLang servers for the end-to-end tests.

Each server runs in its own process group so that stopping it also stops the scheduler and
detokenizer processes SGLang spawns (an orphaned scheduler keeps a core busy).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

PYTHON = sys.executable


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env() -> dict[str, str]:
    """The user's environment, without the test-only Triton interpreter switch."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("SGLANG_KVSPARSE_CONFIG", None)
    return env


class Server:
    """One SGLang HTTP server process (project launcher or stock)."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str]):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [*argv, "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 420) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited early; log:\n{self.log()[-4000:]}")
            try:
                if requests.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        raise TimeoutError(f"{self.name} not healthy after {timeout_s}s; log:\n{self.log()[-4000:]}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        # Children that outlived the leader are still in its process group.
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._log.close()

    def stats(self) -> dict:
        """The project's `GET /kvsparse/stats`."""
        response = requests.get(f"{self.url}/kvsparse/stats", timeout=120)
        response.raise_for_status()
        return response.json()

    def abort_mid_stream(self, text: str, chunks: int) -> dict:
        """Stream a long generation, disconnect after `chunks` chunks (which aborts the request),
        and return the stats taken just before disconnecting."""
        payload = {
            "text": text,
            "sampling_params": {"max_new_tokens": 2000, "temperature": 0, "ignore_eos": True},
            "stream": True,
        }
        with requests.post(f"{self.url}/generate", json=payload, stream=True, timeout=600) as response:
            lines = (line for line in response.iter_lines() if line)
            for _ in range(chunks):
                next(lines)
            return self.stats()

    def flush_cache(self) -> None:
        """Empty SGLang's radix cache (and with it the project's prefix store)."""
        requests.post(f"{self.url}/flush_cache", timeout=120).raise_for_status()

    def idle_stats(self, timeout_s: float = 120) -> dict:
        """The stats once no request runs (or after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while (stats := self.stats())["requests_running"] and time.monotonic() < deadline:
            time.sleep(1)
        return stats

    def generate_all(self, texts: list[str], max_new_tokens: int) -> list[dict]:
        """Greedy generations sent concurrently, as a production server sees them (batched
        prefills and decodes of unequal rows); results in the order of `texts`."""
        with ThreadPoolExecutor(len(texts)) as pool:
            return list(pool.map(lambda text: self.generate(text, max_new_tokens), texts))

    def generate(self, text: str, max_new_tokens: int, **sampling) -> dict:
        payload = {
            "text": text,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling},
        }
        response = requests.post(f"{self.url}/generate", json=payload, timeout=600)
        response.raise_for_status()
        return response.json()


def assert_every_slot_back(stats: dict) -> None:
    """No request holds a heap row: every row is free or cached (SGLang's radix tree, the prefix
    store), both of which give rows back on demand."""
    assert stats["requests_running"] == 0
    heap = stats["heap"]
    assert (heap["full_running"], heap["sparse"], heap["evicting"]) == (0, 0, 0), heap
    assert heap["free"] + heap["full_cached"] + heap["prefix_store"] == heap["rows_total"], heap
    assert all(row["slots_in_use"] == 0 for row in stats["layers"])
