# sglang-kvsparse: the two commands of the README are `make demo` and `make test`.
PYTEST = .venv/bin/pytest

.PHONY: setup demo test test-lint test-unit test-kernels test-integration test-e2e

setup:
	bash scripts/setup.sh

demo: setup
	bash scripts/demo.sh

# Tiers, fastest first, so a broken basic stops the run before the slow end-to-end tier.
test: setup test-lint test-unit test-kernels test-integration test-e2e

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

# Two runs: the shared servers of tests/e2e are stopped before the benchmarks' checks start their own.
test-e2e:
	$(PYTEST) tests/e2e -q -m "e2e" --durations=10
	$(PYTEST) tests/integration -q -m "e2e" --durations=5
