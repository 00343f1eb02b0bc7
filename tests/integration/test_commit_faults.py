"""SIGKILL right after each rename of a checkpoint's commit (its folder, its registered version,
its `checkpoints` row, the `origins` row, a table partition), then `rlpipe resume`: the real CLI in
subprocesses, killed at exact points by tests/fault_hooks (a test-only `os.replace` hook).

One `tiny` pipeline is killed at every point in turn, each resume carrying on where the last kill
left it (so a kill also lands inside a resume's completion of an earlier commit), and then resumed
to the end. Afterwards every checkpoint has exactly one registered version and a row naming it,
`origins` names the SFT version RL started from, lineage walks RL → SFT, and the `best` alias
points where the evals say. The points are fixed (no random choice).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_faults import STEP_TIMEOUT_S, best_step, mlflow_statuses
from test_resume import ONE_THREAD, cli, env_for

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[2]
HOOKS = ROOT / "tests" / "fault_hooks"
pytestmark = pytest.mark.slow
SFT_STEPS = 4

# In the order the run reaches them (SFT checkpoints every 2 of 4 steps, RL every 2 of 4): the
# commit's mechanics, not learning, so SFT is cut from tiny.toml's 40 steps to 4.
# A `before:` point on a `checkpoints` row is reached by the resume that completes that commit:
# the version is registered, the row not yet written.
KILL_POINTS = [
    "after:*/sft/checkpoints/step_000002",
    "before:*/sft/tables/checkpoints/step=2/part-0.parquet",
    "after:*/sft/checkpoints/step_000004",
    "after:*/rl/tables/origins/step=0/part-0.parquet",
    "after:*/rl/checkpoints/step_000002",
    "before:*/rl/tables/checkpoints/step=2/part-0.parquet",
    "after:*/rl/tables/train_steps/step=3/part-0.parquet",
    "after:*/rl/checkpoints/step_000004",
]


def run_killed_at(command: list[str], env: dict[str, str], point: str, log: Path) -> int:
    """Run `command` with the kill point armed; its exit status (-9: killed there)."""
    process = warm_cli.Popen(command, env={**env, "RLPIPE_TEST_KILL": point}, cwd=ROOT,
                             stdout=subprocess.DEVNULL, stderr=log.open("w"), start_new_session=True)
    try:
        return process.wait(timeout=STEP_TIMEOUT_S)
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # anything it left running
        except ProcessLookupError:
            pass


def table_rows(phase_dir: Path, table: str) -> list[dict]:
    files = sorted((phase_dir / "tables" / table).glob("step=*/part-0.parquet"))
    return [row for f in files for row in pq.read_table(f).to_pylist()]


def checkpoint_rows(phase_dir: Path) -> dict[int, dict]:
    return {row["step"]: row for row in table_rows(phase_dir, "checkpoints")}


def test_sigkill_after_each_rename_of_a_commit_then_resume(tmp_path, prefect_api_url):
    runs = tmp_path / "runs"
    env = env_for(tmp_path, prefect_api_url)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOKS), env.get("PYTHONPATH")]))
    run_dir = runs / "chain"
    command = cli("run", str(ROOT / "configs" / "tiny.toml"), "--set", f"runs_root={runs}", "--set", "run_name=chain",
                  "--set", f"sft.steps={SFT_STEPS}", "--set", "sft.checkpoint_every=2", *ONE_THREAD)
    for number, point in enumerate(KILL_POINTS):
        log = tmp_path / f"kill-{number}.log"
        code = run_killed_at(command, env, point, log)
        assert code == -signal.SIGKILL, f"not killed at {point}: exit {code}\n{log.read_text()[-3000:]}"
        command = cli("resume", str(run_dir))
    done = warm_cli.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]

    from mlflow import MlflowClient
    from rlpipe.storage.lineage import version_lineage

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    for phase, model, steps in (("sft", "chain-sft", [2, 4]), ("rl", "chain", [2, 4])):
        rows = checkpoint_rows(run_dir / phase)
        assert sorted(rows) == steps, phase
        found = client.search_model_versions(f"name = '{model}'")
        by_step = {int(v.tags["step"]): str(v.version) for v in found}
        assert len(found) == len(steps) and sorted(by_step) == steps, [(v.version, v.tags["step"]) for v in found]
        for step, row in rows.items():
            metadata = json.loads((run_dir / phase / "checkpoints" / f"step_{step:06d}" / "metadata.json").read_text())
            assert row["mlflow_model_version"] == by_step[step] and row["sha256"] == metadata["sha256"], (phase, step)
    sft_versions = {int(v.tags["step"]): str(v.version) for v in client.search_model_versions("name = 'chain-sft'")}
    origin = table_rows(run_dir / "rl", "origins")
    assert len(origin) == 1 and origin[0]["parent_model_version"] == sft_versions[SFT_STEPS]
    assert origin[0]["parent_step"] == SFT_STEPS
    rl_last = checkpoint_rows(run_dir / "rl")[4]["mlflow_model_version"]
    chain = version_lineage(client, f"models:/chain/{rl_last}")
    assert [entry["model"] for entry in chain] == [f"models:/chain/{rl_last}", f"models:/chain-sft/{sft_versions[SFT_STEPS]}"]

    # the `best` alias: moved by each checkpointed eval that beat every one before it (step 0's included)
    evals = table_rows(run_dir / "rl", "evals")
    accuracy = {s: sum(r["correct"] for r in evals if r["step"] == s) / sum(r["step"] == s for r in evals)
                for s in {r["step"] for r in evals}}
    best, expected = accuracy[0], None
    for step in (2, 4):
        if accuracy[step] > best:
            best, expected = accuracy[step], str(step)
    assert best_step(tmp_path / "mlflow.db", "chain") == expected
    for folder in (run_dir, run_dir / "sft", run_dir / "rl"):
        assert json.loads((folder / "run.json").read_text())["status"] == "finished", folder
    assert set(mlflow_statuses(tmp_path / "mlflow.db", "rlpipe-tiny").values()) == {"FINISHED"}


def test_data_parallel_sigkill_after_a_checkpoint_rename_then_resume(tmp_path, prefect_api_url):
    """Two ranks (gloo on the CPU): rank 0 killed right after an RL checkpoint's rename, then its
    resume killed after registering that checkpoint but before its row; the last resume
    finishes with one registered version per checkpoint and rows naming them."""
    runs = tmp_path / "runs"
    env = env_for(tmp_path, prefect_api_url)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HOOKS), env.get("PYTHONPATH")]))
    run_dir = runs / "ranks"
    command = cli("run", str(ROOT / "configs" / "tiny.toml"), "--nproc-per-node", "2", "--set", f"runs_root={runs}",
                  "--set", "run_name=ranks", "--set", "sft.steps=3", "--set", "rl.steps=4", *ONE_THREAD)
    for number, point in enumerate(["after:*/rl/checkpoints/step_000002",
                                    "before:*/rl/tables/checkpoints/step=2/part-0.parquet"]):
        log = tmp_path / f"kill-{number}.log"
        code = run_killed_at(command, env, point, log)
        assert code != 0 and "rank 0 (local rank 0" in log.read_text() and "SIGKILL" in log.read_text(), \
            f"not killed at {point}: exit {code}\n{log.read_text()[-3000:]}"
        command = cli("resume", str(run_dir), "--nproc-per-node", "2")
    done = warm_cli.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=STEP_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]

    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}")
    for phase, model, steps in (("sft", "ranks-sft", [3]), ("rl", "ranks", [2, 4])):
        found = client.search_model_versions(f"name = '{model}'")
        by_step = {int(v.tags["step"]): str(v.version) for v in found}
        assert len(found) == len(steps) and sorted(by_step) == steps, phase
        assert {s: r["mlflow_model_version"] for s, r in checkpoint_rows(run_dir / phase).items()} == by_step
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
