"""Every `rl.loss.type` from every entry point: `rlpipe run --set rl.loss.type=NAME` to the end,
its config.json read back as `rlpipe resume` reads it (validated again, and equal to the config the
run had), and a deployment's parameters (a dumped config with overrides, flows/common.py
`resolve_config`, what a flow run does first). tests/integration/test_deployments.py runs one
loss through a real Prefect deployment.

Stopping and resuming is the same for every loss (a loss holds no state; what differs per loss is
its config, read back above, and whether it uses the sampler's log-probs and which normaliser):
one run, `dr_grpo` (log-prob ratios and its constant normaliser), is stopped by SIGTERM after its
first checkpoint and continued by `rlpipe resume`.

The run is RL on tiny.toml's task from its SFT result (the session's shared `sft_checkpoint`, which
answers some prompts, so some groups' rewards differ and the run trains: a run that trains no
sample ends with exit 1), with zero-variance groups kept, so every step fills its batch however the
policy answers.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from rlpipe.training.rl_loss import LOSS_NAMES, LOSSES

from tests import warm_cli
from tests.integration.test_rl_loop_regression import sft_checkpoint  # noqa: F401 - fixture
from tests.mlflow_store import made_store

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS = 4


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "rlpipe.flows.cli", *args]


def env_for(tmp_path: Path, prefect_api_url: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect"), PREFECT_API_URL=prefect_api_url,
               PREFECT_API_REQUEST_TIMEOUT="120", MLFLOW_TRACKING_URI=made_store(tmp_path / "mlflow.db"),
               RLPIPE_PROGRESS="0", DO_NOT_TRACK="1", PREFECT_SERVER_ANALYTICS_ENABLED="false")
    return env


def overrides(runs: Path, loss: str, start: str) -> list[str]:
    settings = [f"runs_root={runs}", "run_name=r", "flow=rl", f"model.path={start}", f"rl.loss.type={loss}",
                f"rl.steps={STEPS}",
                "rl.checkpoint_every=1", "rl.eval_every=0", "rl.filter.drop_zero_variance=false",
                "task.eval_examples=4", "rl.prompts_per_step=2", "rl.group_size=4", "threads=1"]
    return [part for setting in settings for part in ("--set", setting)]


def saved_loss(run_dir: Path, loss: str) -> None:
    """The run's config.json names `loss` with the normaliser left unset, and reads back as
    `rlpipe resume` reads it (flows/runner.py main_resume) to the config it was written from."""
    from rlpipe.tasks.config import read_run_config

    path = run_dir / "config.json"
    saved = json.loads(path.read_text())
    assert saved["rl"]["loss"]["type"] == loss and saved["rl"]["optim"]["normaliser"] is None
    again = read_run_config(saved, str(path))
    assert again.model_dump(mode="json") == saved
    assert again.rl.loss.type == loss and again.rl.loss_normaliser()[0] == (LOSSES[loss].normaliser or "token")


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_every_loss_runs_from_the_cli(tmp_path, prefect_api_url, sft_checkpoint, loss):  # noqa: F811
    from rlpipe.storage.writer import read_table

    env, runs = env_for(tmp_path, prefect_api_url), tmp_path / "runs"
    run_dir = runs / "r"
    done = warm_cli.run(cli("run", str(ROOT / "configs" / "tiny.toml"), *overrides(runs, loss, sft_checkpoint)),
                        cwd=tmp_path,
                        env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    assert sorted(read_table(run_dir, "train_steps").column("step").to_pylist()) == list(range(1, STEPS + 1))
    saved_loss(run_dir, loss)


def test_a_run_stopped_by_sigterm_resumes_from_the_cli(tmp_path, prefect_api_url, sft_checkpoint):  # noqa: F811
    from rlpipe.storage.writer import read_table

    loss = "dr_grpo"
    env, runs = env_for(tmp_path, prefect_api_url), tmp_path / "runs"
    run_dir = runs / "r"
    log = tmp_path / "run.log"
    process = warm_cli.Popen(cli("run", str(ROOT / "configs" / "tiny.toml"), *overrides(runs, loss, sft_checkpoint)),
                             cwd=tmp_path, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (run_dir / "checkpoints" / "step_000001").is_dir():
            assert process.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=300) == 143, log.read_text()[-3000:]
    finally:
        if process.poll() is None:
            process.kill()
    assert json.loads((run_dir / "run.json").read_text())["status"] == "failed"
    stopped_at = len(read_table(run_dir, "train_steps").column("step").to_pylist())
    assert 1 <= stopped_at < STEPS

    resumed = warm_cli.run(cli("resume", str(run_dir)), cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert json.loads((run_dir / "run.json").read_text())["status"] == "finished"
    assert sorted(read_table(run_dir, "train_steps").column("step").to_pylist()) == list(range(1, STEPS + 1))
    saved_loss(run_dir, loss)


@pytest.mark.parametrize("loss", LOSS_NAMES)
def test_every_loss_as_deployment_parameters(tmp_path, loss):
    # a deployment's `config` parameter (a dumped config.json) with `overrides`, and its config_path form
    from rlpipe.flows.common import resolve_config
    from rlpipe.tasks.config import load_config

    dumped = load_config(ROOT / "configs" / "rl.toml", [f"runs_root={tmp_path}"]).model_dump(mode="json")
    for config in (resolve_config(None, [f"rl.loss.type={loss}"], dumped),
                   resolve_config(str(ROOT / "configs" / "rl.toml"), [f"rl.loss.type={loss}"], None)):
        assert config.rl.loss.type == loss
        assert config.rl.loss_normaliser()[0] == (LOSSES[loss].normaliser or "token")
    assert not any(tmp_path.iterdir())
