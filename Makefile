# Every target bootstraps .venv itself: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 90
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup demo test test-fast bench lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Without CUDA, take the local CPU wheel first so nothing pulls a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/rlpipe run configs/demo.toml --overwrite

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -m "not slow" tests

bench: setup
	$(PIP) install -q -e '.[dev,bench]'
	$(PY) -m benchmarks.run_all

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs .pytest_cache
