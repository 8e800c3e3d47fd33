"""The end-to-end tests' servers: the testbed's process manager (`kvsparse_testbed.server`, the
benchmarks' too) with the requests the tests send.

Each server runs in its own process group, and stopping it reaches every process SGLang spawned
(an orphaned scheduler keeps a core busy).
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from kvsparse_testbed.server import ServerProcess, free_port

from .prompts import long_prompt

PYTHON = sys.executable

#: SGLang's admission made optimistic: running requests are charged a twentieth of the output
#: they have left, so a small KV pool admits more than fits and SGLang retracts mid-decode.
RETRACTING_ENV = {"SGLANG_INIT_NEW_TOKEN_RATIO": "0.05"}


def server_env() -> dict[str, str]:
    """The user's environment, without the test-only Triton interpreter switch."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env.pop("SGLANG_KVSPARSE_CONFIG", None)
    return env


class Server(ServerProcess):
    """One SGLang HTTP server process (project launcher or stock), launched at construction;
    `wait_ready` blocks until it serves."""

    def __init__(self, name: str, argv: list[str], log_dir: Path, env: dict[str, str]):
        port = free_port()
        super().__init__(
            name=name,
            command=[*argv, "--port", str(port)],
            env=env,
            port=port,
            log_path=log_dir / f"{name}.log",
            startup_timeout_s=420,
            progress=lambda _: None,
        )
        self.launch()

    @property
    def url(self) -> str:
        return self.base_url

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

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

    def generate(self, text: str, max_new_tokens: int, top_logprobs: int = 0, **sampling) -> dict:
        """Greedy `/generate`; with `top_logprobs`, each output token's log-probability and each
        step's best `top_logprobs` in `meta_info`."""
        payload = {
            "text": text,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling},
        }
        if top_logprobs:
            payload |= {"return_logprob": True, "top_logprobs_num": top_logprobs}
        response = requests.post(f"{self.url}/generate", json=payload, timeout=600)
        response.raise_for_status()
        return response.json()


def every_rank(stats: dict) -> list[dict]:
    """Each scheduler process's own stats: every TP rank of every DP replica."""
    return [rank for replica in stats["replicas"] for rank in replica["tp_ranks"]]


def assert_every_slot_back(stats: dict) -> None:
    """On every rank, no request holds a heap row: every row is free or cached (SGLang's radix
    tree, the prefix store), both of which give rows back on demand. And nothing the sparse path
    did made the host wait for the device: no request indices read back, no decode step refilling the
    host free list from SGLang's device one, no allocation waiting for freed ids (`stats.py`)."""
    assert stats["requests_running"] == 0
    for rank in every_rank(stats):
        heap = rank["heap"]
        assert (heap["full_running"], heap["sparse"], heap["evicting"], heap["releasing"]) == (0, 0, 0, 0), heap
        assert heap["free"] + heap["full_cached"] + heap["prefix_store"] == heap["rows_total"], heap
        assert all(row["slots_in_use"] == 0 for row in rank["layers"])
        waits = {name: rank[name] for name in ("host_syncs", "decode_refills", "release_waits")}
        assert waits == {"host_syncs": 0, "decode_refills": 0, "release_waits": 0}, waits


def assert_at_rest(server: Server) -> dict:
    """Once idle, every slot is back on every rank (`assert_every_slot_back`); after a cache flush
    the radix tree and the prefix store give their rows back too. Returns the idle stats."""
    stats = server.idle_stats()
    assert_every_slot_back(stats)
    server.flush_cache()
    for rank in every_rank(server.stats()):
        assert rank["heap"]["free"] == rank["heap"]["rows_total"], rank["heap"]
    return stats


def assert_prefix_hits_equal_stock(sparse: Server, stock: Server, max_new_tokens: int, **sampling) -> None:
    """Three prompts sharing a cached ~1,600-token prefix, one at a time: the sparse server reuses
    as much of it as stock (nothing selects by score there: the whole match) and answers as stock
    does, token for token; each is counted as a prefix hit. `sampling`: more sampling parameters
    of the sparse server's requests (a request's own sparsity setting)."""
    prefix = long_prompt(7000)
    prompts = [prefix + suffix for suffix in ("\nIn one sentence:", "\nThe main idea is", "\nA title for it:")]
    for server in (sparse, stock):
        server.flush_cache()
    sparse.generate(prefix, 1, **sampling)
    stock.generate(prefix, 1)
    hits_before = sparse.stats()["prefix_hits"]
    ours = [sparse.generate(prompt, max_new_tokens, **sampling) for prompt in prompts]
    theirs = [stock.generate(prompt, max_new_tokens) for prompt in prompts]
    for mine, stock_out in zip(ours, theirs):
        assert mine["meta_info"]["cached_tokens"] == stock_out["meta_info"]["cached_tokens"] > 1000
        assert mine["output_ids"] == stock_out["output_ids"]
    assert sparse.stats()["prefix_hits"] - hits_before == len(prompts)
