"""docs/CLUSTER.md's single-machine commands run exactly as printed (tests/cluster_commands.py lists
every command of the page, and why each other one needs a real cluster), one after the other in one
folder holding a copy of configs/, as a user follows the page: the tiny pipeline on two training
ranks, then on one process with its scoring on a local Dask cluster of 2 worker processes."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from rlpipe.storage.writer import read_table
from test_readme_commands import shell  # same folder: pytest puts it on sys.path

from tests.cluster_commands import COMMANDS, RUN, cluster_commands

ROOT = Path(__file__).resolve().parents[2]
# found, not imported: importing Dask here would cost every worker that collects this file a second
pytestmark = [pytest.mark.slow, pytest.mark.skipif(importlib.util.find_spec("prefect_dask") is None,
                                                   reason="prefect-dask is not installed (the cluster extra)")]


def test_cluster_page_commands_run_as_printed(tmp_path, prefect_api_url):
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "PREFECT_", "PYTHONPATH"))}
    env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",
               PREFECT_API_URL=prefect_api_url, PREFECT_API_REQUEST_TIMEOUT="120",
               PREFECT_HOME=str(tmp_path / ".prefect"), RLPIPE_PROGRESS="0", DO_NOT_TRACK="1")
    commands = [command for command in cluster_commands() if COMMANDS[command] == RUN]
    assert len(commands) == 2
    for command in commands:
        done = shell(command, tmp_path, env)
        assert done.returncode == 0, f"$ {command}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    runs = tmp_path / "runs"
    for name, key, value in (("tiny", "train", {"parallel": "ddp"}), ("tiny-dask", "cluster", {"runner": "dask"})):
        assert json.loads((runs / name / "run.json").read_text())["status"] == "finished", name
        config = json.loads((runs / name / "rl" / "config.json").read_text())
        assert value.items() <= config[key].items(), (name, config[key])
    scored = read_table(runs / "tiny-dask" / "rl", "scores").to_pylist()
    sampled = read_table(runs / "tiny-dask" / "rl", "rollouts").to_pylist()
    assert [row["sample_id"] for row in scored] == [row["sample_id"] for row in sampled]  # each once, in order
