"""prefect.yaml against a real Prefect server: the session's `prefect server start` (on a free
loopback port, tests/integration/conftest.py), a process work pool, `prefect deploy --all`, a
worker, and the `tiny` pipeline deployment run to Completed; then run again (a folder of its own,
the first untouched), resumed with new overrides (refused) and as it was (already finished,
untouched); then the flow runs' names, the phases' subflows with their task runs, the run's tables
and its MLflow registry entries are checked. No other test deploys to that server, and the flow
runs and task runs read back are this test's own, found by their run folder's name.

The worker is in its own session and is stopped in a finally (SIGTERM, then SIGKILL after a
bounded wait); every wait is bounded; only 127.0.0.1 is used. The run directory lives under
pytest's tmp_path (runs_root is overridden).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.prefect_server import stop_group

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
RUN_TIMEOUT_S = 900
SFT_STEPS = 4


def prefect_env(tmp_path: Path, api_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(
        PREFECT_HOME=str(tmp_path / "prefect"),
        PREFECT_API_URL=api_url,
        PREFECT_UI_ENABLED="false",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        DO_NOT_TRACK="1",
        # SQLite on a busy machine: be patient with locks instead of failing a call
        PREFECT_API_REQUEST_TIMEOUT="120",
        # the worker looks for scheduled runs every second, not every 10 (each run waited for it)
        PREFECT_WORKER_QUERY_SECONDS="1",
        PREFECT_LOGGING_LEVEL="WARNING",
        RLPIPE_PROGRESS="0",
        OMP_NUM_THREADS="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
    )
    return env


def prefect(*args: str) -> list[str]:
    return [sys.executable, "-m", "prefect", *args]


def start(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            start_new_session=True)


def run(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(args[2:])} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


# the flow runs named after the run folder sys.argv[1] (the run and its phases' subflows), their
# task runs (page by page: the server answers at most a page a call), and every deployment
FLOW_RUNS = """
import asyncio, json, sys
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, FlowRunFilterName

async def main(name):
    async with get_client() as client:
        names = FlowRunFilterName(any_=[name, f"{name}/sft", f"{name}/rl"])
        flows = await client.read_flow_runs(flow_run_filter=FlowRunFilter(name=names))
        ours = FlowRunFilter(id=FlowRunFilterId(any_=[r.id for r in flows]))
        tasks, page = [], None
        while page is None or len(page) == 100:
            page = await client.read_task_runs(flow_run_filter=ours, limit=100, offset=len(tasks))
            tasks += page
        flow_names = {f.id: f.name for f in await client.read_flows()}
        deployments = await client.read_deployments()
    print(json.dumps({"flows": [{"id": str(r.id), "name": r.name, "state": r.state_name,
                                 "subflow": r.parent_task_run_id is not None} for r in flows],
                      "tasks": [str(t.flow_run_id) for t in tasks],
                      "checkpoint_tasks": [str(t.flow_run_id) for t in tasks if t.task_key.startswith("checkpoint")],
                      "deployments": sorted(f"{flow_names[d.flow_id]}/{d.name}" for d in deployments)}))

asyncio.run(main(sys.argv[1]))
"""


def deployment_run(params: dict, env: dict) -> subprocess.CompletedProcess:
    """`prefect deployment run 'pipeline/tiny'` with `params`, watched to its end."""
    return subprocess.run(
        prefect("deployment", "run", "pipeline/tiny", "--params", json.dumps(params), "--watch",
                "--watch-timeout", str(RUN_TIMEOUT_S)),
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S + 60)


def digest(folder: Path) -> dict[str, str]:
    """Every file below `folder` (lock files aside) → its sha256."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".lock"}


