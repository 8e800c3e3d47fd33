# sglang-kvsparse: the two commands of the README are `make demo` and `make test`.
PYTEST = .venv/bin/pytest
# The tiers without servers run in two worker processes (pytest-xdist), one per core of CI's
# machine: their time is mostly single-threaded (the Triton interpreter, subprocesses importing
# SGLang). The end-to-end tiers share session-wide servers and run in one process.
WORKERS = -n 2

.PHONY: setup demo test test-all test-lint test-unit test-kernels test-integration test-e2e test-extended

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

# Tiers, fastest first, so a broken basic stops the run before the slow end-to-end tier.
# `test` is CI's (under 30 minutes on 2 cores); `test-all` adds the extended tier.
test: setup test-lint test-unit test-kernels test-integration test-e2e

test-all: test test-extended

# ruff: lint (pyproject.toml [tool.ruff]) and formatting, in seconds.
test-lint:
	.venv/bin/ruff check .
	.venv/bin/ruff format --check .

test-unit:
	$(PYTEST) tests/unit -q $(WORKERS)

test-kernels:
	$(PYTEST) tests/kernels -q -m "not extended" $(WORKERS)

test-integration:
	$(PYTEST) tests/integration -q -m "not extended" $(WORKERS)

# The FP8 servers and Gemma 3's run in sessions of their own, beside no other server (24 GiB).
APART = tests/e2e/test_fp8.py tests/e2e/test_gemma3.py

test-e2e:
	$(PYTEST) tests/e2e -q -m "e2e and not extended" $(addprefix --ignore=,$(APART)) --durations=10
	$(PYTEST) tests/e2e/test_fp8.py -q -m "e2e and not extended" --durations=5
	$(PYTEST) tests/e2e/test_gemma3.py -q -m "e2e and not extended" --durations=5

# Two runs: the tests that start servers of their own (or two more shared ones) run after the
# session's shared servers have stopped; a 24 GiB machine does not start them all at once.
EXTENDED_APART = tests/e2e/test_server_options.py tests/e2e/test_parallel_serving.py \
	tests/e2e/test_bench_capacity_sparse.py tests/e2e/test_bench_fidelity_smoke.py \
	tests/e2e/test_bench_gpu_check_dry_run.py tests/e2e/test_bench_selection_probe.py

test-extended: setup
	$(PYTEST) tests/kernels -q -m "extended" --durations=5 $(WORKERS)
	$(PYTEST) tests/integration -q -m "extended" --durations=5 $(WORKERS)
	$(PYTEST) tests/e2e -q -m "extended" $(addprefix --ignore=,$(EXTENDED_APART) $(APART)) --durations=5
	$(PYTEST) $(EXTENDED_APART) -q -m "extended" --durations=5
	$(PYTEST) tests/e2e/test_fp8.py -q -m "extended" --durations=5
	$(PYTEST) tests/e2e/test_gemma3.py -q -m "extended" --durations=5
