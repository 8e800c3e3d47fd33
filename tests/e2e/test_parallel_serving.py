"""Sparse layers past one device: `--tp-size 2`, `--dp-size 2`, and two servers behind SGLang's
router (`sglang-router`). In the second end-to-end run, after the shared servers of tests/e2e
have stopped: three more servers of two processes each would not fit beside them in memory.

The tensor-parallel servers serve a dummy-weight Llama (`TP_MODEL`: 4 layers, 2 KV heads, so
each rank holds one; float32, deterministic) with SGLang's all-reduce over gloo on the CPU
(`sglang_kvsparse.server.cpu_shims`). Project and stock run with the same `--tp-size 2`, each rank on
one core. The project keeps layer 0 full and 64 entries in the others (evicting above 80), in a
KV pool small enough that concurrent requests force SGLang to retract (`RETRACTING_ENV`).

Every sparse decision (admission, allocation, how many entries each request keeps, store reuse)
must come out the same on both ranks: `/kvsparse/stats` gathers the ranks' stats and reports
whether their counts agree (`in_step`), and every check below is made on every rank.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from kvsparse_testbed.dummy_models import SHAPES, write_dummy_model
from sglang_kvsparse.server.options import CPU_SPARSE_MEM_FRACTION

from .servers import PYTHON, RETRACTING_ENV, Server, assert_at_rest, every_rank, server_env

pytestmark = [pytest.mark.e2e, pytest.mark.extended]

TP_MODEL = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    **SHAPES["dry-run"],
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 500000.0,
    "hidden_act": "silu",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "float32",
}
BUDGET = 64
SPARSITY = ["--kvsparse-full-layers", "0", "--kvsparse-budget", str(BUDGET)]
#: 1,200 dense tokens: a heap of 4,800 rows of one lane, in which a request of 100 + 250 tokens
#: holds ~600 at its end (every token in the full layer, 80 entries and a score row in each of 3
#: sparse columns).
COMMON = ["--load-format", "dummy", "--dtype", "float32", "--max-total-tokens", "1200"]
#: One torch thread per rank: two ranks on two cores, neither oversubscribed. (The launcher gives
#: each rank its cores, `SGLANG_CPU_OMP_THREADS_BIND`; stock is given them here.)
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, TP_MODEL["vocab_size"]) for _ in range(length)]


def generate_ids(server: Server, ids: list[int], max_new_tokens: int, **sampling) -> dict:
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling}}
    response = requests.post(f"{server.url}/generate", json=payload, timeout=600)
    response.raise_for_status()
    return response.json()


@pytest.fixture(scope="module")
def tp_model(tmp_path_factory) -> Path:
    return write_dummy_model(tmp_path_factory.mktemp("models") / "llama-tp", TP_MODEL)


@pytest.fixture(scope="module")
def parallel_servers(tp_model, tmp_path_factory):
    """The project at `--tp-size 2`, stock at `--tp-size 2`, the project at `--dp-size 2`."""
    log_dir = tmp_path_factory.mktemp("parallel-server-logs")
    model = ["--model-path", str(tp_model)]
    stock_args = ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
    project = [PYTHON, "-m", "sglang_kvsparse.launch_server", *model, *COMMON, *SPARSITY]
    stock = [PYTHON, "-m", "sglang.launch_server", *model, *COMMON, *stock_args]
    stock += ["--mem-fraction-static", str(CPU_SPARSE_MEM_FRACTION), "--tp-size", "2"]
    stock_env = {**server_env(), **ONE_THREAD, "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    started = {
        "tp-project": Server(
            "tp-project",
            [*project, "--tp-size", "2", "--enable-metrics"],
            log_dir,
            {**server_env(), **ONE_THREAD, **RETRACTING_ENV},
        ),
        "tp-stock": Server("tp-stock", stock, log_dir, stock_env),
        "dp-project": Server("dp-project", [*project, "--dp-size", "2"], log_dir, {**server_env(), **ONE_THREAD}),
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        with ThreadPoolExecutor(len(started)) as pool:
            list(pool.map(lambda server: server.stop(), started.values()))


def test_tp2_within_the_budget_gives_stock_tp2_outputs(parallel_servers):
    """Prompt + output within the budget: nothing evicts, so the output ids are stock's at the
    same `--tp-size` (batched: sent concurrently)."""
    project, stock = parallel_servers["tp-project"], parallel_servers["tp-stock"]
    prompts = [token_prompt(length, seed) for seed, length in enumerate((8, 17, 26, 33, 40))]
    with ThreadPoolExecutor(len(prompts)) as pool:
        ours = list(pool.map(lambda ids: generate_ids(project, ids, 24), prompts))
    for ids, mine in zip(prompts, ours):
        assert len(ids) + 24 <= BUDGET
        assert mine["output_ids"] == generate_ids(stock, ids, 24)["output_ids"], len(ids)
    stats = project.stats()
    assert stats["tp_size"] == 2 and stats["in_step"], stats["differences"]


def test_tp2_evicts_on_both_ranks_in_step_and_every_slot_comes_back(parallel_servers):
    """Twelve requests of 100 + 250 tokens evict in every sparse layer on both ranks. They do not
    all fit (~600 rows each at their end): six are sent first and six more once those run, which
    SGLang's optimistic charge of running requests (`RETRACTING_ENV`) admits, so it retracts some
    mid-decode; one more is disconnected mid-decode. Both ranks agree on every count throughout,
    hold tables of the same shape, and give every row back."""
    server = parallel_servers["tp-project"]
    log_start = len(server.log())
    prompts = [token_prompt(100, 100 + seed) for seed in range(12)]
    ask = lambda ids: generate_ids(server, ids, 250, min_new_tokens=250)  # noqa: E731
    with ThreadPoolExecutor(len(prompts) + 1) as pool:
        first = [pool.submit(ask, ids) for ids in prompts[:6]]
        deadline = time.monotonic() + 300
        while server.stats()["requests_running"] < 6 and time.monotonic() < deadline:
            time.sleep(0.5)
        later = [pool.submit(ask, ids) for ids in prompts[6:]]
        disconnected = pool.submit(_disconnect_mid_decode, server, token_prompt(300, 99))
        time.sleep(5)
        during = server.stats()
        results = [future.result() for future in [*first, *later]]
        assert disconnected.result() is None  # still decoding when its client left
    assert all(len(result["output_ids"]) == 250 for result in results)
    assert "KV cache pool is full. Retract requests." in server.log()[log_start:]

    assert during["in_step"], during["differences"]
    [rank0, rank1] = every_rank(during)
    assert rank0["heap"]["rows_total"] == rank1["heap"]["rows_total"]
    assert rank0["kv_bytes_in_use"] > 0 and during["kv_bytes_in_use"] == 2 * rank0["kv_bytes_in_use"]

    stats = assert_at_rest(server)
    assert stats["in_step"], stats["differences"]
    for rank in every_rank(stats):
        assert rank["evictions"] >= len(prompts), rank["evictions"]
        assert rank["forward_plans"] == stats["forward_plans"]


def _disconnect_mid_decode(server: Server, ids: list[int], chunks: int = 20) -> str | None:
    """Stream a long generation and disconnect after `chunks` chunks (SGLang aborts it); returns
    the finish reason if it finished before that (None: it was still decoding)."""
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}, "stream": True}
    with requests.post(f"{server.url}/generate", json=payload, stream=True, timeout=600) as response:
        lines = (line for line in response.iter_lines() if line and line != b"data: [DONE]")
        for _, line in zip(range(chunks), lines):
            finish = json.loads(line.removeprefix(b"data: "))["meta_info"]["finish_reason"]
            if finish is not None:
                return finish["type"]
    return None


def test_tp2_gauges_name_their_rank(parallel_servers):
    server = parallel_servers["tp-project"]
    generate_ids(server, token_prompt(20, 7), 4)  # a prefill makes the scheduler log its metrics
    metrics = requests.get(f"{server.url}/metrics", timeout=60).text
    lines = [line for line in metrics.splitlines() if line.startswith("sglang_kvsparse:kv_bytes_in_use{")]
    assert lines and all('tp_rank="0"' in line for line in lines), lines


def test_dp2_spreads_requests_over_two_sparse_replicas(parallel_servers):
    """Eight concurrent evicting requests on `--dp-size 2`: both replicas serve some, each keeps
    its own heap and reports its own stats, and the server's totals add them up."""
    server = parallel_servers["dp-project"]
    prompts = [token_prompt(150, 200 + seed) for seed in range(8)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda ids: generate_ids(server, ids, 40, min_new_tokens=40), prompts))
    assert all(len(result["output_ids"]) == 40 for result in results)
    stats = assert_at_rest(server)
    assert stats["dp_size"] == 2 and len(stats["replicas"]) == 2
    for replica in stats["replicas"]:
        assert replica["forward_plans"] > 0 and replica["evictions"] > 0, replica["evictions"]
    assert stats["evictions"] == sum(replica["evictions"] for replica in stats["replicas"])
    assert stats["heap"]["rows_total"] == sum(replica["heap"]["rows_total"] for replica in stats["replicas"])


