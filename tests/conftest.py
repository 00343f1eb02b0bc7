"""Test-wide settings: offline (no test reaches the Hugging Face hub: hub models and datasets come
from caches the tests build), quiet, and one torch thread; `-m gpu` collects tests/gpu alone.

Tiny models are overhead-bound: a second intra-op thread buys little and makes timings swing
when the machine is shared, so in-process tests run single-threaded (subprocess tests keep the
CLI's defaults).

The GPU tests run where only torch, transformers, vLLM and TRL were added to a CUDA machine's
Python (README, "On a GPU"): most other test modules import Prefect, MLflow or DuckDB, so a mark
expression that selects no test without the `gpu` mark skips collecting anything outside
tests/gpu (this file imports nothing of those either).

Tests write only under temporary folders: the session fails, naming the paths, when the
repository gained a file or folder that `git status --ignored` shows (Python's `__pycache__`,
the virtual environments and tool caches aside).
"""

import gc
import os
import re
import subprocess
import tempfile
from itertools import combinations
from pathlib import Path

import pytest
import torch
from _pytest.mark.expression import Expression
from hypothesis import settings
from hypothesis.configuration import set_hypothesis_home_dir
from rlpipe.core.environment import quiet_defaults

from tests.file_order import heaviest_first

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before the first Hugging Face import
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
quiet_defaults()
os.environ.setdefault("RLPIPE_PROGRESS", "0")
torch.set_num_threads(1)
# and one OpenMP thread in every process the tests start (the zygote, CLI runs, servers, ranks):
# three workers share 2 cores, and a second thread of each only waits or spins. The whole suite
# used 1,366 busy CPU seconds with it and 1,431 without, in 12:07 against 12:37.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# hypothesis keeps its example database and caches in ./.hypothesis by default: the checkout
# stays as it was
set_hypothesis_home_dir(tempfile.mkdtemp(prefix="rlpipe-hypothesis-"))
settings.register_profile("rlpipe", database=None)
settings.load_profile("rlpipe")

GPU_TESTS = Path(__file__).resolve().parent / "gpu"


def selects_gpu_only(markexpr: str) -> bool:
    """Whether the `-m` expression selects tests marked `gpu` and none without that mark (any
    combination of the other marks it names)."""
    if not markexpr:
        return False
    expression = Expression.compile(markexpr)
    others = sorted(set(re.findall(r"[^\s()=,'\"]+", markexpr)) - {"and", "or", "not", "gpu"})

    def selects(marks: set[str]) -> bool:
        return expression.evaluate(lambda name, **kwargs: name in marks)

    subsets = [set(c) for r in range(len(others) + 1) for c in combinations(others, r)]
    return any(selects(marks | {"gpu"}) for marks in subsets) and not any(map(selects, subsets))


def pytest_ignore_collect(collection_path: Path, config) -> bool | None:
    """Under a GPU-only mark expression, ignore every path that neither is in tests/gpu nor
    leads to it; otherwise leave the decision to pytest."""
    if not selects_gpu_only(config.getoption("markexpr")):
        return None
    path = collection_path.resolve()
    inside = path == GPU_TESTS or GPU_TESTS in path.parents
    return None if inside or path in GPU_TESTS.parents else True


def pytest_configure(config) -> None:
    """Under xdist, files go to the workers in collection order (tests/file_order.py), not
    xdist's default of the files with the most tests first. A command that would start cold only
    because a test changed a variable read at import fails the test, naming the variable
    (tests/warm_cli.py ColdCommand): a cold start costs some 7 CPU seconds the warm one does not."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    config.addinivalue_line("filterwarnings", "error::tests.warm_cli.ColdCommand")


def pytest_collection_modifyitems(session, config, items) -> None:
    """The most expensive test files first (tests/file_order.py), each file's tests in order."""
    items[:] = [items[i] for i in heaviest_first([item.nodeid for item in items])]


REPO = Path(__file__).resolve().parent.parent
# what running anything in the checkout leaves, beside the test session's own writes
ALLOWED = re.compile(r"(^|/)(__pycache__|\.venv[^/]*|\.pytest_cache|\.ruff_cache|[^/]*\.egg-info)(/|$)")


def repository_entries() -> set[str] | None:
    """`git status --porcelain --ignored` lines of the checkout, less ALLOWED; None outside a
    git checkout (an installed copy of the tests)."""
    try:
        done = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--ignored"], capture_output=True,
                              text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode:
        return None
    return {line for line in done.stdout.splitlines() if not ALLOWED.search(line[3:])}


def pytest_sessionstart(session) -> None:
    """Note what the checkout holds before any test runs (in the main process only under xdist)."""
    if not hasattr(session.config, "workerinput"):
        session.config.stash[REPOSITORY_BEFORE] = repository_entries()


def pytest_unconfigure(config) -> None:
    """The test processes end as `rlpipe` commands do (core/environment.py): without the
    interpreter's last garbage collections over torch's, Prefect's and MLflow's objects."""
    gc.freeze()


def pytest_sessionfinish(session, exitstatus) -> None:
    """Fail the session, naming them, if tests left files in the checkout."""
    before = session.config.stash.get(REPOSITORY_BEFORE, None)
    after = repository_entries() if before is not None else None
    gained = sorted(after - before) if after is not None else []
    if gained:
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        message = "tests wrote into the repository (write under tmp_path): " + ", ".join(gained)
        if reporter:
            reporter.write_sep("=", message, red=True)
        else:
            print(message)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


REPOSITORY_BEFORE = pytest.StashKey[set[str] | None]()


def restored_environment():
    """os.environ as it was before the yield, once it resumes."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)


@pytest.fixture(autouse=True)
def environment_as_found():
    """Each test leaves os.environ as it found it. Code a test runs in this process may set
    variables that no monkeypatch undoes (torch's inductor sets TORCHINDUCTOR_CACHE_DIR when it
    compiles, the launcher OMP_NUM_THREADS): they would reach every later test of the process and
    every subprocess it starts, and start tests/warm_cli.py's zygote again, which keeps to the
    environment it was started in."""
    yield from restored_environment()


@pytest.fixture(autouse=True, scope="module")
def module_environment_as_found():
    """Each test file leaves os.environ as it found it, its module fixtures included: a Dask or
    Ray cluster started in this process sets OMP_NUM_THREADS, MALLOC_TRIM_THRESHOLD_, RAY_*, ..."""
    yield from restored_environment()


@pytest.fixture(autouse=True)
def no_stop_signal_left_over():
    """Each test starts as a fresh run does: no stop signal received (core/termination.py keeps
    the one a run received, so that its stages stop; a test that raised SIGINT in this process
    would otherwise stop the next test's stages with KeyboardInterrupt, ending the session)."""
    yield
    from rlpipe.core import termination

    termination._RECEIVED.clear()