def test_tiny_pipeline_deployment_completes_on_a_real_server(tmp_path, prefect_api_url):
    env = prefect_env(tmp_path, prefect_api_url)
    runs = tmp_path / "runs"
    worker = None
    try:
        run(prefect("work-pool", "create", "rlpipe", "--type", "process"), env, 120)
        run(prefect("--no-prompt", "deploy", "--all"), env, 300)
        worker = start(prefect("worker", "start", "--pool", "rlpipe"), env, tmp_path / "worker.log")
        # a loss with its own normaliser: the flow validates its parameters again (tests/integration/test_every_loss.py has every loss)
        # SFT cut from tiny.toml's 40 steps to 4: the deployment's mechanics, not learning, are checked
        overrides = [f"runs_root={runs}", "rl.loss.type=gspo", f"sft.steps={SFT_STEPS}", "tracking.prefect_task_runs=true"]
        began = time.monotonic()
        flow_run = deployment_run({"overrides": overrides}, env)
        seconds = time.monotonic() - began
        worker_log = (tmp_path / "worker.log").read_text()
        assert flow_run.returncode == 0, f"{flow_run.stdout[-3000:]}\n{flow_run.stderr[-2000:]}\n{worker_log[-3000:]}"
        assert "Completed" in flow_run.stdout, flow_run.stdout[-3000:]
        print(f"tiny pipeline deployment ran to Completed in {seconds:.0f} s")
        (run_dir,) = runs.glob("tiny-*")  # a folder of its own: <run_name>-<flow run id[:8]>
        first = digest(run_dir)

        # run again, same parameters: another folder of its own, the first one untouched
        again = deployment_run({"overrides": overrides}, env)
        assert again.returncode == 0 and "Completed" in again.stdout, again.stdout[-3000:]
        assert len(list(runs.glob("tiny-*"))) == 2 and digest(run_dir) == first
        # resume that run with another loss, which a resume may not change (flows/run_folders.py
        # RESUME_SETTABLE): refused, nothing changes
        target = [*overrides, f"run_name={run_dir.name}"]
        changed = deployment_run({"overrides": [*target, "rl.loss.type=cispo"], "resume": True}, env)
        assert changed.returncode != 0 or "Failed" in changed.stdout, changed.stdout[-3000:]
        assert digest(run_dir) == first
        # resume it as it was: it already finished, so Completed and left as it is
        same = deployment_run({"overrides": target, "resume": True}, env)
        assert same.returncode == 0 and "Completed" in same.stdout, same.stdout[-3000:]
        assert digest(run_dir) == first
        listed = json.loads(run([sys.executable, "-c", FLOW_RUNS, run_dir.name], env, 120).stdout)
    finally:
        if worker is not None:
            stop_group(worker)

    # prefect.yaml's deployments, each of its flow, as the server holds them
    assert listed["deployments"] == ["pipeline/pipeline", "pipeline/tiny", "pretrain/pretrain", "rl/rl", "sft/sft"]
    # flow runs are named after their run folder; SFT and RL are subflows with task runs
    names = {r["name"]: r for r in listed["flows"]}
    assert run_dir.name in names and not names[run_dir.name]["subflow"], sorted(names)
    for phase in ("sft", "rl"):
        subflow = names[f"{run_dir.name}/{phase}"]
        assert subflow["subflow"] and subflow["state"] == "Completed"
        assert subflow["id"] in listed["tasks"], f"no task runs in the {phase} subflow"
    # a checkpoint task run only where a checkpoint was saved: SFT's last step, RL's steps 2 and 4
    checkpoint_runs = [listed["checkpoint_tasks"].count(names[f"{run_dir.name}/{phase}"]["id"]) for phase in ("sft", "rl")]
    assert checkpoint_runs == [1, 2], checkpoint_runs

    # the run it made: both phases' tables and checkpoints, registered in MLflow with aliases
    from mlflow import MlflowClient
    from rlpipe.storage.writer import read_table

    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    assert sorted(read_table(run_dir / "rl", "train_steps").column("step").to_pylist()) == [1, 2, 3, 4]
    assert read_table(run_dir / "sft", "train_steps").num_rows == SFT_STEPS
    assert read_table(run_dir / "rl", "rollouts").num_rows > 0
    assert sorted(read_table(run_dir / "rl", "checkpoints").column("step").to_pylist()) == [2, 4]
    # both flow runs are versions of the deployment's two models, one per phase, told apart by run_dir
    client = MlflowClient(tracking_uri=f"sqlite:///{runs / 'mlflow.db'}")
    assert sorted(m.name for m in client.search_registered_models()) == ["tiny", "tiny-sft"]
    versions = client.search_model_versions("name='tiny'")
    assert {v.tags.get("run_dir") for v in versions} == {str((folder / "rl").resolve()) for folder in runs.glob("tiny-*")}
    assert {v.tags.get("step") for v in versions if v.tags.get("run_dir") == str((run_dir / "rl").resolve())} == {"2", "4"}
    assert len({v.tags.get("run_dir") for v in client.search_model_versions("name='tiny-sft'")}) == 2
    # nothing of ours is left running
    assert worker.poll() is not None
