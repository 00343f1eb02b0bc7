"""SIGKILL a pipeline run, resume it, and lose nothing: an async run killed at a random stage, and
a run killed between a checkpoint's rename and its row. The runs are subprocesses of the real CLI
(`rlpipe run`, `rlpipe resume`); this module's helpers serve the other CLI tests.

A run killed once at a random RL stage and resumed to the uninterrupted run's weights is
test_faults.py's (ten kills, SFT's stages and RL's, each followed by a resume).
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import warm_cli
from tests.mlflow_store import made_store
from tests.seeds import draw_seed

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlpipe.flows.cli", *args]


def env_for(tmp_path: Path, prefect_api_url: str | None = None) -> dict[str, str]:
    """The CLI's environment: its own Prefect home and MLflow store under tmp_path; the session's
    Prefect server (conftest.prefect_api_url) where given, else an embedded one per process."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), MLFLOW_TRACKING_URI=made_store(tmp_path / "mlflow.db"),
               RLPIPE_PROGRESS="0", DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="90")
    if prefect_api_url:
        # one server's SQLite shared by concurrent runs on 2 busy cores: wait on locks, don't fail
        env.update(PREFECT_API_URL=prefect_api_url, PREFECT_API_REQUEST_TIMEOUT="120")
    return env


# One torch thread per CLI process (the `threads` knob): tiny models gain nothing from a second one,
# and two runs side by side (test_faults) or a busy machine make torch's threads wait on each other:
# 20 SFT steps took 6-8 s with one thread, 24-49 s with torch's default of 2 on a loaded CPU with 2 cores.
ONE_THREAD = ["--set", "threads=1"]


def run_args(runs_root: Path, name: str) -> list[str]:
    return ["run", str(ROOT / "configs" / "tiny.toml"), "--set", f"runs_root={runs_root}",
            "--set", f"run_name={name}", "--set", "rl.checkpoint_every=1", *ONE_THREAD]


def rows(run_dir: Path, table: str) -> int:
    """The RL table's rows as readers see them: the ones its snapshot names (a file a killed run
    renamed into place but never committed is not the table's)."""
    from rlpipe.storage.writer import read_table

    return read_table(run_dir / "rl", table).num_rows


def sample_versions(run_dir: Path) -> set[tuple[str, int]]:
    """(sample_id, policy_version) of every committed rollout (as `rows` reads)."""
    from rlpipe.storage.writer import read_table

    table = read_table(run_dir / "rl", "rollouts").select(["sample_id", "policy_version"])
    return set(zip(table["sample_id"].to_pylist(), table["policy_version"].to_pylist(), strict=True))


def test_async_sigkill_then_resume_loses_no_rollout_and_trains_none_twice(tmp_path, prefect_api_url):
    from tests.integration.test_async_rl import staleness_report, untracked_groups

    runs = tmp_path / "runs"
    env = env_for(tmp_path, prefect_api_url)
    args = [*run_args(runs, "async"), "--set", "rl.off_policy.max_steps=1", "--set", "rl.steps=6"]
    seed = draw_seed("test_async_sigkill_then_resume_loses_no_rollout_and_trains_none_twice")
    table, step = random.Random(seed).choice([("rollouts", 3), ("scores", 4), ("groups", 2), ("batches", 3),
                                          ("train_steps", 2), ("checkpoints", 3), ("advantages", 5)])
    where = f"kill point {table}/step={step}, seed {seed}"
    trigger = runs / "async" / "rl" / "tables" / table / f"step={step}"
    process = warm_cli.Popen(cli(*args), env=env, cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not trigger.exists() and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert process.poll() is None, f"run ended before the {where}"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    before = sample_versions(runs / "async")
    resumed = warm_cli.run(cli("resume", str(runs / "async")), env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)
    assert resumed.returncode == 0, f"{where}: {resumed.stderr[-3000:]}"
    rl_dir = runs / "async" / "rl"
    assert before <= sample_versions(runs / "async"), where  # every sampled rollout kept, same policy version
    low, high, trained, distinct = staleness_report(rl_dir)
    assert 0 <= low and high <= 1 and trained == distinct > 0, where
    assert untracked_groups(rl_dir) == 0, where
    assert rows(runs / "async", "train_steps") == 6, where


KILL_AFTER_RENAME = """
import os, sys
import rlpipe.tasks.checkpoint as checkpoint
real = checkpoint.save_and_register
def save_then_die(**kwargs):
    row = real(**kwargs)
    if kwargs["step"] == 2 and kwargs["run_dir"].name == "rl":
        os.killpg(0, 9)  # the checkpoint is renamed, its checkpoints row not yet written; the group:
        # an embedded Prefect server (if any) would otherwise outlive us and hold our output pipes open
    return row
checkpoint.save_and_register = save_then_die
from rlpipe.flows.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_kill_right_after_the_checkpoint_rename_is_repaired_on_resume(tmp_path, prefect_api_url):
    runs = tmp_path / "runs"
    env = env_for(tmp_path, prefect_api_url)
    killed = warm_cli.run([sys.executable, "-c", KILL_AFTER_RENAME, *run_args(runs, "window")], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=600, start_new_session=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    rl_dir = runs / "window" / "rl"
    assert (rl_dir / "checkpoints" / "step_000002").is_dir()
    assert not (rl_dir / "tables" / "checkpoints" / "step=2").exists()
    assert (rl_dir / "tables" / "train_steps" / "step=2").exists()  # on disk before the rename
    resumed = warm_cli.run(cli("resume", str(runs / "window")), env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert rows(runs / "window", "checkpoints") == 4 and rows(runs / "window", "train_steps") == 4
