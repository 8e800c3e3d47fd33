"""Servers shared by the end-to-end tests, started once and in parallel (a minute or two on 2 cores):
only those the collected tests ask for (CI's tier needs four, and seven do not start together in
24 GiB; `make test-extended` the others).

- "project": the project's launcher with sparsity off;
- "sparse": the project's launcher with sparse layers whose budgets cover every length (lossless),
  with a context of `SPARSE_CONTEXT` tokens (a prompt near it is served in 9 chunks);
- "evicting": sparse layers with a budget of 256 that really evict, in a KV pool small enough
  (`EVICTING_ARGS`) that concurrent requests force SGLang to retract; its requests may ask for
  their own budget up to 1,024, or for no sparsity; faults are injected for requests whose rid
  says so (`FAULT_INJECTION`);
- "unchunked": the evicting server's settings without chunked prefill;
- "uncached": the default preset as a user starts it with `--disable-radix-cache` and nothing
  about chunks, so SGLang chunks at its own default size, its processes talking over SGLang's
  msgpack IPC (`MSGPACK_IPC`) where every other server uses the default pickle one;
- "stock": stock SGLang;
- "options" and "options_stock": the lossless sparse server and stock SGLang, both with the SGLang
  options that change pages, admission and the radix tree's order (`OPTION_ARGS`,
  `option_support.SERVED`);
- "fp8_sparse", "fp8_evicting" and "fp8_stock" (and "e5m2_sparse", "e5m2_stock", and
  "fp8_default", the "uncached" server's default preset): the lossless and the evicting servers and
  stock SGLang with an FP8 KV cache (`--kv-cache-dtype fp8_e4m3`, or fp8_e5m2), stock's through the
  CPU's FP8 reference (`patches/cpu_fp8.py`). They run in a pytest session of their own (`make
  test-e2e`), beside no other server.

All serve the embedded default model in float32 with the same KV pool, so any difference in their
greedy outputs is the project's doing. All but "unchunked" and "uncached" prefill in chunks of
512 tokens with mixed chunks (`CHUNK_ARGS`), so that a batch is prefilled the same way on each.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from sglang_kvsparse.models import ensure_default_model
from sglang_kvsparse.server.options import CPU_SPARSE_MEM_FRACTION
from sglang_kvsparse.server.serving_defaults import CPU_MAX_TOTAL_TOKENS, gpu_available

from .servers import PYTHON, RETRACTING_ENV, Server, server_env

#: Chunked prefill as the issue asks it on the CPU: 512 tokens, decode steps mixed into prefills.
CHUNK_ARGS = ["--chunked-prefill-size", "512", "--enable-mixed-chunk"]

COMMON_ARGS = ["--dtype", "float32", "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS), *CHUNK_ARGS]

#: What the launcher adds for a sparse server on the CPU, given to stock as well.
SPARSE_BASELINE_ARGS = ["--mem-fraction-static", str(CPU_SPARSE_MEM_FRACTION)]

#: The default's layout (layer 0 full: the heap's one lane) with sparse layers 1..29 given a budget
#: of the whole context: nothing may change in the outputs. The evicting server keeps layers 0-1
#: full, so the two-lane layout is served as well.
LOSSLESS_SPARSITY = ["--kvsparse-full-layers", "0", "--kvsparse-budget", "8192"]
#: The lossless servers' request slots (no test runs more at once): their entry tables hold a row
#: of the whole context per slot and sparse column, 3 GB at the 2,049 slots SGLang gives this pool.
LOSSLESS_SLOTS = ["--max-running-requests", "64"]
#: The lossless server's context (the model's is 8,192): its near-context prompt costs a third of
#: the attention work of one at 8,192, and every other prompt it serves is shorter than 2,500.
SPARSE_CONTEXT = 4608

#: Budget 256 (evicting above 272 entries), in the KV bytes of 2,600 dense tokens: a heap of
#: ~38,700 rows of two lanes. A ~3,000-token prompt fits (3,000 + 14 x 272 rows), and so does a
#: ~1,600-token cached prefix in every column beside a request reusing it, but twelve requests
#: of ~240 tokens (240 x 15 rows each at their end) do not, which with SGLang's admission made
#: optimistic (`RETRACTING_ENV`) forces retractions. Custom logit processors are on for the
#: teacher-forcing test (`test_chunked.py`).
EVICTING_BUDGET = 256
#: The largest budget one of its requests may ask for, and the policies they may choose (h2o
#: beside the default's choices but keynorm and streamingllm) (`test_request_settings.py`).
EVICTING_MAX_REQUEST_BUDGET = 1024
EVICTING_REQUEST_POLICIES = ("h2o", "snapkv", "span", "tova")
EVICTING_ARGS = [
    "--dtype",
    "float32",
    "--max-total-tokens",
    "2600",
    "--kvsparse-full-layers",
    "0,1",
    "--kvsparse-budget",
    str(EVICTING_BUDGET),
    "--kvsparse-max-request-budget",
    str(EVICTING_MAX_REQUEST_BUDGET),
    "--kvsparse-request-policies",
    ",".join(EVICTING_REQUEST_POLICIES),
    "--enable-metrics",
    "--enable-cache-report",
    "--enable-custom-logit-processor",
]
#: SGLang options served with sparse layers (`option_support.SERVED`) that no other server sets:
#: pages of 4 tokens, at most 3 running requests, prefills of at most 1,024 tokens, longest
#: prefix first, the radix tree evicting least frequently used first, admission twice as
#: conservative, no overlap of scheduling with the forward, two decode steps per scheduling round.
OPTION_ARGS = [
    "--page-size",
    "4",
    "--max-running-requests",
    "3",
    "--max-prefill-tokens",
    "1024",
    "--schedule-policy",
    "lpm",
    "--radix-eviction-policy",
    "lfu",
    "--schedule-conservativeness",
    "2.0",
    "--disable-overlap-schedule",
    "--num-continuous-decode-steps",
    "2",
]
#: An FP8 KV cache of each format SGLang names, for the FP8 servers.
FP8_ARGS = {"fp8": ["--kv-cache-dtype", "fp8_e4m3"], "e5m2": ["--kv-cache-dtype", "fp8_e5m2"]}
#: SGLang's msgpack IPC between its processes in place of pickle: what it carries must be within
#: the types SGLang declares (`custom_params` among them).
MSGPACK_IPC = {"SGLANG_USE_PICKLE_IPC": "0"}
#: `patches/faults.py`: requests with these rid prefixes fail in the sparse admission / prefix match.
FAULT_ADMISSION_RID, FAULT_MATCH_RID = "kvsparse-fault-admission-", "kvsparse-fault-match-"
FAULT_INJECTION = {"SGLANG_KVSPARSE_FAULT": f"admission:{FAULT_ADMISSION_RID},match:{FAULT_MATCH_RID}"}


@pytest.fixture(scope="session")
def model_path() -> str:
    return str(ensure_default_model())


#: Each server's fixture, by the server's name.
SERVER_FIXTURES = {
    "project": "project_server",
    "sparse": "sparse_server",
    "evicting": "evicting_server",
    "unchunked": "unchunked_server",
    "uncached": "uncached_server",
    "stock": "stock_server",
    "options": "options_server",
    "options_stock": "options_stock_server",
    "fp8_sparse": "fp8_sparse_server",
    "fp8_evicting": "fp8_evicting_server",
    "fp8_stock": "fp8_stock_server",
    "e5m2_sparse": "e5m2_sparse_server",
    "e5m2_stock": "e5m2_stock_server",
    "fp8_default": "fp8_default_server",
}


def servers_asked_for(items: list[pytest.Item]) -> set[str]:
    """The servers whose fixtures these tests use (directly or through other fixtures)."""
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    return {server for server, fixture in SERVER_FIXTURES.items() if fixture in used}


@pytest.fixture(scope="session")
def servers(request, model_path, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("server-logs")
    stock_env = server_env()
    stock_args = ["--model-path", model_path, *COMMON_ARGS, *SPARSE_BASELINE_ARGS]
    if not gpu_available():
        stock_env["SGLANG_USE_CPU_ENGINE"] = "1"
        stock_args += ["--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle"]
    launcher = [PYTHON, "-m", "sglang_kvsparse.launch_server"]
    lossless = [*launcher, *COMMON_ARGS, *LOSSLESS_SPARSITY, *LOSSLESS_SLOTS, "--context-length", str(SPARSE_CONTEXT)]
    commands = {
        "project": ([*launcher, *COMMON_ARGS, "--kvsparse-preset", "off"], server_env()),
        "sparse": (lossless, server_env()),
        "evicting": (
            [*launcher, *EVICTING_ARGS, *CHUNK_ARGS],
            {**server_env(), **RETRACTING_ENV, **FAULT_INJECTION},
        ),
        "unchunked": ([*launcher, *EVICTING_ARGS, "--chunked-prefill-size", "-1"], server_env()),
        "uncached": (
            [*launcher, "--dtype", "float32", "--max-total-tokens", str(CPU_MAX_TOTAL_TOKENS), "--disable-radix-cache"],
            {**server_env(), **MSGPACK_IPC},
        ),
        "stock": ([PYTHON, "-m", "sglang.launch_server", *stock_args], stock_env),
        "options": (
            [*launcher, *COMMON_ARGS, *LOSSLESS_SPARSITY, "--context-length", str(SPARSE_CONTEXT), *OPTION_ARGS],
            server_env(),
        ),
        "options_stock": (
            [PYTHON, "-m", "sglang.launch_server", *stock_args, "--context-length", str(SPARSE_CONTEXT), *OPTION_ARGS],
            stock_env,
        ),
    }
    for fmt, kv in FP8_ARGS.items():
        commands[f"{fmt}_sparse"] = ([*lossless, *kv], server_env())
        commands[f"{fmt}_stock"] = (
            [PYTHON, "-m", "sglang.launch_server", *stock_args, "--context-length", str(SPARSE_CONTEXT), *kv],
            stock_env,
        )
    commands["fp8_evicting"] = ([*launcher, *EVICTING_ARGS, *CHUNK_ARGS, *FP8_ARGS["fp8"]], server_env())
    commands["fp8_default"] = ([*commands["uncached"][0], *FP8_ARGS["fp8"]], server_env())
    wanted = servers_asked_for(request.session.items)
    started = {name: Server(name, argv, log_dir, env) for name, (argv, env) in commands.items() if name in wanted}
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        with ThreadPoolExecutor(len(started)) as pool:  # each takes seconds to shut down
            list(pool.map(lambda server: server.stop(), started.values()))


@pytest.fixture(scope="session")
def project_server(servers) -> Server:
    return servers["project"]


@pytest.fixture(scope="session")
def sparse_server(servers) -> Server:
    return servers["sparse"]


@pytest.fixture(scope="session")
def evicting_server(servers) -> Server:
    return servers["evicting"]


@pytest.fixture(scope="session")
def unchunked_server(servers) -> Server:
    return servers["unchunked"]


@pytest.fixture(scope="session")
def uncached_server(servers) -> Server:
    return servers["uncached"]


@pytest.fixture(scope="session")
def stock_server(servers) -> Server:
    return servers["stock"]


@pytest.fixture(scope="session")
def options_server(servers) -> Server:
    return servers["options"]


@pytest.fixture(scope="session")
def options_stock_server(servers) -> Server:
    return servers["options_stock"]


@pytest.fixture(scope="session")
def fp8_sparse_server(servers) -> Server:
    return servers["fp8_sparse"]


@pytest.fixture(scope="session")
def fp8_evicting_server(servers) -> Server:
    return servers["fp8_evicting"]


@pytest.fixture(scope="session")
def fp8_stock_server(servers) -> Server:
    return servers["fp8_stock"]


@pytest.fixture(scope="session")
def fp8_default_server(servers) -> Server:
    return servers["fp8_default"]


@pytest.fixture(scope="session")
def e5m2_sparse_server(servers) -> Server:
    return servers["e5m2_sparse"]


@pytest.fixture(scope="session")
def e5m2_stock_server(servers) -> Server:
    return servers["e5m2_stock"]
