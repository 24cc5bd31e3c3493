# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# both create .venv and install the project first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench bench-peers gpu-check clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -c constraints.txt -e '.[all]'
	touch $(STAMP)

demo: setup
	$(PY) examples/research_loop.py

test: setup
	$(PY) -m pytest -q

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
