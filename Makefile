# One entry point for people and CI. Every target that runs code depends on `setup`.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c
VENV := .venv
PY := $(VENV)/bin/python
ENV := source scripts/airflow-env.sh &&
PYTEST_ARGS ?=
# Test files run two at a time (pytest-xdist, one file per worker process): most tests wait on Airflow's scheduler
# or on TensorFlow start-up, so one at a time leaves a core idle. Files go out in collection order, the longest
# first (tests/conftest.py). TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= 2

.PHONY: setup provision demo demo-s3 airflow test bench bench-table lint clean

$(VENV)/.synced: pyproject.toml uv.lock
	@command -v uv >/dev/null || python3 -m pip install --quiet "uv==0.13.9"
	uv sync --frozen --compile-bytecode  # .pyc for every package: without them each process compiles what it imports
	@touch $@

setup: $(VENV)/.synced  ## create .venv exactly from uv.lock

demo: setup  ## run the whole DAG end to end on embedded defaults (CPU, 2 local workers) and print the report path
	$(ENV) $(PY) scripts/demo.py $(DEMO_ARGS)

demo-s3: setup  ## the same, with storage on a local S3-protocol server (moto)
	$(ENV) $(PY) scripts/demo.py --s3 $(DEMO_ARGS)

airflow: setup  ## start `airflow standalone` on the project-local home; prints the UI URL and login
	$(ENV) scripts/standalone.sh

provision: setup  ## install what the tests need besides .venv (Chromium, openssh-server); silent when present
	@scripts/provision-tests.sh

test: provision  ## the whole test suite (CPU only)
	$(ENV) $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

bench: setup  ## performance ratios measured side by side; results in bench-results/ and docs/benchmarks.md's table
	$(ENV) $(PY) -m bench $(BENCH_ARGS)

bench-table: setup  ## regenerate docs/benchmarks.md's table from bench-results/*.json
	$(PY) -m bench.results

lint: setup  ## ruff over code and tests: default rules, 120 columns, complexity <= 10, <= 7 parameters (pyproject.toml)
	$(VENV)/bin/ruff check core dags launcher plugins tasks trainer tests bench scripts

clean:
	rm -rf .airflow storage test-artifacts  # bench-results/ is kept: it is the source of docs/benchmarks.md's table
