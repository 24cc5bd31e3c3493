# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# both create .venv and install the project first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

# Python's bytecode cache on for everything make runs, whatever the shell says: with
# PYTHONDONTWRITEBYTECODE set, pytest rewrites every test module and plugin again in each
# worker on every run (collecting took 18.8 s of CPU per worker instead of 12.7 s on the
# second run). A fresh clone gains nothing measurable (docs/testing.md).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: setup browser claude-cli triton demo test test-fast bench bench-smoke bench-peers gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[all]'
	touch $(STAMP)

demo: setup
	$(PY) examples/research_loop.py

# Two workers, each test file on one of them (module-scoped servers stay shared): most
# tests wait on servers and subprocesses, so two workers on two cores finish well before
# one. Files in collection order, where tests/conftest.py puts the files with `slow`
# tests first (xdist's default would order them by their number of tests), so the long
# files do not come last. `python -m pytest tests/...` still runs a part in one process.
TEST_WORKERS := -n 2 --dist loadfile --no-loadscope-reorder

# Everything but the `bench` smoke runs of the benchmark modules that start the engine:
# those check the measuring code, not the product (`make bench-smoke`; docs/testing.md).
test: setup browser claude-cli triton
	$(PY) -m pytest -q $(TEST_WORKERS) -m "not bench"

# The edit loop: unit tests and the tests that run the server app or the engine's routes
# in process, about a minute on two cores. Leaves out the `slow` tests and the modules
# that start real server, engine, CLI or script processes (marked `process` by
# tests/conftest.py); `make test` runs everything but the `bench` tests.
test-fast: setup
	$(PY) -m pytest -q $(TEST_WORKERS) -m "not slow and not process and not bench"

# The `bench` tests: every benchmark module once with tiny counts, and the GPU check's
# smoke runs on CPU (one process, two ranks). Run it after changing bench/ or an API
# that bench/ calls.
bench-smoke: setup triton
	$(PY) -m pytest -q $(TEST_WORKERS) -m bench tests/bench

# The console's browser tests drive Debian's chromium (Playwright cannot download its own
# browser here). Installed once when missing and the machine allows it (root with
# apt-get; about 1.5 min); otherwise the browser tests are skipped and say why.
browser:
	@if [ -x /usr/bin/chromium ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	  echo "make: installing chromium for the browser tests (apt-get, once)"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium \
	    >/dev/null) || echo "make: chromium could not be installed; browser tests will skip"; \
	else echo "make: no /usr/bin/chromium and no root apt-get; browser tests will skip"; fi

# Triton for the paged decode kernel's interpreter tests, beside the environment and not in
# it: with triton importable, torch and transformers import it into every engine process
# (~0.1 s per boot and nanobind's leak report at each exit). Only the tests' interpreter
# child puts .venv/triton on its path (tests/support/triton_env.py). Once, when pip can.
triton: setup
	@if [ -d $(VENV)/triton/triton ]; then :; \
	else echo "make: installing triton for the decode kernel's tests (.venv/triton, once)"; \
	  $(PIP) install --quiet --no-deps --target $(VENV)/triton 'triton>=3.2' >/dev/null 2>&1 \
	    || echo "make: triton could not be installed; the kernel's tests will skip"; fi

# The README's Claude Code lines are tried on the real `claude` CLI
# (tests/test_readme_commands.py): installed once from the npm registry into .venv/claude
# when npm is there; otherwise that test skips and says why.
claude-cli: setup
	@if [ -x $(VENV)/claude/node_modules/.bin/claude ]; then :; \
	elif command -v npm >/dev/null 2>&1; then \
	  echo "make: installing the claude CLI for the README test (npm, once)"; \
	  npm install --silent --no-fund --no-audit --prefix $(VENV)/claude @anthropic-ai/claude-code \
	    >/dev/null 2>&1 || echo "make: the claude CLI could not be installed; its test will skip"; \
	else echo "make: no npm; the README's claude test will skip"; fi

bench: setup
	$(PY) -m bench

bench-peers: setup
	$(PY) -m bench.peers

# The engine's GPU paths on one GPU (bench/gpu_check.py). No `setup`: it runs on a bare
# GPU host with only torch, transformers and peft, with the system's python3.
gpu-check:
	$(PYTHON) bench/gpu_check.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
