# sglang-kvsparse: the two commands of the README are `make demo` and `make test`.
PYTEST = .venv/bin/pytest

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
	$(PYTEST) tests/unit -q

test-kernels:
	$(PYTEST) tests/kernels -q

test-integration:
	$(PYTEST) tests/integration -q -m "integration"

test-e2e:
	$(PYTEST) tests/e2e -q -m "e2e and not extended" --durations=10

# Two runs: the shared servers of tests/e2e are stopped before the benchmarks' checks start their own.
test-extended: setup
	$(PYTEST) tests/e2e -q -m "extended" --durations=5
	$(PYTEST) tests/integration -q -m "extended" --durations=5