def test_two_sparse_servers_behind_sglangs_router(parallel_servers, tmp_path):
    """SGLang's router in front of two sparse servers of the same model (the `--tp-size 2` and the
    `--dp-size 2` one): requests spread over both, each reports its own stats, both at rest after."""
    workers = [parallel_servers["tp-project"], parallel_servers["dp-project"]]
    before = [worker.stats()["forward_plans"] for worker in workers]
    router_argv = [PYTHON, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--policy", "round_robin"]
    router = Server("router", [*router_argv, "--worker-urls", *(w.url for w in workers)], tmp_path, server_env())
    try:
        router.wait_ready()
        _wait_for_workers(router, len(workers))
        prompts = [token_prompt(120, 300 + seed) for seed in range(6)]
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda ids: generate_ids(router, ids, 30, min_new_tokens=30), prompts))
    finally:
        router.stop()
    assert all(len(result["output_ids"]) == 30 for result in results)
    for worker, plans in zip(workers, before):
        assert worker.stats()["forward_plans"] > plans, worker.name
        assert_at_rest(worker)


def _wait_for_workers(router: Server, count: int, timeout_s: float = 120) -> None:
    """The router answers /health at once and registers its workers in the background (a request
    before then gets a 503): wait until it lists `count` and says it is ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        listed = requests.get(f"{router.url}/workers", timeout=30).json()["total"]
        if listed == count and requests.get(f"{router.url}/readiness", timeout=30).status_code == 200:
            return
        time.sleep(0.5)
    raise TimeoutError(f"the router did not register {count} workers in {timeout_s:.0f} s")
