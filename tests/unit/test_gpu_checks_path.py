"""The GPU checks run where only torch, transformers, vLLM and TRL were added to a CUDA machine's
Python: `python -m benchmarks.bench_gpu` and `python -m pytest -m gpu` import nothing of Prefect,
MLflow, DuckDB, Polars or pydantic (README, "On a GPU").

Each check runs in a subprocess whose sitecustomize marks those packages absent the way Python
itself does (`sys.modules[name] = None`: `import` raises ImportError and
`importlib.util.find_spec` answers None, as where they are not installed, so libraries that probe
for them, such as accelerate, behave as they would there).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rlpipe.models.tokenizer import build_tokenizer
from rlpipe.rollouts.generation import encode_messages

from benchmarks.gpu_steps import arithmetic_prompts
from tests.conftest import selects_gpu_only

ROOT = Path(__file__).resolve().parents[2]
BLOCKED = ("prefect", "mlflow", "duckdb", "polars", "pydantic")
# bench_gpu and the modules its parts use (the rl_vs_trl_vllm sides run gpu_vllm as a script)
GPU_BENCHMARKS = ("bench_gpu", "gpu_quick", "gpu_steps", "gpu_vllm", "gpu_logprobs", "gpu_report",
                  "logprobs_baseline", "results", "timing")
SITECUSTOMIZE = f"""import sys

for name in {BLOCKED!r}:
    sys.modules[name] = None
"""


def imported_modules(path: Path) -> set[str]:
    """Every rlpipe or benchmarks module `path` imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n.split(".")[0] in ("rlpipe", "benchmarks")}


@pytest.fixture(scope="module")
def without_the_pipeline_stack(tmp_path_factory) -> dict[str, str]:
    """A subprocess environment in which the blocked packages are absent."""
    folder = tmp_path_factory.mktemp("blocked")
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {**os.environ, "PYTHONPATH": str(folder)}


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_blocked_packages_are_absent_in_the_subprocess(without_the_pipeline_stack):
    code = ("import importlib, importlib.util\n"
            f"for name in {BLOCKED!r}:\n"
            "    assert importlib.util.find_spec(name) is None, name\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except ImportError:\n"
            "        continue\n"
            "    raise SystemExit(f'{name} imported')\n")
    done = run(["-c", code], without_the_pipeline_stack)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_bench_gpu_and_every_module_its_parts_use_import_without_the_pipeline_stack(
        without_the_pipeline_stack):
    modules = sorted({f"benchmarks.{m}" for m in GPU_BENCHMARKS}.union(
        *(imported_modules(ROOT / "benchmarks" / f"{m}.py") for m in GPU_BENCHMARKS)))
    assert "rlpipe.engines.vllm_engine" in modules and "benchmarks.gpu_steps" in modules
    code = ("import importlib, sys\n"
            f"for name in {modules!r}:\n"
            "    importlib.import_module(name)\n"
            "from rlpipe.models.tokenizer import build_tokenizer\n"
            "from benchmarks.gpu_steps import arithmetic_prompts\n"
            "env, examples, prompts = arithmetic_prompts(build_tokenizer(), 2, seed=0)\n"
            "assert len(prompts) == 2 and all(prompts)\n"
            f"print(sorted(n for n in sys.modules if n.split('.')[0] in {BLOCKED!r} and sys.modules[n]))\n")
    done = run(["-c", code], without_the_pipeline_stack)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "[]"


@pytest.mark.slow
def test_bench_gpu_help_runs_without_the_pipeline_stack(without_the_pipeline_stack):
    done = run(["-m", "benchmarks.bench_gpu", "--help"], without_the_pipeline_stack)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "--parts" in done.stdout


@pytest.mark.slow
def test_pytest_m_gpu_collects_the_gpu_tests_alone_without_the_pipeline_stack(
        without_the_pipeline_stack):
    done = run(["-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
               without_the_pipeline_stack)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ids = [line for line in done.stdout.splitlines() if "::" in line]
    files = {i.split("::")[0] for i in ids}
    assert files == {"tests/gpu/test_cuda.py", "tests/gpu/test_cuda_graphs.py", "tests/gpu/test_vllm.py"}
    assert "error" not in done.stdout.lower()


def test_only_expressions_that_select_gpu_tests_alone_narrow_the_collection():
    for markexpr in ("gpu", "(gpu)", "gpu and not slow", "gpu and slow"):
        assert selects_gpu_only(markexpr), markexpr
    for markexpr in ("", "not gpu", "gpu or slow", "slow", "not slow", "browser"):
        assert not selects_gpu_only(markexpr), markexpr


@pytest.mark.slow
def test_the_benchmark_encodes_prompts_as_the_generate_stage_does():
    tokenizer = build_tokenizer()
    env, examples, prompts = arithmetic_prompts(tokenizer, 4, seed=0)
    assert prompts == [encode_messages(tokenizer, env.reset(e)) for e in examples]
