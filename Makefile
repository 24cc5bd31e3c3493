# Set-up and entry points. `make demo` and `make test` work on a fresh machine:
# both create .venv and install the project first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench bench-peers clean

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

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
