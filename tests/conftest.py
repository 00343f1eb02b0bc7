"""Test-wide settings: offline (no test reaches the Hugging Face hub: hub models and datasets come
from caches the tests build), quiet, and one torch thread; `-m gpu` collects tests/gpu alone.

Tiny models are overhead-bound: a second intra-op thread buys little and makes timings swing
when the machine is shared, so in-process tests run single-threaded (subprocess tests keep the
CLI's defaults).

The GPU tests run where only torch, transformers, vLLM and TRL were added to a CUDA machine's
Python (README, "On a GPU"): most other test modules import Prefect, MLflow or DuckDB, so a mark
expression that selects no test without the `gpu` mark skips collecting anything outside
tests/gpu (this file imports nothing of those either).
"""

import os
import re
from itertools import combinations
from pathlib import Path

import torch
from _pytest.mark.expression import Expression
from rlpipe.core.environment import quiet_defaults

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before the first Hugging Face import
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
quiet_defaults()
os.environ.setdefault("RLPIPE_PROGRESS", "0")
torch.set_num_threads(1)

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
