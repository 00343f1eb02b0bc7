"""README.md's commands run as printed (tests/readme_commands.py lists them and why some are not).

In a temporary folder holding a copy of configs/ and a `mypkg/rewards.py` with a `strict` reward,
the demo run is made by its README command with smaller sizes (`--set`, as the README shows),
then every command marked RUN runs through bash exactly as README prints it, with the checkout's
environment first on PATH (`rlpipe`, `python`). Rescoring that run with its own reward (the
demo's environment, as a user's `mypkg.rewards:own`) gives back its `scores` table.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from rlpipe.storage.writer import read_table

from tests.readme_commands import COMMANDS, FIXTURE, RUN, readme_commands

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow

# The demo with smaller sizes: what README's run commands read (the tables of step 60) is there;
# zero-variance groups are kept so that every step trains whatever the short SFT left.
DEMO_SIZES = ["sft.steps=30", "sft.eval_every=0", "sft.checkpoint_every=0", "rl.steps=60",
              "rl.prompts_per_step=4", "rl.group_size=4", "rl.filter.drop_zero_variance=false",
              "task.eval_examples=20", "task.options.eval_size=20"]

USER_REWARDS = '''\
import functools
import tomllib

from rlpipe.envs.registry import build_env


def strict(completion_text, answer, example):
    """1 for exactly the expected text, no surrounding spaces."""
    return float(completion_text == example.meta["target_text"])


@functools.cache
def demo_env():
    with open("configs/demo.toml", "rb") as f:
        task = tomllib.load(f)["task"]
    return build_env(task["env"], **task["options"])


def own(completion_text, answer, example):
    """The demo's own reward: its environment, built as configs/demo.toml builds it."""
    return demo_env().score(example, completion_text)
'''

# what each command's output must show, beyond exit status 0 (a terminal table may cut its headers)
SHOWS = {
    "rlpipe sql runs/demo/rl --query reward_by_step": "60 row(s)",
    "rlpipe report runs/demo/rl runs/demo/sft": "report",
    "rlpipe rescore runs/demo/rl --reward mypkg.rewards:strict": "re-scored",
    "rlpipe sql runs/demo/rl/rescore/strict --query rescore_compare": "60 row(s)",
    'rlpipe sql runs "select run, step, avg(reward) from scores group by all order by all"': "demo/rl",
    "rlpipe run --help-config": "rl.loss.type",
    "python -m rlpipe.engines.tool_check tiny-tools": "tool_check: ok",
}


def shell(command: str, cwd: Path, env: dict, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory, prefect_api_url) -> tuple[Path, dict]:
    """A user's folder after the demo: configs/, mypkg/, runs/demo (SFT then RL, MLflow under runs/)."""
    work = tmp_path_factory.mktemp("readme")
    shutil.copytree(ROOT / "configs", work / "configs")
    (work / "mypkg").mkdir()
    (work / "mypkg" / "__init__.py").write_text("")
    (work / "mypkg" / "rewards.py").write_text(USER_REWARDS)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "PYTHONPATH"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PREFECT_API_URL=prefect_api_url, PREFECT_API_REQUEST_TIMEOUT="120",
               PREFECT_HOME=str(work / ".prefect"), RLPIPE_PROGRESS="0", DO_NOT_TRACK="1")
    [fixture] = [command for command, action in COMMANDS.items() if action == FIXTURE]
    printed = fixture.split(" [")[0]  # the README's optional `[--set ...]` filled in
    made = shell(printed + "".join(f" --set {setting}" for setting in DEMO_SIZES), work, env, timeout=1500)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    assert (work / "runs" / "demo" / "rl" / "checkpoints" / "step_000060").is_dir()
    return work, env


def test_readme_commands_run_as_printed(demo_folder):
    work, env = demo_folder
    commands = [command for command in readme_commands() if COMMANDS.get(command) == RUN]
    assert len(commands) >= 11
    failed = []
    for command in commands:
        done = shell(command, work, env)
        shown = SHOWS.get(command, "")
        if done.returncode != 0 or shown not in done.stdout:
            failed.append(f"$ {command}\nexit {done.returncode}\n{done.stdout[-1500:]}\n{done.stderr[-1500:]}")
    assert not failed, "\n\n".join(failed)
    assert (work / "runs" / "demo" / "rl" / "report.html").is_file()
    assert (work / "runs" / "demo" / "rl" / "rescore" / "strict" / "tables").is_dir()


def test_rescoring_the_demo_with_its_own_reward_reproduces_its_scores(demo_folder):
    work, env = demo_folder
    done = shell("rlpipe rescore runs/demo/rl --reward mypkg.rewards:own", work, env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run_dir = work / "runs" / "demo" / "rl"

    def rewards(folder: Path) -> dict[str, tuple[float, str]]:
        rows = read_table(folder, "scores").to_pylist()
        return {row["sample_id"]: (row["reward"], json.dumps(row["components"], sort_keys=True)) for row in rows}

    original, again = rewards(run_dir), rewards(run_dir / "rescore" / "own")
    assert len(original) >= 60 * 4 * 4  # every sample of every step (zero-variance groups kept)
    assert {reward for reward, _ in original.values()} >= {0.0, 1.0}  # right and wrong samples both
    assert again == original
    for table in ("groups", "advantages"):
        assert read_table(run_dir / "rescore" / "own", table).num_rows == read_table(run_dir, table).num_rows, table
